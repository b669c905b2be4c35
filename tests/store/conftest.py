"""Fixtures of the store tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import redis

from tests.support.servers import StoreServer


@pytest.fixture
def r(store_server: StoreServer) -> Iterator[redis.Redis]:
    """A plain client of the store server under test, to look at what the scripts wrote."""
    with store_server.client() as client:
        yield client
