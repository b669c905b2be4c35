"""``baton status`` says what is true of the store's grace now (issue 39 §4): a store up
for longer than every lease_ttl, with no epoch yet, has no grace in force; one that just
started says how long is left. Before, both printed "grace: no store epoch: the next
lease waits until the store's start + lease_ttl (none if it started longer ago...)"."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.ops.test_commands import baton
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers


def _uptime(store_server: StoreServer) -> int:
    with store_server.client() as client:
        return int(client.info("server")["uptime_in_seconds"])


def _status(workers: Workers, *args: str, lease_ttl: str = "") -> Any:
    env = {"BATON_TEST_APP_LEASE_TTL": lease_ttl} if lease_ttl else None
    done = baton(workers, "status", *args, app="tests.apps.exclusive", env=env)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout) if args else done.stdout


@pytest.mark.timeout(120)
def test_a_store_up_for_longer_than_every_lease_ttl_has_no_grace(
    workers: Workers, store_server: StoreServer, store_url: str
) -> None:
    # The test app's longest lease_ttl is the default, 8 s.
    wait_until(lambda: _uptime(store_server) > 10, 30, "the store up for more than 10 s")
    assert _status(workers, "--json")["grace"] == ""
    assert "grace" not in _status(workers)


def test_a_store_just_started_says_how_long_its_grace_lasts(
    workers: Workers, store_server: StoreServer, store_url: str
) -> None:
    store_server.restart()  # up for a second or two, its data forgotten
    store_server.forget()
    grace = _status(workers, "--json", lease_ttl="120")["grace"]
    assert "started" in grace and "s more" in grace, grace
    assert "none if" not in grace, grace
