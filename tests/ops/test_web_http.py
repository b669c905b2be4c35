"""`celery -A app baton web`, run as a real command against real workers holding real
leases, and read over HTTP: its actions need the token, a stale lease is marked, limits
show their use."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.ops.web_process import APP, TOKEN
from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


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
    status, body = web.post("/api/action", form)
    # An API call without a token was told to "sign in on the page first" (issue 39 §4).
    assert status == 403 and "token is missing" in body and "Bearer" in body, body
    assert "sign in" not in body, body
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
