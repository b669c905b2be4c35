"""Fixtures every integration test uses: real servers, real workers, the observer.

Servers (session-wide, each on its own free port, never 6379):

* ``store_server`` -- the store under test (celery-baton's ``BATON_URL``).
* ``broker_server`` -- a separate server: Celery broker (db 0), result backend (db 1)
  and observer (db 2). Tests may kill or restart the store without touching it.

Per test: ``store_url`` / ``broker_url`` (flushed, server up), ``result_url``,
``observer`` (flushed), ``workers`` (starts and stops celery processes),
``rabbitmq_url`` (skips if RabbitMQ is not on 127.0.0.1:5672).
"""

from __future__ import annotations

import socket
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # so that `tests.support` and `tests.apps` import
    sys.path.insert(0, str(REPO_ROOT))

from tests.support.celery_processes import app_env  # noqa: E402
from tests.support.observer import Observer  # noqa: E402
from tests.support.servers import StoreServer  # noqa: E402
from tests.support.workers import Workers  # noqa: E402

RABBITMQ_URL = "amqp://guest:guest@127.0.0.1:5672//"

_reports = pytest.StashKey[dict[str, pytest.TestReport]]()


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: a long test (deselect with -m 'not slow')")
    _no_cyclic_gc_with_old_redis_py()
    _no_result_cleanup_in_del_before_celery_5_6()


def _no_result_cleanup_in_del_before_celery_5_6() -> None:
    """Before Celery 5.6, an ``AsyncResult`` dropped while the Redis result backend
    re-subscribes after a server restart unsubscribes from inside that subscribe
    (``AsyncResult.__del__`` -> ``remove_pending_result`` -> ``PubSub.unsubscribe``)
    and the test process hangs for ever (seen in the matrix cell celery5.4-py3.10, in
    tests/exclusive/test_faults.py after its broker restart). The tests' own client,
    not celery-baton: there, a result's pending subscription is left to ``.get()``
    (which removes it) and to the process's end."""
    import celery
    from celery.result import AsyncResult

    if tuple(celery.VERSION[:2]) < (5, 6):
        AsyncResult.__del__ = lambda self: None


def _no_cyclic_gc_with_old_redis_py() -> None:
    """redis-py before 5.3 can deadlock when the cyclic collector finalizes a dropped
    ``PubSub`` while its pool's lock is held (redis-py #3081, #2883): its ``__del__``
    takes the same lock. Celery's Redis result backend drops its ``PubSub`` when it
    reconnects after the tests restarted the server, and the collector may run inside
    the reconnect's ``get_connection``: the test process then hangs for ever (seen in the
    matrix cell celery5.5-py3.13, whose kombu pins redis-py 5.2.1; a timeout's exception
    raised in ``__del__`` is swallowed). This is Celery's client in this test process,
    not celery-baton (whose notice listener closes its PubSub itself): with such a
    redis-py, the test process collects no cycles."""
    import gc

    import redis

    major, minor = (int(part) for part in redis.__version__.split(".")[:2])
    if (major, minor) < (5, 3):
        gc.disable()


