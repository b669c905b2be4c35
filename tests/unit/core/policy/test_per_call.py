"""Per-call options (issue 16): validated at publish, carried in one header. Pure logic."""

from __future__ import annotations

import pytest

from celery_baton import ConfigError
from celery_baton.core.keys import KeySpec
from celery_baton.core.policy.per_call import CallOptions, check_against, key_material, parse


def feed(tenant: int, url: str = "") -> None: ...


def test_a_call_options_dict_round_trips_through_its_header() -> None:
    options = parse(
        "t.feed",
        {"exclusive": "tenant:42", "conflict": "wait", "wait_timeout": 30, "lease_ttl": 120},
    )
    assert options == CallOptions("tenant:42", "wait", 30.0, 120.0)
    assert CallOptions.from_header(options.to_header()) == options
    assert CallOptions.from_header(None) is None


def test_a_mapping_key_names_the_same_key_as_a_declared_spec() -> None:
    declared = KeySpec.build("tenant", feed, subject="t.feed.exclusive")
    assert key_material({"tenant": 42}, subject="s") == declared.material((42,), {})
    assert key_material("tenant:42", subject="s") == "tenant:42"


@pytest.mark.parametrize(
    ("value", "match"),
    [
        ({"exclusiv": "k"}, "did you mean 'exclusive'|did you mean `exclusive`"),
        ({"conflict": "queue"}, "conflict must be one of"),
        ({"wait_timeout": 0}, "wait_timeout must be seconds > 0"),
        ({"lease_ttl": True}, "lease_ttl must be seconds > 0"),
        ({"exclusive": ""}, "must not be empty"),
        ({"exclusive": ["tenant"]}, "a string or a mapping"),
        ({"unique_conflict": "ignore"}, "unique_conflict must be one of"),
        ("tenant:42", "expected a dict"),
        # the task option's name, per call: said what it is there (no near miss before)
        ({"exclusive_conflict": "wait"}, "per call it is `conflict`"),
        ({"exclusive_wait_timeout": 5}, "per call it is `wait_timeout`"),
    ],
)
def test_bad_per_call_input_is_refused_naming_the_task(value: object, match: str) -> None:
    with pytest.raises(ConfigError, match=match) as error:
        parse("t.feed", value)
    assert "t.feed baton=" in str(error.value)


def test_a_policy_for_what_the_call_does_not_have_is_refused() -> None:
    with pytest.raises(ConfigError, match="conflict needs exclusive"):
        check_against("t.feed", parse("t.feed", {"conflict": "wait"}), None)
    check_against("t.feed", parse("t.feed", {"exclusive": "k", "conflict": "wait"}), None)
    with pytest.raises(ConfigError, match="unique_conflict needs unique"):
        check_against("t.feed", parse("t.feed", {"unique_conflict": "raise"}), None)
