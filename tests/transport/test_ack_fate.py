"""Where a message whose ack failed went, asked of a real broker (worker/transport/ack_fate.py).

kombu's own Redis transport moves the message (delivered, restored, acked); the
question is put to the broker the way the worker puts it."""

from __future__ import annotations

from collections.abc import Iterator

import kombu
import pytest

from celery_baton.worker.transport.ack_fate import Fate, where_is


@pytest.fixture(params=["", "app1:"], ids=["no-prefix", "keyprefix"])
def connection(broker_url: str, request: pytest.FixtureRequest) -> Iterator[kombu.Connection]:
    """A connection to the broker, with kombu's ``global_keyprefix`` (a broker shared by
    several apps: every key carries it, and the question must be asked of those keys)."""
    options = {"global_keyprefix": request.param} if request.param else {}
    with kombu.Connection(broker_url, transport_options=options) as conn:
        yield conn


def _deliver(connection: kombu.Connection, task_id: str) -> kombu.Message:
    queue = kombu.Queue("fates", kombu.Exchange("fates", type="direct"), routing_key="fates")
    with connection.Producer() as producer:
        producer.publish(
            {"x": 1},
            exchange=queue.exchange,
            routing_key="fates",
            declare=[queue],
            headers={"id": task_id},
        )
    message = queue(connection.default_channel).get(no_ack=False)
    assert message is not None
    return message


def test_an_unacked_message_comes_back(connection: kombu.Connection) -> None:
    message = _deliver(connection, "t-unacked")
    assert where_is(message, "t-unacked") is Fate.COMES_BACK


def test_a_restored_message_waiting_in_its_queue_comes_back(
    connection: kombu.Connection,
) -> None:
    """The consumer's channel gave it back (``restore_unacked``): no longer unacked, but
    back in the queue, so a copy runs."""
    message = _deliver(connection, "t-restored")
    channel = message.channel
    channel.qos.restore_unacked()
    assert channel.client.hlen(channel.unacked_key) == 0
    assert where_is(message, "t-restored") is Fate.COMES_BACK


def test_an_acked_message_is_gone(connection: kombu.Connection) -> None:
    message = _deliver(connection, "t-acked")
    other = _deliver(connection, "t-other")  # another message, still unacked
    message.ack()
    assert where_is(message, "t-acked") is Fate.ACKED
    assert where_is(other, "t-other") is Fate.COMES_BACK


def test_a_transport_without_an_unacked_hash_is_not_guessed() -> None:
    with kombu.Connection("memory://") as conn:
        queue = kombu.Queue("fates", kombu.Exchange("fates"), routing_key="fates")
        with conn.Producer() as producer:
            producer.publish(
                {"x": 1}, exchange=queue.exchange, routing_key="fates", declare=[queue]
            )
        message = queue(conn.default_channel).get(no_ack=False)
        assert message is not None
        assert where_is(message, "any") is Fate.UNKNOWN
