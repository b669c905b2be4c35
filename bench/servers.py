"""The processes a benchmark starts: its store and its Celery workers.

* ``RedisServer``: a private ``redis-server`` on a free loopback port (never 6379).
* ``Worker``: a real ``celery worker`` subprocess on one of the apps in ``bench/apps``.

The scripts import these from ``common`` (which imports them from here).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import redis

BENCH_DIR = Path(__file__).resolve().parent


# -- the store / broker ----------------------------------------------------------------------


def redis_server_binary() -> str:
    binary = shutil.which("redis-server") or shutil.which("valkey-server")
    if binary is None:
        sys.exit("benchmarks need redis-server (or valkey-server) on PATH")
    return binary


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class RedisServer:
    """A private ``redis-server`` on a free port, without persistence.

    >>> with RedisServer() as server:  # doctest: +SKIP
    ...     server.url  # 'redis://127.0.0.1:PORT/0'
    """

    def __init__(self, *, cpu: int | None = None) -> None:
        self.port = 0
        self.cpu = cpu  # pin the server to this CPU (see pin_client)
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self, **kwargs: Any) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, decode_responses=True, **kwargs)

    def start(self) -> RedisServer:
        for _ in range(5):
            self.port = free_port()
            self.proc = subprocess.Popen(
                [
                    redis_server_binary(),
                    "--port",
                    str(self.port),
                    "--bind",
                    "127.0.0.1",
                    "--save",
                    "",
                    "--appendonly",
                    "no",
                    "--daemonize",
                    "no",
                ],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
            if self.cpu is not None:
                os.sched_setaffinity(self.proc.pid, {self.cpu})
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline and self.proc.poll() is None:
                try:
                    self.client(socket_timeout=0.5).ping()
                    return self
                except redis.ConnectionError:
                    time.sleep(0.05)
            self.stop()
        raise RuntimeError("could not start redis-server")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


# -- celery workers --------------------------------------------------------------------------


class Worker:
    """A real ``celery worker`` process on ``bench/apps/<app>.py``.

    The apps read their URLs from the environment (``BENCH_BROKER_URL``,
    ``BENCH_STORE_URL``) and mark ``bench:ready:<hostname>`` in the broker's
    server when the worker is ready.
    """

    def __init__(
        self,
        app: str,
        name: str,
        *,
        env: dict[str, str],
        concurrency: int = 2,
        queues: str = "celery",
        pool: str = "prefork",
        extra: Sequence[str] = (),
    ) -> None:
        self.hostname = f"{name}@bench"
        self.cmd = [
            sys.executable,
            "-m",
            "celery",
            "-A",
            f"apps.{app}",
            "worker",
            "-P",
            pool,
            "-c",
            str(concurrency),
            "-n",
            self.hostname,
            "-Q",
            queues,
            "--without-gossip",
            "--without-mingle",
            "--without-heartbeat",
            "--loglevel",
            "WARNING",
            *extra,
        ]
        # The caller's PYTHONPATH after bench/: a worker runs the celery-baton the
        # benchmark runs (PYTHONPATH=<checkout>/src compares another revision's).
        path = [str(BENCH_DIR), *filter(None, [os.environ.get("PYTHONPATH")])]
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(path), **env}
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(f"/tmp/bench-worker-{os.getpid()}-{name}.log")

    def start(self) -> Worker:
        log = self.log_path.open("wb")
        self.proc = subprocess.Popen(
            self.cmd, env=self.env, cwd=BENCH_DIR, stdout=log, stderr=subprocess.STDOUT
        )
        log.close()
        return self

    def wait_ready(self, client: redis.Redis, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if client.exists(f"bench:ready:{self.hostname}"):
                return
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.05)
        raise RuntimeError(f"worker {self.hostname} did not start; see {self.log_path}")

    def stop(self, *, cold: bool = False) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.send_signal(signal.SIGQUIT if cold else signal.SIGTERM)
        try:
            self.proc.wait(15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def check_log(self) -> str:
        """ERROR lines of the worker's log (a benchmark that hides errors lies)."""
        try:
            text = self.log_path.read_text(errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(line for line in text.splitlines() if "ERROR" in line or "Trace" in line)


def start_workers(workers: Sequence[Worker], client: redis.Redis) -> None:
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.wait_ready(client)


def stop_workers(workers: Sequence[Worker], *, cold: bool = False) -> None:
    for worker in workers:
        if worker.proc is not None and worker.proc.poll() is None:
            worker.proc.send_signal(signal.SIGQUIT if cold else signal.SIGTERM)
    for worker in workers:
        worker.stop(cold=cold)
        errors = worker.check_log()
        if errors:
            print(f"<!-- {worker.hostname} logged errors:\n{errors[:2000]}\n-->", file=sys.stderr)
