"""The store's formats (store/schema.py), read back as written."""

from __future__ import annotations

from celery_baton.core.leases import new_owner
from celery_baton.store.schema import (
    hash_tag,
    make_owner,
    owner_parts,
    parse_rate_override,
    rate_override,
)


def test_a_keys_hash_tag_is_its_first_braces_else_the_whole_key() -> None:
    assert hash_tag("baton:{proj.import_feed}:ex:87a5") == "proj.import_feed"
    assert hash_tag("plain") == "plain"
    assert hash_tag("a{}b{c}") == "a{}b{c}"  # Redis: an empty tag hashes the whole key


def test_an_owner_splits_into_what_made_it() -> None:
    assert owner_parts(make_owner("id-1", "w1@host", "7f")) == ("id-1", "w1@host", "7f")
    assert owner_parts("id-2||") == ("id-2", "", "")
    assert owner_parts("bare") == ("bare", "", "")
    task_id, worker, nonce = owner_parts(new_owner("id-3", "w@h"))
    assert (task_id, worker) == ("id-3", "w@h") and nonce


def test_a_rate_override_reads_back() -> None:
    assert parse_rate_override(rate_override(500_000, 2)) == (500_000, 2)
    assert parse_rate_override("250000") == (250_000, 1)
