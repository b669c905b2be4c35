"""Fixtures of the exclusive tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.support.servers import StoreServer


@pytest.fixture
def own_broker() -> Iterator[StoreServer]:
    """A worker's broker alone on its server, for a test that kills it or cuts its
    connections (results and the observer stay on the shared server)."""
    server = StoreServer(name="broker-a")
    server.start()
    yield server
    server.close()
