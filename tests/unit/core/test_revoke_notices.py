"""A revoke told on the notice channel (core/revoke_notices.py): what a worker without
remote control reads back is what was told; other notices (a released key, a cancel)
are not read as one."""

from __future__ import annotations

from celery_baton.core.revoke_notices import KEY_ARG, parse_revoke_notice, revoke_notice


def test_a_revoke_reads_back_as_told() -> None:
    told = {"task_id": ["id-1"], "terminate": True, "signal": "SIGKILL", "baton_replaced_by": [
        "t.feed", "id-1", "id-2"]}  # fmt: skip
    assert parse_revoke_notice(revoke_notice(told)) == told
    by_key = {"terminate": True, KEY_ARG: ["t.feed", '{"account_id":7}']}
    assert parse_revoke_notice(revoke_notice(by_key)) == by_key


def test_other_notices_are_not_revokes() -> None:
    assert parse_revoke_notice("baton:{t.feed}:exclusive:abc") is None  # a released key
    assert parse_revoke_notice("baton:cancels\nid\n60000\nid-1") is None  # a cancel
    assert parse_revoke_notice("baton-revoke\nnot json") is None  # unreadable: said, dropped
    assert parse_revoke_notice("baton-revoke\n[1, 2]") is None
