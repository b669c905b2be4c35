"""`celery -A app baton web`, run as a real command against real workers holding real
leases, and driven in a real headless browser (Debian's chromium + chromium-driver,
through Selenium; the browser test is skipped with the reason where they are missing)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.workers import Workers, _process_env

APP = "tests.apps.exclusive"
TOKEN = "s3cret-token"


class Web:
    """A running ``celery -A app baton web`` process and a client of its HTTP side."""

    def __init__(
        self, workers: Workers, app: str, token: str | None, log: Path, refresh: float = 60
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in workers.env.items() if k != "BATON_WEB_TOKEN"}
        if token is not None:
            env["BATON_WEB_TOKEN"] = token  # the documented way to pass it
        self.log = log
        # A slow refresh: the page must not reload under the browser's clicks.
        command = ["-A", app, "baton", "web", "--port", str(self.port), "--refresh", f"{refresh:g}"]
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *command],
                env=_process_env(env),
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._up, timeout=30, what=f"baton web on {self.port}; log: {log}")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            self.get("/api/state")
        except (urllib.error.URLError, ConnectionError):
            return False
        return True

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            text: str = reply.read().decode()
            return text

    def fetch(self, path: str) -> tuple[int, str, str]:
        """(status, content type, body), whatever the status."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as reply:
                return reply.status, reply.headers["Content-Type"], reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()

    def state(self) -> Any:
        return json.loads(self.get("/api/state"))

    def post(self, path: str, form: dict[str, str], token: str | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(
            self.url + path, data=urllib.parse.urlencode(form).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


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


def _screenshot_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("BATON_TEST_ARTIFACTS", str(tmp_path)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_browser_shows_a_live_lease_and_unlocks_it_with_the_token(
    workers: Workers, observer: Observer, web_server: Any, browser: Any, tmp_path: Path
) -> None:
    from selenium.webdriver.common.by import By
    from selenium.webdriver.support.expected_conditions import staleness_of
    from selenium.webdriver.support.wait import WebDriverWait

    from celery_baton.beat.api import ScheduleStore
    from tests.apps.exclusive import app, mx_skip

    worker = workers.start(APP, concurrency=2)
    # A lease and a unique claim that outlive the test even on a loaded machine.
    running = mx_skip.delay("web-view", "sleep", 40.0, 1)
    observer.starts_of("web-view")
    with ScheduleStore(app) as schedules:
        schedules.add("web-nightly", "tests.apps.exclusive.ex_skip", 3600, args=["nightly", 0])
    web = web_server()
    [lease] = web.state()["leases"]
    assert lease["task_id"] == running.id and lease["worker"] == worker.hostname
    key = lease["key"]

    def row(selector: str) -> list[Any]:
        return list(browser.find_elements(By.CSS_SELECTOR, selector))

    def submit(element: Any) -> None:
        """Click a form's button and wait until the browser shows the answer."""
        element.click()
        WebDriverWait(browser, 20).until(staleness_of(element))

    def click(selector: str, button: str) -> None:
        [found] = row(selector)
        submit(found.find_element(By.CSS_SELECTOR, f"button[value='{button}']"))

    browser.get(web.url)
    page = browser.find_element(By.TAG_NAME, "body").text
    assert key in page and worker.hostname in page and running.id in page, page
    assert "web-nightly" in page and "Unique claims" in page
    shot = _screenshot_dir(tmp_path) / "baton-web.png"
    browser.save_screenshot(str(shot))
    print(f"screenshot: {shot}")

    # Not signed in: no controls to click (issue 28 §4), and a post is refused (403).
    assert not row("button") or [b.text for b in row("button")] == ["sign in"]
    assert web.post("/action", {"action": "pause", "name": "web-nightly"})[0] == 403
    state = web.state()
    assert [r["key"] for r in state["leases"]] == [key]
    assert state["schedule"]["entries"][0]["paused"] is False

    # A wrong token: 403, and still not signed in.
    browser.get(web.url)
    browser.find_element(By.NAME, "token").send_keys("wrong")
    submit(browser.find_element(By.CSS_SELECTOR, "#auth button"))
    assert browser.find_element(By.TAG_NAME, "h1").text == "403 Forbidden"

    browser.get(web.url)
    browser.find_element(By.NAME, "token").send_keys(TOKEN)
    submit(browser.find_element(By.CSS_SELECTOR, "#auth button"))
    assert "actions enabled" in browser.find_element(By.ID, "auth").text

    # A live lease needs force: without it the page says so and the lease stays.
    click(f"tr[data-key='{key}']", "unlock")
    note = browser.find_element(By.ID, "note").text
    assert "force" in note and running.id in note, note
    assert f"{running.id}|" not in note, note  # the holder in words, not the owner token
    assert row(f"tr[data-key='{key}']")

    [lease_row] = row(f"tr[data-key='{key}']")
    lease_row.find_element(By.NAME, "force").click()
    click(f"tr[data-key='{key}']", "unlock")
    assert "1 holder(s) removed" in browser.find_element(By.ID, "note").text
    assert not row(f"tr[data-key='{key}']")
    assert web.state()["leases"] == []

    # The schedule's actions: pause, resume, trigger, each seen in the store.
    click("tr[data-entry='web-nightly']", "pause")
    assert "paused" in row("tr[data-entry='web-nightly']")[0].text
    assert web.state()["schedule"]["entries"][0]["paused"] is True
    click("tr[data-entry='web-nightly']", "resume")
    assert web.state()["schedule"]["entries"][0]["paused"] is False
    click("tr[data-entry='web-nightly']", "trigger")
    assert "run triggered" in row("tr[data-entry='web-nightly']")[0].text
    assert web.state()["schedule"]["entries"][0]["trigger_pending"] is True
    browser.save_screenshot(str(shot.with_name("baton-web-after.png")))
    worker.kill()  # its run would go on for long after the test


def test_actions_need_the_token_and_a_server_without_one_is_read_only(
    workers: Workers, observer: Observer, web_server: Any
) -> None:
    from tests.apps.exclusive import ex_skip

    worker = workers.start(APP, concurrency=1)
    ex_skip.delay("web-token", 40.0)
    observer.starts_of("web-token")
    web = web_server()
    [lease] = web.state()["leases"]
    form = {"action": "unlock", "key": lease["key"], "force": "1"}
    assert web.post("/api/action", form)[0] == 403
    assert web.post("/api/action", form, token="wrong")[0] == 403
    assert web.post("/action", form, token="wrong")[0] == 403
    assert len(web.state()["leases"]) == 1
    status, body = web.post("/api/action", form, token=TOKEN)
    assert status == 200 and json.loads(body)["ok"], body
    assert web.state()["leases"] == []
    missing = {**form, "key": lease["key"].replace(":ex:", ":ex:0")}
    status, body = web.post("/api/action", missing, token=TOKEN)
    assert status == 409 and "no such lease" in body, body

    read_only = web_server(token=None)
    assert "read-only" in read_only.get("/")
    assert "<form class='inline'" not in read_only.get("/")  # no controls to click
    assert read_only.post("/api/action", form, token=TOKEN)[0] == 403
    assert read_only.post("/login", {"token": TOKEN})[0] == 403
    worker.kill()  # its run would go on for long after the test


def test_a_lease_whose_worker_stopped_reporting_is_marked_stale(
    workers: Workers, observer: Observer, web_server: Any
) -> None:
    from tests.apps.exclusive import ex_skip

    worker = workers.start(APP, concurrency=1)
    ex_skip.delay("web-stale", 30.0)
    observer.starts_of("web-stale")
    web = web_server()
    assert [w["hostname"] for w in web.state()["workers"]] == [worker.hostname]
    assert web.state()["leases"][0]["stale"] is False
    worker.kill()  # SIGKILL: its lease lives until its ttl, its reports stop
    wait_until(lambda: web.state()["workers"] == [], timeout=20, what="its report expires")
    [lease] = web.state()["leases"]
    assert lease["stale"] is True
    page = web.get("/")
    assert "STALE" in page and "no live workers" in page
    metrics = web.get("/metrics")
    assert "baton_store_stale_leases 1" in metrics, metrics


def test_limits_show_their_use_now(workers: Workers, observer: Observer, web_server: Any) -> None:
    from tests.apps.limits import capped, crawl

    app = "tests.apps.limits"
    worker = workers.start(app, concurrency=3)
    for _ in range(3):
        capped.delay(40.0)  # two run (global_concurrency=2), one is held
    for _ in range(3):
        crawl.delay()  # one starts (1/m), two are held
    observer.starts_of("capped", n=2)
    observer.starts_of("crawl")
    web = web_server(app=app)

    def limits() -> dict[str, Any]:
        return {t["task"]: t for t in web.state()["limits"]}

    wait_until(
        lambda: (
            limits()["tests.apps.limits.crawl"]["held"] == 2
            and limits()["tests.apps.limits.capped"]["held"] == 1
        ),
        timeout=20,
        what="held requests reported",
    )
    now = limits()
    capped_use = now["tests.apps.limits.capped"]["concurrency"]
    assert capped_use["in_use"] == 2 and capped_use["limit"] == 2, capped_use
    crawl_rate = now["tests.apps.limits.crawl"]["rate"]
    assert crawl_rate["per_second"] == pytest.approx(1 / 60) and crawl_rate["burst"] == 1
    # One start of 1/m: the burst is (nearly) all in use for the rest of the minute.
    assert 0.5 < crawl_rate["burst_in_use"] <= 1 and 30 < crawl_rate["next_start_in"] <= 60
    page = web.get("/")
    assert "2 / 2" in page and "next start in" in page
    metrics = web.get("/metrics")
    assert 'baton_store_concurrency_in_use{task="tests.apps.limits.capped"} 2' in metrics
    worker.kill()  # its runs would go on for long after the test


@pytest.mark.timeout(180)
def test_what_an_operator_sees_signed_out_with_a_wrong_token_and_with_the_store_down(
    workers: Workers,
    observer: Observer,
    web_server: Any,
    browser: Any,
    store_server: Any,
) -> None:
    """Issue 28 §4: no buttons for a read-only visitor; a wrong token is told as such and
    logged; the Workers row counts the worker's live leases; with the store down the
    page stays a page, shows the outage and keeps refreshing, and /metrics reports it
    as a value."""
    from selenium.webdriver.common.by import By

    from tests.apps.exclusive import ex_skip

    # A long lease_ttl: the worker's report is rewritten seldom (every 20 s).
    env = {"BATON_TEST_APP_LEASE_TTL": "60", "BATON_TEST_LEASE_TTL": "60"}
    assert (
        subprocess.run(
            [sys.executable, "-m", "celery", "-A", APP, "baton", "end-grace"],
            env=_process_env(workers.env),
            cwd=REPO_ROOT,
            capture_output=True,
            timeout=60,
        ).returncode
        == 0
    )
    worker = workers.start(APP, concurrency=1, env=env)
    ex_skip.delay("web-28", 90.0)
    observer.starts_of("web-28")
    web = web_server()
    wait_until(lambda: web.state()["leases"][0]["label"], timeout=10, what="the key in words")
    [lease] = web.state()["leases"]

    browser.get(web.url)
    assert (
        "ex_skip(key='web-28')"
        in browser.find_element(By.ID, "leases")
        .find_element(By.XPATH, "following-sibling::table[1]")
        .text
    )  # the key in words beside the key (issue 28 §2)
    assert browser.find_elements(By.CSS_SELECTOR, "form.inline button") == []
    [worker_row] = browser.find_elements(
        By.XPATH, "//h2[@id='workers']/following-sibling::table[1]//tr[td]"
    )
    cells = [c.text for c in worker_row.find_elements(By.TAG_NAME, "td")]
    assert cells[0] == worker.hostname and cells[2] == "1", cells  # the leases column

    wrong = web.post("/login", {"token": "not-it"})
    assert wrong[0] == 403 and "wrong token" in wrong[1], wrong
    wait_until(lambda: "wrong token" in web.log.read_text(), timeout=10, what="logged")
    refused = web.post("/api/action", {"action": "unlock", "key": lease["key"]}, token=TOKEN)
    assert refused[0] == 409 and f"{lease['task_id']}|" not in refused[1], refused
    assert "ex_skip(key='web-28')" in refused[1], refused
    assert "baton_store_up 1" in web.get("/metrics")

    watcher = web_server(token=None, refresh=1)
    browser.get(watcher.url)
    store_server.kill()
    try:
        status, kind, body = watcher.fetch("/")
        assert kind.startswith("text/html") and "store unavailable" in body, (status, body)
        assert "setInterval" in body  # it keeps refreshing
        browser.execute_script("window.batonMarker = 1")
        wait_until(
            lambda: browser.execute_script("return window.batonMarker") is None,
            timeout=15,
            what="the page reloads itself while the store is down",
        )
        assert "store unavailable" in browser.find_element(By.TAG_NAME, "body").text
        status, _, metrics = watcher.fetch("/metrics")
        assert status == 200 and "baton_store_up 0" in metrics, (status, metrics)
    finally:
        store_server.start()
    worker.kill()