#: The files that take longest (seconds of one run each: issue 39's run in six processes
#: on 2 loaded cores), longest first. pytest-xdist hands files out in collection order
#: (``--no-loadscope-reorder`` in pyproject.toml), so these start first and the run does
#: not end on one of them while the other processes sit idle. A file renamed or added
#: and not listed here is only scheduled later, never skipped.
LONGEST_FILES = (
    "tests/beat/test_django.py",  # 271
    "tests/ops/test_commands.py",  # 203
    "tests/beat/test_schedule_cli.py",  # 151
    "tests/limits/test_at_start.py",  # 142
    "tests/failover/test_cluster.py",  # 137 (with the Cluster's start)
    "tests/beat/test_processes.py",  # 121
    "tests/exclusive/test_faults.py",  # 117
    "tests/flow/test_debounce.py",  # 105
    "tests/limits/test_fairness.py",  # 104
    "tests/pools/test_shutdown.py",  # 102
    "tests/batching/test_batching.py",  # 98
    "tests/failover/test_sentinel.py",  # 83 (with the Sentinel group's start)
    "tests/failover/test_both.py",  # 82
    "tests/transport/test_held_broker_kill.py",  # 67
    "tests/soak/test_nemesis.py",  # 53 (a 40 s fault phase)
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The longest files first, then the other files that start servers or processes,
    then the unit tests (quick: they fill the end), each group by its files' number of
    tests (xdist's default order), each file's tests in their own order."""

    def file_of(item: pytest.Item) -> str:
        return item.nodeid.split("::")[0]

    per_file = Counter(file_of(item) for item in items)

    def rank(item: pytest.Item) -> tuple[int, int]:
        path = file_of(item)
        if path in LONGEST_FILES:
            return (LONGEST_FILES.index(path), 0)
        group = len(LONGEST_FILES) + path.startswith("tests/unit/")
        return (group, -per_file[path])

    items.sort(key=rank)  # stable: a file's tests keep their order


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    # Keep each phase's report on the item, so fixtures can tell whether the test failed.
    report: pytest.TestReport = yield
    item.stash.setdefault(_reports, {})[report.when] = report
    return report


def _failed(request: pytest.FixtureRequest) -> bool:
    reports = request.node.stash.get(_reports, {})
    return any(report.failed for report in reports.values())


def _up(server: StoreServer) -> StoreServer:
    """The server running and answering, whatever the previous test left it as."""
    server.resume()
    server.start()
    return server


@pytest.fixture(scope="session")
def store_server() -> Iterator[StoreServer]:
    """The store under test: a StoreServer a test may stop, kill, pause or restart."""
    server = StoreServer(name="store")
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def broker_server() -> Iterator[StoreServer]:
    """Broker (db 0), result backend (db 1) and observer (db 2). Leave it running."""
    server = StoreServer(name="broker")
    server.start()
    yield server
    server.close()


@pytest.fixture(scope="session")
def app_environ(store_server: StoreServer, broker_server: StoreServer) -> Iterator[None]:
    """Sets ``BATON_URL``, ``TEST_BROKER_URL``, ``TEST_RESULT_URL`` and ``TEST_OBSERVER_URL``
    in this process's environment for the session, so app modules under ``tests.apps`` can
    be imported here too (import them inside the test, after the fixtures ran).
    """
    with pytest.MonkeyPatch.context() as mp:
        for name, value in _env_vars(store_server, broker_server).items():
            mp.setenv(name, value)
        yield


def _env_vars(store: StoreServer, broker: StoreServer) -> dict[str, str]:
    return {
        "BATON_URL": store.url(0),
        "TEST_BROKER_URL": broker.url(0),
        "TEST_RESULT_URL": broker.url(1),
        "TEST_OBSERVER_URL": broker.url(2),
    }


@pytest.fixture
def store_url(store_server: StoreServer, app_environ: None) -> str:
    """``redis://127.0.0.1:PORT/0`` of the store server: running, and emptied (all dbs).

    Never declared new, as a deployment's store is not: celery-baton finds it without
    its epoch and judges it by the server's uptime (a store started less than
    ``lease_ttl`` ago, by an earlier test's restart, gets the rest of that grace)."""
    _up(store_server).forget()
    return store_server.url(0)


@pytest.fixture
def broker_url(broker_server: StoreServer, app_environ: None) -> str:
    """The broker's URL (db 0). The broker server is flushed (all dbs: results too)."""
    _up(broker_server).flushall()
    return broker_server.url(0)


@pytest.fixture
def result_url(broker_server: StoreServer, broker_url: str) -> str:
    """The result backend's URL: the broker server's db 1 (flushed with the broker)."""
    return broker_server.url(1)


@pytest.fixture
def observer(broker_server: StoreServer, broker_url: str) -> Iterator[Observer]:
    """An Observer on the broker server's db 2, empty at the start of the test."""
    obs = Observer(broker_server.url(2))
    yield obs
    obs.close()


@pytest.fixture
def workers(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    store_server: StoreServer,
    broker_server: StoreServer,
    store_url: str,
    broker_url: str,
    result_url: str,
) -> Iterator[Workers]:
    """Start celery workers/beats with this test's URLs; all are stopped at teardown."""
    env = app_env(store_url, broker_url, result_url, broker_server.url(2))
    started = Workers(env, tmp_path_factory.mktemp("celery"))
    yield started
    if _failed(request):
        print(started.stacks())
    try:
        started.end_all(passed=not _failed(request))
    finally:
        if _failed(request):
            print(started.report())


@pytest.fixture
def rabbitmq_url() -> str:
    """RabbitMQ on 127.0.0.1:5672 (guest/guest), or skip the test if it is not there."""
    try:
        with socket.create_connection(("127.0.0.1", 5672), timeout=1):
            pass
    except OSError:
        pytest.skip("RabbitMQ not reachable on 127.0.0.1:5672")
    return RABBITMQ_URL
