"""Celery's ``beat_cron_starting_deadline`` (5.5+) with real ``celery beat`` processes.

Celery's setting says how far back a beat looks when it decides whether a crontab run
is still due: a run missed by more is not caught up. celery-baton's beat calls that an
entry's misfire grace, so the setting is the grace of the crontab entries that do not
name their own ``baton_misfire_grace`` (ignored before: the default grace, 30 s, caught
the run up).

One beat registers two minutely crontab entries and is stopped; it starts again 8 s
after the next minute began, the deadline being 3 s: the entry on the deadline does not
run that minute's slot (recorded as missed), the entry naming its own grace (120 s) runs
it once. Judged by the worker's runs, on the store's clock.
"""

from __future__ import annotations

import time

import pytest
import redis

from tests.beat.helpers import beat_env, runs_per_slot, wait_for_leader
from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.beat_app"
DEADLINE_S = 3
LATE_S = 8  # the beat starts again this long after the missed slot


def _deadline_supported() -> bool:
    from celery.app.defaults import NAMESPACES

    return "cron_starting_deadline" in NAMESPACES["beat"]


def _store_s(store: redis.Redis) -> float:
    seconds, micros = store.time()
    return float(seconds) + float(micros) / 1e6


def _sleep_until(store: redis.Redis, when_s: float) -> None:
    while (left := when_s - _store_s(store)) > 0:
        time.sleep(min(left, 1.0))


@pytest.mark.timeout(240)  # 50-110 s: a minute boundary is waited for
@pytest.mark.skipif(
    not _deadline_supported(), reason="beat_cron_starting_deadline is Celery 5.5's and later's"
)
def test_a_crontab_run_missed_past_the_starting_deadline_is_not_caught_up(
    workers: Workers, observer: Observer, store: redis.Redis
) -> None:
    env = beat_env(
        {
            "on_deadline": {"cron": "* * * * *"},
            "own_grace": {"cron": "* * * * *", "options": {"baton_misfire_grace": 120}},
        }
    )
    env["BEAT_CONF"] = f'{{"beat_cron_starting_deadline": {DEADLINE_S}}}'
    workers.start(APP, env=env, concurrency=2)
    if _store_s(store) % 60 > 40:  # stop the beat well before the boundary it must miss
        _sleep_until(store, (_store_s(store) // 60 + 1) * 60 + 1)
    beat = workers.start_beat(APP, env=env)
    wait_for_leader(store, [beat])
    time.sleep(2.0)  # the leader records both entries and their next slots
    beat.stop()
    stopped_s = _store_s(store)
    missed_s = (stopped_s // 60 + 1) * 60
    assert missed_s - stopped_s > 2, "the beat stopped too near the slot it must miss"
    _sleep_until(store, missed_s + LATE_S)
    again = workers.start_beat(APP, env=env)
    wait_for_leader(store, [again])
    slot_ms = int(missed_s * 1000)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and not runs_per_slot(observer, "own_grace")[slot_ms]:
        time.sleep(0.5)
    time.sleep(3.0)  # time for a wrongly caught-up run of the other entry to start too
    assert runs_per_slot(observer, "own_grace")[slot_ms] == 1, (
        "the entry with its own grace of 120 s did not catch up its slot missed by "
        f"{LATE_S} s: {dict(runs_per_slot(observer, 'own_grace'))}"
    )
    assert runs_per_slot(observer, "on_deadline")[slot_ms] == 0, (
        f"a slot missed by {LATE_S} s ran, with beat_cron_starting_deadline={DEADLINE_S}"
    )
    assert "'on_deadline' missed 1 slot" in again.log_text()
