"""`celery -A app baton web` driven in a real headless browser (Debian's chromium +
chromium-driver, through Selenium; these tests are skipped with the reason where they are
missing), against real workers holding real leases: what an operator sees and clicks."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.ops.web_process import APP, TOKEN
from tests.support.celery_processes import _process_env
from tests.support.observer import Observer
from tests.support.processes import REPO_ROOT
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def _screenshot_dir(tmp_path: Path) -> Path:
    path = Path(os.environ.get("BATON_TEST_ARTIFACTS", str(tmp_path)))
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_browser_shows_a_live_lease_and_unlocks_it_with_the_token(
    workers: Workers, observer: Observer, web_server: Any, browser: Any, tmp_path: Path
) -> None:
    from selenium.common.exceptions import WebDriverException
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

    def gone(element: Any) -> Any:
        """``staleness_of``, and the other way ChromeDriver says it while the page is
        being replaced: "Node with given id does not belong to the document" (seen in a
        CI run, Chromium 156), a plain WebDriverException."""
        check = staleness_of(element)

        def replaced(driver: Any) -> bool:
            try:
                return bool(check(driver))
            except WebDriverException as exc:
                if "does not belong to the document" in str(exc):
                    return True
                raise

        return replaced

    def submit(element: Any) -> None:
        """Click a form's button and wait until the browser shows the answer."""
        element.click()
        WebDriverWait(browser, 20).until(gone(element))

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
            env=_process_env({**workers.env, **env}),  # the workers' lease_ttl: the grace
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
