"""core/shared_cancels: ids the worker's main process was told are cancelled, read by the
processes it forked (before they accept a job)."""

from __future__ import annotations

import os

from celery_baton.core.shared_cancels import SharedCancels


def test_an_id_added_after_the_fork_is_read_by_the_child() -> None:
    noticed = SharedCancels()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: a pool process waiting for its next job
        try:
            os.read(read, 1)  # until the parent was told of the cancel
            os._exit(0 if noticed.has("id-1") and not noticed.has("id-2") else 1)
        finally:
            os._exit(2)
    noticed.add("id-1")
    os.write(write, b"!")
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_two_ids_in_one_slot_never_read_as_each_other() -> None:
    noticed = SharedCancels(slots=1)  # every id shares the one slot
    assert not noticed.has("first")
    noticed.add("first")
    noticed.add("second")
    assert noticed.has("second")
    assert not noticed.has("first")  # overwritten: screened at receipt only, as before


def test_an_id_matched_by_key_carries_until_when_its_cancel_lives() -> None:
    noticed = SharedCancels()
    assert noticed.find("by-id") is None
    noticed.add("by-id")
    noticed.add("by-key", until=1234.5)
    assert noticed.find("by-id") == 0.0  # a hint: the store confirms it
    assert noticed.find("by-key") == 1234.5  # the main process's match, trusted until then
    assert noticed.has("by-key")
    noticed.add("by-key")  # then noticed by id too: asked of the store
    assert noticed.find("by-key") == 0.0


def test_a_key_match_added_after_the_fork_is_read_by_the_child() -> None:
    noticed = SharedCancels()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(read, 1)
            os._exit(0 if noticed.find("id-1") == 99.0 else 1)
        finally:
            os._exit(2)
    noticed.add("id-1", until=99.0)
    os.write(write, b"!")
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0


def test_when_the_notices_were_last_all_heard_is_read_by_the_child() -> None:
    """Not heard yet: 0 (the worker read the store's cancels as it started); after, the
    seconds since, read alike by a process forked before the listener wrote it."""
    noticed = SharedCancels()
    assert noticed.unheard_for(100.0) == 0.0
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        try:
            os.read(read, 1)
            os._exit(0 if noticed.unheard_for(12.5) == 2.5 else 1)
        finally:
            os._exit(2)
    noticed.heard(10.0)
    os.write(write, b"!")
    _, status = os.waitpid(pid, 0)
    assert os.WEXITSTATUS(status) == 0
