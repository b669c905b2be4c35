"""The cancel records' pure logic (core/cancels.py): key text, members, notices, and
the publish time a stamp carries. The scripts are tested on a real store in
tests/store/test_cancel_scripts.py, the whole in tests/cancel."""

from __future__ import annotations

from typing import Any

import pytest

from celery_baton.core.cancels import (
    NOTICED_MAX,
    CancelWatch,
    KeyCancel,
    Notice,
    cancel_notice,
    covering,
    key_material,
    parse_notice,
)
from celery_baton.core.keys import KeyNames, KeySpec
from celery_baton.core.policy.headers import new_publish_stamp, stamp_time
from celery_baton.errors import KeySpecError

NAMES = KeyNames("baton")


def apply_event(account_id: int, event: str = "", *, region: str = "eu") -> None: ...


def test_a_key_text_is_the_one_a_key_spec_makes_of_the_same_names() -> None:
    material = key_material("t", {"region": "eu", "account_id": 7})
    assert material == '{"account_id":7,"region":"eu"}'
    spec = KeySpec.build(["account_id", "region"], apply_event, subject="t")
    assert spec.material((7, "e"), {}) == material


@pytest.mark.parametrize("key", [{}, [], "account_id", {1: 2}, {"a": object()}])
def test_a_key_that_is_not_a_dict_of_values_is_refused(key: object) -> None:
    with pytest.raises(KeySpecError):
        key_material("t", key)  # type: ignore[arg-type]


def test_a_key_cancel_covers_calls_of_its_key_published_until_its_cut() -> None:
    cancel = KeyCancel(1000, key_material("t", {"account_id": 7}))
    assert KeyCancel.from_member(cancel.member) == cancel
    assert cancel.names == ("account_id",)
    assert cancel.covers(999, cancel.material) and cancel.covers(1000, cancel.material)
    assert not cancel.covers(1001, cancel.material)  # published after the cancel
    assert cancel.covers(None, cancel.material)  # no stamp: before any cancel
    assert not cancel.covers(5, key_material("t", {"account_id": 8}))


def test_notices_are_told_from_release_notices_and_read_back() -> None:
    marker = NAMES.cancels
    by_id = parse_notice(marker, cancel_notice(marker, "id", 1500, "id-1"))
    assert by_id is not None and (by_id.kind, by_id.ttl, by_id.task_id) == ("id", 1.5, "id-1")
    cancel = KeyCancel(5, key_material("t", {"a": "x\ny"}))
    by_key = parse_notice(marker, cancel_notice(marker, "key", 10, f"t.x\n{cancel.member}"))
    assert by_key is not None and (by_key.task, by_key.cancel) == ("t.x", cancel)
    assert parse_notice(marker, "baton:{t}:ex:k") is None
    assert parse_notice(marker, marker + "\nid\nnot-a-number\nx") is None


def test_keys_of_cancels() -> None:
    assert NAMES.cancel_id("5f0c") == "baton:cancel:{5f0c}"  # found from the id alone
    assert NAMES.cancel_keys("proj.apply") == "baton:{proj.apply}:cancel-keys"  # its family


def test_a_stamp_says_when_it_was_published() -> None:
    assert stamp_time(new_publish_stamp(1_764_316_800_123, "ab12")) == 1_764_316_800_123
    assert stamp_time("0123456789abcdef") is None  # an older version's stamp
    assert stamp_time("zz.ab") is None
    assert stamp_time(None) is None


def test_a_worker_remembers_a_bounded_number_of_noticed_ids() -> None:
    watch = CancelWatch(None, keep_noticed=60)  # type: ignore[arg-type]
    for n in range(NOTICED_MAX + 10):
        watch.notice(Notice("id", 30, task_id=f"id-{n}"))
    assert len(watch._noticed) <= NOTICED_MAX
    assert watch.noticed(f"id-{NOTICED_MAX + 9}")  # the newest are kept
    assert watch.ids_live()


def test_a_watch_that_never_read_the_marker_checks_every_delivery() -> None:
    """Until the marker was read once (a worker started while the store was down), it
    is not known whether cancels by id live: every delivery is checked in the store."""

    class Marker:
        fields: dict[str, tuple[int, float]] = {}

        def marker(self) -> dict[str, tuple[int, float]]:
            return self.fields

    watch = CancelWatch(Marker(), keep_noticed=60)  # type: ignore[arg-type]
    assert watch.ids_live()
    watch.refresh()  # read: no cancel by id lives
    assert not watch.ids_live()


def test_a_watch_says_which_tasks_key_cancels_it_read_anew_and_until_when_they_live() -> None:
    """What the worker matches the calls it holds against, once per cancel learned
    (worker/cancelling.py ``mark_held``)."""
    cancel = KeyCancel(1_000, key_material("t", {"account_id": 7}))

    class Store:
        fields: dict[str, tuple[int, float]] = {"key:t": (5_000, 60.0)}

        def marker(self) -> dict[str, tuple[int, float]]:
            return self.fields

        def key_cancels(self, task: str) -> list[tuple[KeyCancel, float]]:
            return [(cancel, 60.0)] if task == "t" else []

    watch = CancelWatch(Store(), keep_noticed=60)  # type: ignore[arg-type]
    assert watch.key_cancel_end("t", cancel) == 0.0  # not known yet
    assert watch.refresh() == ["t"]
    assert watch.key_cancel_end("t", cancel) > 0.0
    assert watch.refresh() == []  # its marker field did not move: nothing read anew
    other = KeyCancel(2_000, key_material("u", {"account_id": 8}))
    watch.notice(Notice("key", 30, task="u", cancel=other))
    assert watch.key_cancel_end("u", other) > 0.0
    assert watch.key_cancel_end("u", cancel) == 0.0


def test_a_call_is_matched_against_one_cancel_when_asked() -> None:
    watch = CancelWatch(None, keep_noticed=60)  # type: ignore[arg-type]
    seven = KeyCancel(1_000, key_material("t", {"account_id": 7}))
    eight = KeyCancel(1_000, key_material("t", {"account_id": 8}))
    for cancel in (seven, eight):
        watch.notice(Notice("key", 30, task="t", cancel=cancel))
    assert watch.key_cancelled("t", apply_event, (7,), {}, 500) == seven
    assert watch.key_cancelled("t", apply_event, (7,), {}, 500, only=seven) == seven
    assert watch.key_cancelled("t", apply_event, (7,), {}, 500, only=eight) is None


def test_a_call_is_matched_against_cancels_read_from_the_store_with_no_watch() -> None:
    """What a call read late matches (``Cancels.key_cancel_covering``): the same rule
    as a worker's watch, over the cancels as read, with its own specs."""

    def apply_event(account_id: int, event: str) -> None: ...

    cancel = KeyCancel.from_member(f"{10**13} " + '{"account_id":7}')
    specs: dict[tuple[str, ...], Any] = {}
    assert covering("t", [cancel], specs, apply_event, (7, "x"), {}, None) is cancel
    assert covering("t", [cancel], specs, apply_event, (8, "x"), {}, None) is None
    by_name = {"account_id": 7, "event": "x"}
    assert covering("t", [cancel], specs, apply_event, (), by_name, None) is cancel
    assert covering("t", [cancel], {}, apply_event, (7, "x"), {}, 10**13 + 1) is None  # sent after
