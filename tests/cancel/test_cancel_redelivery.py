"""A cancel outlives the copy of a message its worker held when it died (issue 38).

Kept by default for the broker's ``visibility_timeout`` counted from the cancel, a cancel
made moments after its call was delivered expired before the broker gave a killed
worker's copy back (the timeout counted from the delivery, then kombu's restore scan):
the nemesis soak (seed 721855533, a 15 s timeout) saw 9 cancelled calls start 15.2 to
17.5 s after their cancel, each a copy of a message delivered 0.2 to 1.5 s before it
to a worker the nemesis then killed. The guide promises a redelivered copy never runs.
"""

from __future__ import annotations

import time

from celery import states

from tests.support.observer import Observer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.cancel_redelivery"


def test_the_copy_of_a_killed_workers_message_stays_cancelled_by_default(
    workers: Workers, observer: Observer
) -> None:
    from tests.apps import cancel_redelivery as app

    first = workers.start(APP, concurrency=1)
    app.blocker.delay(8.0)
    observer.starts_of("blocker")
    # Delivered to the busy worker (prefetched), then cancelled with the default ttl.
    call = app.plain.delay(1)
    wait_until(lambda: call.id in first.log_text(), timeout=10, what="the call's delivery")
    done = app.baton.cancel(call.id)
    first.kill()  # its messages come back after visibility_timeout
    workers.start(APP, concurrency=2)
    time.sleep(app.VISIBILITY * 2 + 4)  # the copies came back and ran, or were dropped
    assert call.id not in {s["task_id"] for s in observer.started()}, (
        f"the cancelled call ran: its cancel was kept {done.ttl:g} s"
    )
    assert call.state == states.REVOKED
