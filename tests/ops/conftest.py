"""Fixtures of the web view's tests: ``web_server`` starts ``celery -A app baton web``
processes (ended at teardown), ``browser`` is a real headless browser (Debian's chromium +
chromium-driver, through Selenium; a test that asks for it is skipped with the reason
where they are missing)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.ops.web_process import APP, TOKEN, Web
from tests.support.workers import Workers


@pytest.fixture
def web_server(workers: Workers, tmp_path: Path) -> Iterator[Any]:
    started: list[Web] = []

    def start(app: str = APP, token: str | None = TOKEN, refresh: float = 60) -> Web:
        web = Web(workers, app, token, tmp_path / f"web-{len(started)}.log", refresh)
        started.append(web)
        return web

    yield start
    for web in started:
        web.stop()


def _browser_or_skip() -> tuple[str, str]:
    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    driver = shutil.which("chromedriver")
    if chromium is None or driver is None:
        pytest.skip(
            "no headless browser: install Debian's chromium and chromium-driver "
            "(apt-get install chromium chromium-driver) to run the web view's browser test"
        )
    try:
        import selenium  # noqa: F401
    except ImportError:
        pytest.skip("selenium is not installed (it is in the `test` extra)")
    return chromium, driver


@pytest.fixture
def browser() -> Iterator[Any]:
    chromium, driver_path = _browser_or_skip()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = chromium
    for arg in ("--headless=new", "--no-sandbox", "--disable-dev-shm-usage", "--disable-gpu"):
        options.add_argument(arg)
    options.add_argument("--window-size=1400,1000")
    # The system's driver: Selenium must not go looking for (or download) one.
    driver = webdriver.Chrome(options=options, service=Service(executable_path=driver_path))
    driver.set_page_load_timeout(30)
    try:
        yield driver
    finally:
        driver.quit()
