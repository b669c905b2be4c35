"""Rough edges of the operator CLI found in a user audit, run as real commands against
real servers and workers: ``limits set --rate`` without ``--burst`` keeps the declared
burst; ``end-grace`` checks the grace and the live workers; a task name typed wrong in
``limits set`` gets the names near it; tables are cut only on a terminal; a redbeat URL
that cannot be read is named."""

from __future__ import annotations

import json

import pytest

from tests.ops.test_commands import as_json, baton
from tests.support.observer import Observer
from tests.support.servers import StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

LIMITS = "tests.apps.limits"
EXCLUSIVE = "tests.apps.exclusive"


@pytest.mark.timeout(180)
def test_limits_set_rate_without_burst_keeps_the_declared_burst(
    workers: Workers, observer: Observer
) -> None:
    """Before: ``limits set`` on a task declared ``10/s`` burst 5 with ``--rate`` alone
    stored burst 1 (``rate 5/s burst 1``), and the workers enforced burst 1."""
    from tests.apps import limits
    from tests.limits.test_rate_limits import admissions, assert_gcra_bound, publish, start_workers

    name = limits.bursty.name
    done = baton(workers, "limits", "set", name, "--rate", "5/s", app=LIMITS)
    assert done.returncode == 0, done.stderr
    after = {t["task"]: t for t in as_json(workers, "limits", app=LIMITS)["tasks"]}
    assert after[name]["overrides"] == {"rate": "200000 5"}, after[name]
    assert "rate 5/s burst 5" in baton(workers, "limits", app=LIMITS).stdout

    # Enforced as shown: the workers read the override's burst (gate "O", then "R").
    start_workers(workers, 2)
    publish(limits.bursty, 12, numbered=True)
    admitted = sorted(admissions(observer.wait_for(12, timeout=60)))
    assert_gcra_bound(admitted, 5, burst=5)
    # Burst 1 at 5/s puts 200 ms between each two starts: 800 ms from the first to the
    # fifth. The burst lets the first five start back to back.
    assert admitted[4] - admitted[0] < 4 * 200_000, [a - admitted[0] for a in admitted[:6]]
    # And the rate is the override's, not the declared 10/s: 12 starts, 5 of them the
    # burst, take at least 7 intervals of 200 ms.
    assert admitted[-1] - admitted[0] >= 7 * 200_000 - 1


def _epoch(store_server: StoreServer) -> str | None:
    with store_server.client() as client:
        value = client.get("baton:epoch")
        return None if value is None else str(value)


def _uptime(store_server: StoreServer) -> int:
    with store_server.client() as client:
        return int(client.info("server")["uptime_in_seconds"])


@pytest.mark.timeout(120)
def test_end_grace_without_a_grace_says_so_and_writes_nothing(
    workers: Workers, store_server: StoreServer, store_url: str
) -> None:
    """Before: ``grace ended: new leases are granted at once``, and the epoch written."""
    # The test app's longest lease_ttl is the default, 8 s.
    wait_until(lambda: _uptime(store_server) > 10, 30, "the store up for more than 10 s")
    assert as_json(workers, "status", app=EXCLUSIVE)["grace"] == ""
    done = baton(workers, "end-grace", app=EXCLUSIVE)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "no grace in effect", done.stdout
    assert _epoch(store_server) is None


@pytest.mark.timeout(180)
def test_end_grace_refuses_while_workers_report_unless_forced(
    workers: Workers, store_server: StoreServer, store_url: str
) -> None:
    """Before: the grace was ended, exit 0, with a worker live (its help said never)."""
    env = {"BATON_TEST_APP_LEASE_TTL": "120"}
    store_server.restart()  # up for a second or two, its data forgotten: in its grace
    store_server.forget()
    worker = workers.start(EXCLUSIVE, concurrency=1, env=env)
    wait_until(
        lambda: json.loads(baton(workers, "status", "--json", app=EXCLUSIVE, env=env).stdout)[
            "workers"
        ],
        timeout=30,
        what="the worker's report",
    )
    refused = baton(workers, "end-grace", app=EXCLUSIVE, env=env)
    assert refused.returncode != 0, refused.stdout
    assert worker.hostname in refused.stderr and "--force" in refused.stderr, refused.stderr
    status = json.loads(baton(workers, "status", "--json", app=EXCLUSIVE, env=env).stdout)
    assert status["grace"], status

    forced = baton(workers, "end-grace", "--force", app=EXCLUSIVE, env=env)
    assert forced.returncode == 0, forced.stderr
    assert "grace ended" in forced.stdout, forced.stdout
    status = json.loads(baton(workers, "status", "--json", app=EXCLUSIVE, env=env).stdout)
    assert status["grace"] == "", status
    worker.kill()


def test_limits_set_on_a_task_name_typed_wrong_names_the_near_ones(workers: Workers) -> None:
    """Before: ``no task named 'proj.tasks.bursty' in this app``, nothing more, while
    ``unlock --task`` answered the same name with the task it meant."""
    unlock = baton(workers, "unlock", "--task", "proj.tasks.bursty", app=LIMITS)
    assert "did you mean tests.apps.limits.bursty?" in unlock.stderr, unlock.stderr
    done = baton(workers, "limits", "set", "proj.tasks.bursty", "--rate", "5/s", app=LIMITS)
    assert done.returncode == 2, done.stderr
    assert "did you mean tests.apps.limits.bursty?" in done.stderr, done.stderr
    done = baton(workers, "limits", "set", "tests.apps.limits.nope", "--rate", "5/s", app=LIMITS)
    assert "no task named 'tests.apps.limits.nope'" in done.stderr, done.stderr
    assert "did you mean tests.apps.limits.paced or " in done.stderr, done.stderr


def test_a_table_is_not_cut_when_printed_to_a_pipe(workers: Workers) -> None:
    """Before: cut to 80 columns whatever stdout was (``… | cat`` showed ``skip/al…``)."""
    listing = as_json(workers, "limits", app=LIMITS)
    done = baton(workers, "limits", app=LIMITS, env={"COLUMNS": ""})
    assert done.returncode == 0, done.stderr
    assert "…" not in done.stdout, done.stdout
    for task in listing["tasks"]:
        if task["rate"]:
            assert task["rate"] in done.stdout, done.stdout


def test_a_redbeat_url_that_cannot_be_read_is_named(workers: Workers) -> None:
    """Before: ``Error: Error 111 connecting to 127.0.0.1:1. Connection refused.``"""
    url = "redis://127.0.0.1:1/0"
    done = baton(workers, "schedule", "import", "--from-redbeat", "--redbeat-url", url)
    assert done.returncode == 1, done.stderr
    assert (
        f"cannot read redbeat's entries at {url} (--redbeat-url / redbeat_redis_url): "
        "connection refused"
    ) in done.stderr, done.stderr
    assert "Traceback" not in done.stderr
