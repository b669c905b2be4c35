"""Every private Celery, kombu and redis-py name celery-baton relies on, present and shaped
as it expects, on the versions installed (``celery_baton/internals.py`` reads them).

``tests/matrix/run.py`` runs this on every Celery minor the package declares: a release
that renames or reshapes one fails here, by name, rather than quietly in production
(where the worker falls back and logs once; the fallbacks are tested at the end).
The real-worker tests of the matrix's quick suite drive each of them.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import secrets
from collections.abc import Iterator, Set
from functools import cached_property
from types import SimpleNamespace

import pytest
from celery.schedules import crontab
from celery.worker import state as worker_state
from celery.worker.request import Request
from celery.worker.worker import WorkController
from kombu import Connection, Exchange, Queue
from kombu.asynchronous.semaphore import LaxBoundedSemaphore
from kombu.common import QoS
from kombu.transport import redis as kombu_redis

from celery_baton import internals


@pytest.fixture(autouse=True)
def _report_again() -> Iterator[None]:
    internals._reported.clear()
    yield
    internals._reported.clear()


def params(function: object) -> list[str]:
    return list(inspect.signature(function).parameters)  # type: ignore[arg-type]


# -- kombu's Redis transport ----------------------------------------------------------


def test_the_redis_channel_reads_a_pending_brpop_in_its_own_close() -> None:
    close = internals.redis_channel_close(kombu_redis.Channel)
    assert close is not None
    # broker_close calls it again when it failed before marking the channel closed.
    assert params(close) == ["self"]


def test_a_redis_channel_keeps_unacked_messages_by_tag_and_restores_one(broker_url: str) -> None:
    exchange = Exchange("baton-internals", type="direct")
    queue = Queue("baton-internals", exchange, routing_key="baton-internals")
    with Connection(broker_url) as conn:
        channel = conn.channel()
        queue(channel).declare()
        conn.Producer(channel).publish({"n": 1}, exchange=exchange, routing_key=queue.name)
        message = channel.basic_get(queue.name, no_ack=False)
        assert message is not None
        tag = message.delivery_tag
        unacked = internals.unrestored(channel)
        assert unacked is not None and tag in unacked
        assert isinstance(channel.qos.unacked_key, str)
        with channel.conn_or_acquire() as client:
            assert client.hexists(channel.qos.unacked_key, tag)
            assert client.llen(queue.name) == 0
            restore = internals.restore_by_tag(channel)
            assert restore is not None
            restore(tag)  # back in its queue, out of the unacked hash
            assert client.llen(queue.name) == 1
            assert not client.hexists(channel.qos.unacked_key, tag)
        unacked.pop(tag, None)  # as held_return does: never restored twice
        # A message whose record the broker never had: put back from the worker's copy.
        record = json.dumps([message._raw, exchange.name, queue.routing_key])
        restore_with = internals.restore_with_record(channel.qos)
        assert restore_with is not None
        with channel.conn_or_acquire() as client:
            assert not client.hexists(channel.qos.unacked_key, tag)
            restore_with(tag, record, True)
            assert client.llen(queue.name) == 2
        assert channel.closed is False  # broker_close reads it after a failed close
        # ack_fate: the lists a message of this exchange and routing key goes back to.
        lists = internals.queue_lists(channel, exchange.name, queue.routing_key)
        assert lists is not None and queue.name in lists
        channel.close()
        assert channel.closed is True


def test_a_redis_channel_scores_unacked_messages_by_delivery_time(broker_url: str) -> None:
    """The score kombu's visibility scan compares with the timeout, renewed for a held
    message still unacked and never added back for one that is gone (held_renewal)."""
    queue = Queue("baton-internals-restamp", Exchange("baton-restamp"), routing_key="r")
    with Connection(broker_url) as conn:
        channel = conn.channel()
        queue(channel).declare()
        conn.Producer(channel).publish({"n": 1}, exchange="baton-restamp", routing_key="r")
        message = channel.basic_get(queue.name, no_ack=False)
        assert message is not None
        restamp = internals.restamp_unacked(channel)
        assert restamp is not None
        with channel.conn_or_acquire() as client:
            index = channel.unacked_index_key
            delivered = client.zscore(index, message.delivery_tag)
            assert delivered is not None
            assert restamp([message.delivery_tag], delivered + 100.0) == [True]
            assert client.zscore(index, message.delivery_tag) == delivered + 100.0
            message.ack()
            assert restamp([message.delivery_tag], delivered + 200.0) == [False]
            assert client.zscore(index, message.delivery_tag) is None
        channel.close()


def test_an_unacked_message_is_taken_into_another_channel(broker_url: str) -> None:
    """held_return keeps a held message across a reconnect: the new channel takes it
    from the unacked index (delivery time renewed), acks it, and it is gone; one no
    longer unacked is not taken."""
    queue = Queue("baton-internals-adopt", Exchange("baton-adopt"), routing_key="a")
    with Connection(broker_url) as conn, Connection(broker_url) as again:
        old = conn.channel()
        queue(old).declare()
        conn.Producer(old).publish({"n": 7}, exchange="baton-adopt", routing_key="a")
        message = old.basic_get(queue.name, no_ack=False)
        assert message is not None
        tag = message.delivery_tag
        new = again.channel()
        adopt = internals.adopt_unacked(new)
        assert adopt is not None
        with new.conn_or_acquire() as client:
            delivered = client.zscore(new.unacked_index_key, tag)
            kept = adopt(tag, delivered + 50.0)
            assert kept is not None and kept.delivery_tag == tag and kept.payload == {"n": 7}
            assert client.zscore(new.unacked_index_key, tag) == delivered + 50.0
            kept.ack()  # through the new channel
            assert not client.hexists(new.unacked_key, tag)
            assert client.zscore(new.unacked_index_key, tag) is None
            assert adopt(tag, delivered + 60.0) is None  # gone: not taken
            assert client.zscore(new.unacked_index_key, tag) is None
        internals.unrestored(old).pop(tag, None)  # as held_return does
        old.close()
        new.close()


def test_the_consumer_counts_held_messages_in_its_prefetch() -> None:
    qos = QoS(lambda prefetch_count: None, 2)
    assert qos.increment_eventually() == 3
    assert qos.decrement_eventually() == 2


def test_a_kombu_consumer_keeps_its_consumer_tags_by_queue(rabbitmq_url: str) -> None:
    """The tags the broker names in each delivery (``Consumer._active_tags``), new ones
    after a cancel and a consume (worker/transport/consumer_window.py)."""
    queue = Queue(f"baton-internals-{secrets.token_hex(4)}")
    with Connection(rabbitmq_url) as conn:
        consumer = conn.Consumer([queue], callbacks=[lambda body, message: None])
        consumer.declare()
        assert internals.consumer_tags(consumer) == frozenset()
        consumer.consume()
        first = internals.consumer_tags(consumer)
        assert first is not None and len(first) == 1
        consumer.cancel()
        consumer.consume()
        again = internals.consumer_tags(consumer)
        assert again is not None and len(again) == 1 and again != first
        consumer.cancel()
        conn.default_channel.queue_delete(queue.name)


def test_celery_reads_the_task_channel_qos_as_global_or_per_consumer() -> None:
    """What ``Tasks.start`` chose for the prefetch it raises: per consumer on an AMQP
    broker that applies it so (RabbitMQ 4, quorum queues), not asked elsewhere."""
    from celery import Celery

    def with_queue(queue: Queue) -> Celery:
        app = Celery("internals", set_as_current=False)
        app.conf.task_queues = [queue]
        return app

    app = with_queue(Queue("q", queue_arguments={"x-queue-type": "quorum"}))

    def consumer(driver: str, matches_spec: bool, recorded: object = None) -> SimpleNamespace:
        transport = SimpleNamespace(driver_type=driver)
        connection = SimpleNamespace(transport=transport, qos_semantics_matches_spec=matches_spec)
        return SimpleNamespace(connection=connection, app=app, qos_global=recorded)

    assert internals.task_qos_global(consumer("redis", False)) is None
    assert internals.task_qos_global(consumer("amqp", False, recorded=True)) is True
    assert internals.task_qos_global(consumer("amqp", False, recorded=False)) is False
    assert internals.task_qos_global(consumer("amqp", True)) is False  # RabbitMQ 4
    # A quorum queue: Celery 5.5 and later detect it and count per consumer; before,
    # Celery keeps the global count there too (what the worker must then assume).
    quorum_detected = importlib.util.find_spec("celery.utils.quorum_queues") is not None
    assert internals.task_qos_global(consumer("amqp", False)) is not quorum_detected
    app = with_queue(Queue("q"))
    assert internals.task_qos_global(consumer("amqp", False)) is True  # RabbitMQ 3, classic


# -- Celery's worker ------------------------------------------------------------------


def test_the_prefork_worker_hands_requests_to_the_pool_through_a_lax_semaphore() -> None:
    assert params(WorkController._process_task_sem) == ["self", "req"]
    assert params(WorkController._process_task) == ["self", "req"]
    controller = object.__new__(WorkController)
    controller.semaphore = LaxBoundedSemaphore(1)
    found = internals.semaphore_process_task(controller, controller._process_task_sem)
    assert found == controller._process_task
    assert internals.semaphore_process_task(controller, controller._process_task) is None
    # SemaphoreSlots: acquire(callback) now or when released; a release past the bound is
    # lax.
    semaphore, ran = LaxBoundedSemaphore(1), []
    semaphore.acquire(ran.append, 1)
    semaphore.acquire(ran.append, 2)
    assert ran == [1]
    semaphore.release()
    assert ran == [1, 2]
    semaphore.release()
    semaphore.release()
    assert semaphore.value <= 1


def test_the_prefork_pool_reports_its_processes_and_reads_jobs_where_we_extend_it() -> None:
    from billiard import pool as billiard_pool
    from celery.concurrency import asynpool
    from celery.concurrency.prefork import TaskPool

    assert TaskPool.Pool is asynpool.AsynPool and TaskPool.BlockingPool is billiard_pool.Pool
    assert internals.prefork_pool_classes(TaskPool) == (TaskPool.Pool, TaskPool.BlockingPool)
    # The hooks worker/pool/prefork.py overrides, called as it calls them.
    assert params(asynpool.AsynPool.on_job_ready) == ["self", "job", "i", "obj", "inqW_fd"]
    assert params(asynpool.AsynPool.on_process_alive) == ["self", "pid"]
    assert params(asynpool.AsynPool._event_process_exit) == ["self", "hub", "proc"]
    assert params(asynpool.AsynPool.register_with_event_loop) == ["self", "hub"]
    assert params(billiard_pool.Worker._make_child_methods)[0] == "self"
    # The job a pool process reads: (TASK, (job, i, fun, args, kwargs)).
    assert billiard_pool.TASK == 2
    # A pool class of its own is not one celery-baton knows.
    custom = SimpleNamespace(Pool=type("Mine", (asynpool.AsynPool,), {}), BlockingPool=None)
    assert internals.prefork_pool_classes(custom) is None


def test_the_gevent_pool_spawns_each_job_through_the_name_we_extend() -> None:
    import inspect

    from celery.concurrency import gevent as green
    from celery.concurrency.solo import TaskPool as Solo

    pool = object.__new__(green.TaskPool)  # its type is what is judged: gevent not loaded
    assert internals.gevent_pool(pool) is True
    assert internals.gevent_pool(object.__new__(Solo)) is None
    # on_apply spawns (run, target, args, kwargs, callback, accept_callback, getpid, ...)
    # through _quick_put, which on_start sets (worker/pool/in_process.py wraps it).
    assert "self._quick_put = " in inspect.getsource(green.TaskPool.on_start)
    source = inspect.getsource(green.TaskPool.on_apply)
    assert "self._quick_put(apply_timeout if timeout else apply_target," in source
    assert "target, args, kwargs, callback, accept_callback,\n" in source
    assert params(green.apply_timeout)[:5] == [
        "target",
        "args",
        "kwargs",
        "callback",
        "accept_callback",
    ]
    # Celery 5.5 and later pass ``getpid`` next; before, a ``pid`` nobody passes.
    assert params(green.apply_timeout)[5] in ("getpid", "pid")
    from celery.concurrency import base

    # (Before Celery 5.5 the gevent pool runs base.apply_target, not one of its own.)
    apply_target = getattr(green, "apply_target", base.apply_target)
    assert params(apply_target)[:6] == params(green.apply_timeout)[:6]


def test_the_threads_pool_calls_the_accept_callback_on_its_thread_before_the_body() -> None:
    import inspect

    from celery.concurrency import base
    from celery.concurrency.thread import TaskPool

    assert internals.threads_pool(object.__new__(TaskPool)) is True
    assert "accept_callback" in inspect.signature(TaskPool.on_apply).parameters
    # apply_target (run on the executor thread) accepts, then runs the body.
    source = inspect.getsource(base.apply_target)
    assert source.index("accept_callback(") < source.index("target(*args, **kwargs)")


def test_celery_ends_revoked_and_cancelled_requests_through_the_hooks_we_extend() -> None:
    assert internals.missing_request_hooks(Request) == []
    # request.py reads `terminated` as the second argument.
    assert params(Request._announce_revoked)[:3] == ["self", "reason", "terminated"]
    assert isinstance(inspect.getattr_static(Request, "_context"), cached_property | property)
    if hasattr(Request, "_retry_worker_lost"):  # Celery >= 5.7 (retry_on_worker_lost)
        assert params(Request._retry_worker_lost) == ["self", "exc", "exc_info"]
    for name in ("on_success", "on_failure", "on_timeout", "on_retry", "reject"):
        assert callable(getattr(Request, name)), name
    assert isinstance(inspect.getattr_static(Request, "store_errors"), property)


def test_the_worker_dispatches_revoke_from_the_panel_and_takes_unknown_arguments() -> None:
    from celery.worker import control, pidbox

    panel = internals.control_panel()
    assert panel is control.Panel.data
    revoke = inspect.signature(panel["revoke"])
    assert list(revoke.parameters)[:2] == ["state", "task_id"]
    assert any(p.kind is inspect.Parameter.VAR_KEYWORD for p in revoke.parameters.values())
    # The worker's mailbox dispatches from that very dict (not a copy made at import).
    assert "handlers=control.Panel.data" in inspect.getsource(pidbox.Pidbox.__init__)


def test_the_worker_state_tracks_reserved_and_active_requests() -> None:
    assert isinstance(worker_state.reserved_requests, Set)
    assert isinstance(worker_state.active_requests, Set)
    assert params(worker_state.task_ready)[0] == "request"
    found = internals.worker_requests()
    assert found is not None
    assert found[0] is worker_state.requests and found[1] is worker_state.active_requests


def test_the_prefork_pool_keeps_its_jobs_by_id_and_is_flushed_by_the_consumer() -> None:
    from billiard.pool import ApplyResult
    from celery import Celery
    from celery.concurrency.prefork import TaskPool
    from celery.worker.consumer.consumer import Consumer

    app = Celery("internals", set_as_current=False)
    # As the worker starts it on its event loop: AsynPool.
    pool = TaskPool(1, threads=False, initargs=(app, "internals@test"), app=app)
    pool.start()
    try:
        cache = internals.pool_job_cache(pool)
        assert isinstance(cache, dict)
        job = ApplyResult(cache, callback=None)  # enters the cache under its id
        assert cache[job._job] is job and job._accepted is False
    finally:
        pool.stop()
    assert "self.pool.flush()" in inspect.getsource(Consumer.on_close)


# -- Celery's schedules, redis-py -------------------------------------------------------


def test_the_redis_result_backend_writes_the_record_its_meta_function_makes() -> None:
    from celery import Celery, states

    app = Celery("records", backend="redis://127.0.0.1:1/1", set_as_current=False)
    writer = internals.redis_record_writer(app.backend)
    assert writer is not None
    make, longest = writer
    assert longest >= 1 << 20
    meta = make(result=3, state=states.SUCCESS, traceback=None, request=None)
    assert meta["status"] == states.SUCCESS and meta["result"] == 3
    assert {"traceback", "children", "date_done"} <= set(meta)
    # What _store_result writes is that record (with its task id).
    assert "_get_result_meta" in inspect.getsource(type(app.backend)._store_result)


def test_a_backend_that_is_not_celerys_redis_backend_has_no_bulk_writer() -> None:
    from celery import Celery
    from celery.backends.redis import RedisBackend

    class Writing(RedisBackend):
        def _set(self, key: str, value: object, expires: object = None) -> None: ...

    app = Celery("records", backend="cache+memory://", set_as_current=False)
    assert internals.redis_record_writer(app.backend) is None
    assert internals.redis_record_writer(Writing(app=app, url="redis://127.0.0.1:1/1")) is None


def test_a_crontab_keeps_its_fields_as_given() -> None:
    fields = internals.crontab_fields(crontab(minute="*/15", hour="1-3", day_of_week="mon"))
    assert fields == {
        "minute": "*/15",
        "hour": "1-3",
        "day_of_week": "mon",
        "day_of_month": "*",
        "month_of_year": "*",
    }


def test_the_broker_reconnect_waits_with_a_sleep_each_module_bound_at_its_import() -> None:
    """kombu's retry_over_time and Celery's consumer wait with a ``sleep`` of their own,
    which a green pool's monkey-patching (after kombu's import) does not reach."""
    import kombu.utils.functional
    from celery.worker.consumer import consumer

    assert internals.reconnect_sleepers() == [kombu.utils.functional, consumer]
    assert "sleep(" in inspect.getsource(kombu.utils.functional.retry_over_time)


def test_redis_py_parses_error_replies_and_connects_as_the_store_expects() -> None:
    import redis
    from redis._parsers.base import BaseParser

    assert callable(BaseParser.parse_error)
    assert callable(redis.UnixDomainSocketConnection._connect)
    assert "_sock" in vars(redis.Connection(host="127.0.0.1"))


# -- without them: the fallbacks, each logged once ------------------------------------


def test_without_them_each_fallback_is_taken_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_baton")
    bare = SimpleNamespace(qos=SimpleNamespace())
    for _ in range(2):
        assert internals.unrestored(bare) is None
        assert internals.restore_by_tag(bare) is None
        assert internals.queue_lists(bare, "e", "k") is None
        assert internals.redis_channel_close(type("Channel", (), {"close": print})) is None
        assert internals.missing_request_hooks(object) == list(internals.REQUEST_HOOKS)
        assert internals.pool_job_cache(SimpleNamespace(flush=print)) is None
        assert internals.consumer_tags(SimpleNamespace()) is None
        assert internals.restamp_unacked(SimpleNamespace()) is None
        assert internals.adopt_unacked(SimpleNamespace()) is None
        assert internals.restore_with_record(SimpleNamespace()) is None
        assert internals._names_of(object, internals.ASYNPOOL_NAMES) == list(
            internals.ASYNPOOL_NAMES
        )
    warned = [r.getMessage() for r in caplog.records]
    assert len(warned) == 11, warned
    assert all("docs/compatibility.md" in line for line in warned)


def test_a_crontab_without_its_given_fields_keeps_the_same_times() -> None:
    given = crontab(minute="*/20", hour="9-11", day_of_week="mon-fri", month_of_year="1,7")
    expanded = SimpleNamespace(**{n: getattr(given, n) for n in internals.CRONTAB_FIELDS})
    fields = internals.crontab_fields(expanded)
    assert fields["minute"] == "0,20,40"
    assert crontab(**fields) == given


def test_a_request_without_its_context_stores_its_headers() -> None:
    request = SimpleNamespace(request_dict={"id": "t1", "task": "x"})
    context = internals.request_context(request)
    assert context.id == "t1" and context.task == "x"


# -- Celery's app and command -----------------------------------------------------------


def test_an_app_keeps_its_declared_tasks_unevaluated_until_it_is_finalized() -> None:
    from celery import Celery

    app = Celery("declared", set_as_current=False)

    @app.task(shared=False, queue="q")
    def pending(x: int) -> None: ...

    declared = internals.declared_tasks(app)
    assert declared is not None
    registered, waiting = declared
    assert not app.finalized
    assert [(fun.__name__, options) for fun, options in waiting] == [("pending", {"queue": "q"})]
    app.finalize()
    registered, waiting = internals.declared_tasks(app) or ([], [])
    assert not waiting and pending.name in {task.name for task in registered}


def test_the_celery_command_loads_the_app_through_its_global_find_app() -> None:
    from celery.bin import celery as command

    assert internals.cli_app_loader() is command
    # The command calls its module's global find_app (5.5+: in the group's callback;
    # before: in the -A option's type) inside an `except Exception` that prints the
    # traceback: the name the wrapper replaces.
    source = inspect.getsource(command)
    assert "find_app(" in source and "except Exception" in source


def test_without_celerys_app_internals_the_checks_wait_for_the_worker(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING, logger="celery_baton")
    assert internals.declared_tasks(SimpleNamespace()) is None
    assert "Celery._tasks/_pending" in caplog.text


def test_what_pool_work_reads_of_celery_and_kombu_is_there() -> None:
    """worker/pool_work.py: the autoscaler's ``qty`` is a property (subclassed to leave
    held requests out); kombu's prefetch ``QoS`` has the ``max_prefetch`` cap Celery's
    ``worker_eta_task_limit`` sets, and raises and lowers as read there; Celery's
    ``worker_disable_prefetch`` narrows the channel's ``can_consume`` by the reserved
    requests against the pool's size (the check made again without held ones)."""
    from celery.worker.autoscale import Autoscaler
    from celery.worker.consumer import tasks
    from kombu.common import QoS

    from celery_baton.worker import pool_work

    assert isinstance(inspect.getattr_static(Autoscaler, "qty"), property)
    if "max_prefetch" in inspect.signature(QoS.__init__).parameters:  # kombu >= 5.6
        qos = QoS(lambda prefetch_count: None, 8, max_prefetch=10)
        for _ in range(4):
            pool_work.raise_window(qos)
        assert (qos.value, qos.max_prefetch) == (12, 14)  # past Celery's cap, by holds
        for _ in range(4):
            pool_work.lower_window(qos)
        assert (qos.value, qos.max_prefetch) == (8, 10)  # Celery's window and cap again
    else:  # no cap: the count alone, raised and lowered back
        qos = QoS(lambda prefetch_count: None, 8)
        pool_work.raise_window(qos)
        pool_work.lower_window(qos)
        assert qos.value == 8
    source = inspect.getsource(tasks.Tasks.start)
    if "disable_prefetch" in source:  # Celery >= 5.6
        assert "len(state.reserved_requests) >= limit" in source
        assert 'getattr(c.controller, "max_concurrency", None) or c.pool.num_processes' in source
