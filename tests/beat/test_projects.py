"""Two projects on one store keep their schedules apart (issue 11, item 10).

``tests.apps.beat_alpha`` and ``tests.apps.beat_beta`` are two Celery apps (different
``app.main``, different ``beat_schedule``; both have an entry ``every1`` of a task
named ``beat.record``) pointed at one store with the default key prefix, as every
project on a developer's machine shares the embedded store. Both beats run at once:
each app's entries fire (each slot once), and neither app's leader removes the other's
entries. Runs are counted by the observer, keyed ``<app>:<entry>|<slot>``.
"""

from __future__ import annotations

import time
from collections import Counter

import pytest

from tests.beat.helpers import wait_for_leading_log, wait_for_slots
from tests.ops.test_commands import as_json
from tests.support.observer import Observer
from tests.support.workers import Workers

ALPHA, BETA = "tests.apps.beat_alpha", "tests.apps.beat_beta"


def _slots(observer: Observer, app: str, entry: str) -> Counter[str]:
    prefix = f"{app}:{entry}|"
    return Counter(s["key"] for s in observer.started() if s["key"].startswith(prefix))


@pytest.mark.timeout(180)  # ~15-30 s on a quiet machine; 60 s is the default
def test_two_apps_on_one_store_both_fire_and_keep_their_entries(
    workers: Workers, observer: Observer
) -> None:
    from celery_baton.beat import ScheduleStore
    from tests.apps import beat_alpha, beat_beta

    workers.start(ALPHA, concurrency=2, wait=False)
    workers.start(BETA, concurrency=2, wait=False)
    alpha_beat = workers.start_beat(ALPHA)
    wait_for_leading_log([alpha_beat])
    beta_beat = workers.start_beat(BETA)
    # Both beats run: beta must lead its own schedule, not follow alpha's leader (five
    # slots of its 1 s entry: a beat's start and its first slots take seconds on a loaded
    # machine, and a slot held late at a worker is coalesced into the next), and every
    # entry of both fires.
    wait_for_slots(observer, "beta:every1", 5, timeout=30)
    for entry in ("alpha:every1", "alpha:alpha_only", "beta:beta_only"):
        wait_for_slots(observer, entry, 1, timeout=30)
    beta_while_both = _slots(observer, "beta", "every1")
    # Alpha's beat stops (SIGTERM: it resigns); beta's goes on alone.
    alpha_beat.stop()
    wait_for_slots(observer, "beta:every1", 2, after_ms=int(time.time() * 1000), timeout=10)
    beta_beat.stop()
    time.sleep(3)  # a slot sent twice would start by now: the counts below are final

    assert len(beta_while_both) >= 5, f"beta's entries did not fire: {beta_while_both}"
    for app, entries in (("alpha", ("every1", "alpha_only")), ("beta", ("every1", "beta_only"))):
        for entry in entries:
            counts = _slots(observer, app, entry)
            assert counts, f"{app}'s entry {entry} never fired"
            twice = {key: n for key, n in counts.items() if n > 1}
            assert not twice, f"{app}: slots run more than once: {twice}"
    # The store still holds each app's own entries, read through each app's API.
    with ScheduleStore(beat_alpha.app) as alpha, ScheduleStore(beat_beta.app) as beta:
        alpha_names = {e["name"] for e in alpha.describe()["entries"]}
        beta_names = {e["name"] for e in beta.describe()["entries"]}
    assert alpha_names == {"every1", "alpha_only"}
    assert beta_names == {"every1", "beta_only"}
    # ``celery -A <app> baton schedule`` reads the keys of that app's beat.
    listed = as_json(workers, "schedule", app=BETA)
    assert {e["name"] for e in listed["entries"]} == {"every1", "beta_only"}
    for beat in (alpha_beat, beta_beat):
        assert "gone from beat_schedule" not in beat.log_text()
