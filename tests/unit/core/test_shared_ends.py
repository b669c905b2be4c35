"""core/shared_ends: what a forked process says of an end, read by its parent."""

from __future__ import annotations

import os

from celery_baton.core.shared_ends import ENDING, RECORDED, UNKNOWN, SharedEnds


def test_a_forked_process_says_ending_then_recorded_and_its_parent_reads_it() -> None:
    ends = SharedEnds()
    assert ends.state("w1:owner-a") == UNKNOWN
    pid = os.fork()
    if pid == 0:  # the child: a pool process
        try:
            ends.set("w1:owner-a", ENDING)
            ends.set("w1:owner-b", RECORDED)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    assert ends.state("w1:owner-a") == ENDING and ends.ending("w1:owner-a")
    assert not ends.recorded("w1:owner-a")
    assert ends.recorded("w1:owner-b") and ends.ending("w1:owner-b")
    assert ends.state("w1:owner-c") == UNKNOWN and not ends.ending("w1:owner-c")


def test_two_owners_in_one_slot_never_read_as_each_other() -> None:
    ends = SharedEnds(slots=1)  # every owner shares the one slot
    ends.set("first", RECORDED)
    ends.set("second", ENDING)
    assert ends.state("first") == UNKNOWN  # overwritten: its end is recorded again
    assert ends.state("second") == ENDING
