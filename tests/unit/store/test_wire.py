"""wire.py without a server: a connection taken from redis-py's pool on every
redis-py the Celery versions pin (Celery 5.5's kombu: 5.2 and older)."""

from __future__ import annotations

from typing import Any

import redis

from celery_baton.wire import _needs_command_name, pooled_connection


class BeforeFiveThree:
    """redis-py before 5.3: the command name is required (and unused)."""

    def get_connection(self, command_name: str, *keys: Any, **options: Any) -> Any:
        return ("required", command_name)


class FiveThreeOn:
    """redis-py 5.3 on: optional, and a warning when given."""

    def get_connection(self, command_name: Any = None, *keys: Any, **options: Any) -> Any:
        return ("optional", command_name)


def test_a_pool_that_requires_a_command_name_is_given_one() -> None:
    assert pooled_connection(BeforeFiveThree()) == ("required", "PING")


def test_a_pool_that_does_not_is_given_none() -> None:
    assert pooled_connection(FiveThreeOn()) == ("optional", None)


def test_the_installed_redis_py_is_asked_as_its_signature_says() -> None:
    major, minor = (int(part) for part in redis.__version__.split(".")[:2])
    assert _needs_command_name(redis.ConnectionPool.get_connection) == ((major, minor) < (5, 3))
