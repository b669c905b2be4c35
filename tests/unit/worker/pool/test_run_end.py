"""What the process that ran a task records at its end, for each kind of end: what the
main process would record later, decided as Celery decides (issues 34.4, 35.5)."""

from __future__ import annotations

from celery import states
from celery.exceptions import Ignore, Reject, Retry

from celery_baton.worker.pool.run_end import RunEnd

GUARDED = RunEnd("id|w|1", "done:id", 60.0, "uq:k", "5eed", "", 2)
UNIQUE_ONLY = RunEnd("id|w|1", "", 60.0, "uq:k", "5eed", "", 0)


def test_an_end_celery_is_done_with_records_the_publish_and_frees_the_claim() -> None:
    for state, exc in [
        (states.SUCCESS, None),
        (states.FAILURE, ValueError()),
        (states.IGNORED, Ignore("Replaced by new task")),
        (states.REJECTED, Reject(requeue=False)),
    ]:
        release = GUARDED.release("id", state, exc, acks_late=True)
        assert release is not None, state
        assert (release.done_key, release.done_stamp) == ("done:id", "5eed")
        assert (release.unique_key, release.unique_owner) == ("uq:k", "id")
        assert release.lease_keys == ()  # the leases are the main process's


def test_a_retry_records_its_attempt_and_keeps_the_claim_for_the_retry() -> None:
    release = GUARDED.release("id", states.RETRY, Retry(), acks_late=True)
    assert release is not None
    assert (release.done_key, release.done_stamp) == ("done:id", "5eed@2")
    assert release.unique_key is None
    assert UNIQUE_ONLY.release("id", states.RETRY, Retry(), acks_late=True) is None


def test_a_requeued_message_records_nothing_unless_it_was_acked_at_the_start() -> None:
    requeued = Reject(requeue=True)
    assert GUARDED.release("id", states.REJECTED, requeued, acks_late=True) is None
    acked = GUARDED.release("id", states.REJECTED, requeued, acks_late=False)
    assert acked is not None and acked.done_stamp == "5eed"


def test_unique_only_frees_the_claim_without_a_done_marker() -> None:
    release = UNIQUE_ONLY.release("id", states.SUCCESS, None, acks_late=False)
    assert release is not None
    assert release.done_key is None and release.unique_key == "uq:k"


def test_a_beat_slot_records_no_attempt() -> None:
    slot = RunEnd("id|w|1", "runs:entry", 60.0, "", "", "1000 ", 1)
    assert slot.release("id", states.RETRY, Retry(), acks_late=True) is None
    assert slot.release("id", "PROGRESS", None, acks_late=True) is None
