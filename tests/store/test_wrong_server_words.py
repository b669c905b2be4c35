"""A ``baton_url`` that reaches the wrong server, or none: a store that does not answer,
said in one sentence an operator acts on (a user audit). Real publishes, a real worker,
real sockets: a server that is not Redis, a Sentinel port where nothing listens."""

from __future__ import annotations

import socketserver
import threading
import time
from collections.abc import Iterator

import pytest
from celery import Celery

from celery_baton import Baton, StoreUnavailable
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.workers import Workers

#: What the first bytes of a reply look like from a RabbitMQ port (the AMQP protocol
#: header it sends to a client that does not speak AMQP) and from an HTTP server.
AMQP_REPLY = b"AMQP\x00\x00\x09\x01"
HTTP_REPLY = b"HTTP/1.0 400 Bad Request\r\nContent-Length: 0\r\n\r\n"


class _NotRedis(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    reply = b""


class _Answer(socketserver.BaseRequestHandler):
    def handle(self) -> None:
        try:  # answers whatever it is sent with its own protocol's bytes, as such servers do
            while self.request.recv(4096):
                self.request.sendall(self.server.reply)  # type: ignore[attr-defined]
        except OSError:
            pass


def _serve(reply: bytes) -> Iterator[int]:
    server = _NotRedis(("127.0.0.1", 0), _Answer)
    server.reply = reply
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def amqp_port() -> Iterator[int]:
    """A port of this process that answers like RabbitMQ's 5672."""
    yield from _serve(AMQP_REPLY)


@pytest.fixture
def http_port() -> Iterator[int]:
    yield from _serve(HTTP_REPLY)


def _unique_task(url: str) -> object:
    app = Celery("wrong_server", broker="memory://", set_as_current=False)
    Baton(app, url=url)

    @app.task(unique="report_id", name=f"wrong_server.build_report[{url}]")  # one per URL
    def build_report(report_id: int) -> None: ...

    return build_report


@pytest.mark.parametrize("server", ["amqp_port", "http_port"])
def test_a_server_that_is_not_redis_is_a_store_that_does_not_answer(
    server: str, request: pytest.FixtureRequest
) -> None:
    """Before: ``redis.exceptions.InvalidResponse: Protocol error, got "A" as reply type
    byte`` escaped the publish, naming neither the setting nor the address."""
    port = request.getfixturevalue(server)
    task = _unique_task(f"redis://127.0.0.1:{port}/0")
    with pytest.raises(StoreUnavailable) as error:
        task.delay(1)  # type: ignore[attr-defined]
    message = str(error.value)
    assert f"127.0.0.1:{port} does not speak the Redis protocol" in message, message
    assert "check baton_url" in message, message
    assert "Protocol error" not in message, message


@pytest.mark.timeout(60)
def test_a_sentinel_that_does_not_answer_is_said_in_one_short_sentence() -> None:
    """Before: ``store call failed: MasterNotFoundError: No master found for 'mymaster' :
    <redis.client.Redis(<redis.connection.ConnectionPool(...``, 1,108 characters of
    the client's repr. redis-py retries the sentinels first: a few seconds."""
    port = free_port()
    task = _unique_task(f"sentinel://127.0.0.1:{port}/mymaster")
    with pytest.raises(StoreUnavailable) as error:
        task.delay(1)  # type: ignore[attr-defined]
    message = str(error.value)
    assert f"no sentinel answered at 127.0.0.1:{port}" in message, message
    assert "'mymaster'" in message and "check baton_url" in message, message
    assert "<redis" not in message and len(message) < 300, message


@pytest.mark.timeout(120)
def test_a_worker_on_a_server_that_is_not_redis_holds_and_says_why(
    workers: Workers, amqp_port: int
) -> None:
    """Before: the worker logged ~1,300 lines (among them "cannot check the store's
    maxmemory-policy (CONFIG refused)") and died: ``Unrecoverable error:
    server:InvalidResponse``. Now the store is down to it: it stays up, holds what it
    is sent for the store, and says why."""
    from tests.apps.exclusive import ex_skip

    worker = workers.start(
        "tests.apps.exclusive",
        env={"BATON_URL": f"redis://127.0.0.1:{amqp_port}/0"},
        concurrency=1,
    )
    ex_skip.delay("held")  # the publish needs no store; the worker asks it
    sentence = f"127.0.0.1:{amqp_port} does not speak the Redis protocol"
    wait_until(lambda: "store unavailable, holding" in worker.log_text(), 30, "a held request")
    time.sleep(3)  # a few back-offs and probes: still up
    log = worker.log_text()
    assert worker.returncode is None, worker.log_tail()
    assert sentence in log, log[-5000:]
    assert "Unrecoverable error" not in log and "CONFIG refused" not in log, log[-5000:]
    assert "InvalidResponse" not in log, log[-5000:]
    assert len(log.splitlines()) < 200, f"{len(log.splitlines())} lines"
