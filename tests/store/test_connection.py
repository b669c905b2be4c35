"""Store URLs against real servers: TCP, unix socket, Sentinel, the embedded default."""

from __future__ import annotations

import os
import signal
import subprocess
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest

from celery_baton.core.gate import Gate
from celery_baton.core.leases import Lease
from celery_baton.errors import ConfigError, StoreUnavailable
from celery_baton.store import connect, redact_url
from celery_baton.store.connection import ensure_embedded_server, stop_embedded_server
from tests.support.servers import StoreServer, find_binary, free_port


def lease_works(url: str) -> None:
    store = connect(url)
    lease = Lease(Gate(store), "baton:{conn}:ex:k", ttl=5)
    assert lease.acquire() and lease.fence > 0
    assert lease.release()


def test_redact_url_hides_the_password() -> None:
    assert redact_url("redis://:s3cret@host:6379/0") == "redis://:***@host:6379/0"
    assert redact_url("redis://user:s3cret@host/0") == "redis://user:***@host/0"
    assert redact_url("redis://host:6379/0") == "redis://host:6379/0"


def test_an_unknown_scheme_is_a_clear_error() -> None:
    with pytest.raises(ConfigError, match="unsupported store URL scheme"):
        connect("http://127.0.0.1:1/")


def test_a_store_that_is_down_is_store_unavailable() -> None:
    store = connect(f"redis://127.0.0.1:{free_port()}/0", socket_timeout=0.5)
    with pytest.raises(StoreUnavailable):
        store.ping()


def test_tcp_url(store_url: str) -> None:
    lease_works(store_url)


@pytest.fixture
def sentinel(store_server: StoreServer, tmp_path: Path) -> Iterator[int]:
    """A Sentinel process that monitors the store server as ``mymaster``."""
    port = free_port()
    conf = tmp_path / "sentinel.conf"
    conf.write_text(
        f"port {port}\nbind 127.0.0.1\ndir {tmp_path}\n"
        f"sentinel monitor mymaster 127.0.0.1 {store_server.port} 1\n"
    )
    proc = subprocess.Popen(
        [find_binary(), str(conf), "--sentinel"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 10
        while True:
            try:
                import redis

                client = redis.Redis(port=port, socket_timeout=0.5)
                if client.execute_command("SENTINEL", "get-master-addr-by-name", "mymaster"):
                    break
            except redis.RedisError:
                pass
            if time.monotonic() > deadline:
                raise AssertionError("sentinel did not start")
            time.sleep(0.1)
        yield port
    finally:
        proc.kill()
        proc.wait()


def test_sentinel_url(sentinel: int, store_url: str) -> None:
    lease_works(f"sentinel://127.0.0.1:{sentinel}/mymaster")
    with pytest.raises(ConfigError, match="names the service"):
        connect(f"sentinel://127.0.0.1:{sentinel}")


def test_embedded_default_starts_once_and_is_shared(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Several processes' first calls race: one starts the server under the file lock,
    the others find it answering; a unix:// URL reaches it."""
    monkeypatch.setenv("BATON_RUNTIME_DIR", str(tmp_path))
    monkeypatch.delenv("BATON_URL", raising=False)
    sockets: list[Path] = []
    try:
        threads = [
            threading.Thread(target=lambda: sockets.append(ensure_embedded_server()))
            for _ in range(4)
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(set(sockets)) == 1
        pid = (tmp_path / "valkey.pid").read_text().strip()
        store = connect(None)
        assert store.embedded and store.url == f"unix://{sockets[0]}"
        lease_works(f"unix://{sockets[0]}?db=0")
        assert connect("embedded://").url == store.url
        assert (tmp_path / "valkey.pid").read_text().strip() == pid  # still the one server
    finally:
        assert stop_embedded_server()
    assert not (tmp_path / "valkey.sock").exists()
    assert stop_embedded_server() is False  # nothing left to stop


def test_a_server_that_runs_but_does_not_answer_is_never_doubled(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Paused (or loading its data): a second server on the same files would corrupt
    them. The caller waits for it, and says so if it does not answer in time."""
    monkeypatch.setenv("BATON_RUNTIME_DIR", str(tmp_path))
    ensure_embedded_server()
    pid = int((tmp_path / "valkey.pid").read_text().strip())
    os.kill(pid, signal.SIGSTOP)
    try:
        with pytest.raises(StoreUnavailable, match=f"pid {pid}.* does not answer"):
            ensure_embedded_server(timeout=1)
        servers = [p.pid for p in psutil.process_iter() if _cwd(p) == str(tmp_path)]
    finally:
        os.kill(pid, signal.SIGCONT)
        assert stop_embedded_server()
    assert servers == [pid], "a second server was started on the same files"


def _cwd(proc: psutil.Process) -> str | None:
    try:
        return proc.cwd()
    except psutil.Error:
        return None
