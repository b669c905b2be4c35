"""Every part uses the store given to ``Baton(app, url=...)`` (issue 11, item 1).

Two beats on two "machines" (own TMPDIR, XDG_RUNTIME_DIR and working directory; no
``$BATON_URL``) for an app that names its store only in ``Baton(app, url=...)``. Before
the fix each beat read ``app.conf`` alone, started a private embedded store on its
machine and led there: every tick was sent once per machine.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import redis

from celery_baton.beat import ScheduleStore
from celery_baton.store.connection import redact_url
from tests.support.machine import Machine
from tests.support.processes import REPO_ROOT
from tests.support.servers import StoreServer
from tests.support.workers import Workers

APP = "tests.apps.url_given"


def _sent_ids(broker: redis.Redis) -> list[str]:
    """Task ids of the messages waiting in the ``url_given`` queue (none is consumed)."""
    return [json.loads(raw)["headers"]["id"] for raw in broker.lrange("url_given", 0, -1)]


def test_two_beats_on_two_machines_use_the_store_given_to_baton(
    workers: Workers,
    store_url: str,
    broker_server: StoreServer,
    tmp_path: Path,
) -> None:
    with broker_server.client() as broker:
        broker.delete("url_given")
        machines = [Machine(tmp_path / f"machine{n}") for n in (1, 2)]
        env = {"TEST_GIVEN_STORE_URL": store_url, "BATON_URL": ""}  # "": unset
        beats = [
            workers.start_beat(APP, env={**env, **m.env}, cwd=m.cwd, wait=False) for m in machines
        ]
        try:
            for beat in beats:
                beat.wait_started()
            time.sleep(8)  # not a wait: the ticks are counted over these 8 s (one leader)
            ids = _sent_ids(broker)
            embedded = [m.embedded_servers() for m in machines]
        finally:
            workers.stop_all()
            for machine in machines:
                machine.stop_embedded_servers()
    per_id = Counter(ids)
    assert ids, workers.report()
    assert max(per_id.values()) == 1, f"ticks sent more than once: {per_id}"
    assert len(ids) <= 10, f"{len(ids)} ticks in 8 s: more than one leader"
    assert embedded == [[], []], "a beat started its own embedded store"
    for beat in beats:  # the banner names the store really used, redacted
        assert f"store -> {redact_url(store_url)}" in beat.log_text()


def test_the_schedule_api_and_the_cli_use_the_store_given_to_baton(
    store_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # $BATON_URL names the store under test; Baton(url=) another database: the one
    # given to Baton must win everywhere.
    given = store_url.rsplit("/", 1)[0] + "/7"
    monkeypatch.setenv("TEST_GIVEN_STORE_URL", given)
    from tests.apps.url_given import app
    from tests.apps.url_given import baton as installed

    with ScheduleStore(app) as schedule:
        assert schedule.store.safe_url == redact_url(given)
    assert installed.store.safe_url == redact_url(given)
    done = subprocess.run(
        [sys.executable, "-m", "celery", "-A", APP, "baton", "status", "--json"],
        env={**os.environ, "TEST_GIVEN_STORE_URL": given},
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0, done.stderr
    assert redact_url(given) in done.stdout
