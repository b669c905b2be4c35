"""celery-baton over TLS (``rediss://``), as managed Redis services are reached: the
store's connections and the worker's own to the broker (kombu's writes) are
``SSLSocket``\\ s, whose records can sit read in the socket object while its file
descriptor says nothing is there to read. Judged from outside: each kind of guarded
call runs exactly once and returns, before and after the store is SIGKILLed and
restarted; a duplicate of a running exclusive key is skipped.

The servers are this test's own, each serving TLS beside its plain port (which the
harness uses); the certificate is made here with ``openssl``.
"""

from __future__ import annotations

import shutil
import subprocess
import time
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from celery_baton.errors import TaskSkipped
from tests.support.observer import Observer
from tests.support.servers import StoreServer, free_port
from tests.support.workers import Workers

CALLS = 40


@pytest.fixture(scope="module")
def certificate(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory with ``cert.pem`` and ``key.pem``: a self-signed certificate for
    127.0.0.1, which clients also trust as their CA."""
    openssl = shutil.which("openssl")
    if openssl is None:
        pytest.skip("openssl is not installed: no certificate for the TLS servers")
    where = tmp_path_factory.mktemp("tls")
    subprocess.run(
        [
            *(openssl, "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2"),
            *("-keyout", str(where / "key.pem"), "-out", str(where / "cert.pem")),
            *("-subj", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1"),
        ],
        check=True,
        capture_output=True,
    )
    return where


def _tls_server(name: str, certificate: Path) -> tuple[StoreServer, int]:
    port = free_port()
    cert, key = str(certificate / "cert.pem"), str(certificate / "key.pem")
    server = StoreServer(
        name=name,
        extra_args=[
            *("--tls-port", str(port), "--tls-cert-file", cert, "--tls-key-file", key),
            *("--tls-ca-cert-file", cert, "--tls-auth-clients", "no"),
        ],
    )
    try:
        server.start()
    except RuntimeError as exc:
        server.close()
        pytest.skip(f"{server.binary} does not serve TLS (built without it?): {exc}")
    return server, port


@pytest.fixture
def tls_env(
    certificate: Path, app_environ: None, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[dict[str, str], StoreServer]]:
    """The environment of the TLS app (set in this process too), and its store."""
    store, store_port = _tls_server("tls-store", certificate)
    broker, broker_port = _tls_server("tls-broker", certificate)
    env = {
        "TEST_TLS_BROKER_URL": f"rediss://127.0.0.1:{broker_port}/0",
        "TEST_TLS_STORE_URL": f"rediss://127.0.0.1:{store_port}/0",
        "TEST_TLS_CA": str(certificate / "cert.pem"),
    }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    try:
        yield env, store
    finally:
        store.close()
        broker.close()


def _drain(tls: Any, observer: Observer, round_: str) -> None:
    """CALLS calls of each guarded kind, each with a key of its own: every one returns,
    and runs exactly once."""
    results = {
        f"{kind}-{round_}-{n}": getattr(tls, kind).delay(f"{kind}-{round_}-{n}")
        for kind in ("ex_skip", "rated", "guarded")
        for n in range(CALLS)
    }
    for key, result in results.items():
        assert result.get(timeout=90) is not None, key
    runs = Counter(r.key for r in observer.runs() if f"-{round_}-" in r.key)
    assert set(runs) == set(results), f"keys that never ran: {set(results) - set(runs)}"
    twice = {key: n for key, n in runs.items() if n != 1}
    assert not twice, f"ran more than once: {twice}"


@pytest.mark.timeout(240)
def test_every_guarantee_holds_over_tls_and_across_a_store_restart(
    workers: Workers, observer: Observer, tls_env: tuple[dict[str, str], StoreServer]
) -> None:
    env, store = tls_env
    from tests.apps import tls

    workers.start("tests.apps.tls", concurrency=2, env=env)
    _drain(tls, observer, "first")

    first = tls.ex_skip.delay("dup", 2.0)
    deadline = time.monotonic() + 30
    while observer.running("dup") == 0:
        assert time.monotonic() < deadline, "the exclusive run did not start"
        time.sleep(0.05)
    with pytest.raises(TaskSkipped):  # its key is held
        tls.ex_skip.delay("dup", 0.0).get(timeout=30)
    first.get(timeout=30)
    assert [r.key for r in observer.runs()].count("dup") == 1, "a duplicate ran beside it"

    store.kill()  # a crash; its append-only file keeps what it acknowledged
    store.start()
    _drain(tls, observer, "after-restart")
