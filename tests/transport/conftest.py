"""The RabbitMQ queue the held-window tests declare (tests/apps/held_window.py)."""

from __future__ import annotations

import contextlib
import secrets
from collections.abc import Iterator

import kombu
import pytest


@pytest.fixture
def queue(rabbitmq_url: str) -> Iterator[str]:
    """A queue of this test's own (its type is fixed once declared), deleted after."""
    name = f"held-{secrets.token_hex(4)}"
    yield name
    # Not declared when the test failed before its worker started.
    with contextlib.suppress(Exception), kombu.Connection(rabbitmq_url) as conn:
        conn.default_channel.queue_delete(name)
