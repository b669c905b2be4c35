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


@pytest.fixture
def store_url(store_server: StoreServer, app_environ: None) -> str:
    """The store server, running and emptied, and *declared new*: these tests call the
    scripts one by one to check what each decides, and an earlier test's restart must
    not put the next one in a grace (the grace has tests of its own, test_epochs). The
    real-process tests use the deployment's store, never declared new (tests/conftest)."""
    store_server.resume()
    store_server.start()
    store_server.flushall()
    return store_server.url(0)
