"""What runs in the pool for a batched task: the body with every call of its batch, each
call's result written under its own task id, and the calls marked done.

A batch is carried into the pool by one of its calls' own request (the carrier, chosen by
``worker/batching.py``), which brings the batch in its request (``BATCH_FIELD``: the run's
id, its store keys and every call's id and encoded arguments). Celery stores the
carrier's own result as it stores any task's; the other calls' results are written here,
from the same pool process, before the store hears that the batch ran: a caller never
sees its call done without its result. On a Redis result backend they are written
together (``batch_results.py``), elsewhere one by one.

A run of the task without that field (called directly, ``.apply()``, eager mode) is a
batch of one: the body gets a list of one call and the call its own result.
"""

from __future__ import annotations

import json as _json
import logging
import time
import traceback
from collections.abc import Callable
from json.encoder import encode_basestring_ascii as _quote
from typing import Any

from celery.exceptions import Retry
from kombu.utils import json as kombu_json

from celery_baton import internals
from celery_baton.core.batch import Call, outcomes, task_id_of
from celery_baton.errors import BatonError
from celery_baton.parts import installed_parts
from celery_baton.worker.pool.batch_results import Written, bulk_eligible, store

logger = logging.getLogger("celery_baton.worker")

#: The carrier request's field naming its batch (a key of its request dict, which Celery
#: hands to the pool process and makes an attribute of ``task.request``).
BATCH_FIELD = "baton_batch"


#: What a call's request says about the canvas it is part of, kept with the call so that
#: the pool process that runs its batch writes its result as Celery would: a chord's
#: counter, the next task of a chain, its link and link_error callbacks.
CANVAS_FIELDS = (
    "retries",  # a retry of the batch counts each call's own
    "expires",
    "callbacks",
    "errbacks",
    "chain",
    "chord",
    "group",
    "group_index",
    "root_id",
    "parent_id",
    "reply_to",
    "correlation_id",
    "delivery_info",  # its queue, in its record with result_extended
)


def _canvas(context: Any) -> dict[str, Any]:
    return {name: value for name in CANVAS_FIELDS if (value := getattr(context, name, None))}


def encode_call(args: Any, kwargs: Any, context: Any = None) -> str:
    """A call's arguments (and its canvas, from its request's ``context``) as the store
    keeps them: kombu's JSON, as Celery's json serializer writes them (dates, UUIDs and
    decimals come back as they went)."""
    canvas = _canvas(context)
    return str(kombu_json.dumps([list(args or ()), dict(kwargs or {}), canvas]))  # type: ignore[no-untyped-call]


#: The canvas fields a protocol 2 message carries in its body's ``embed`` (the others
#: are its headers and properties: the request's dict).
EMBED_FIELDS = ("callbacks", "errbacks", "chain", "chord")


def encode_request_call(request: Any) -> str:
    """``encode_call`` of a received request, taken as its message holds it: a JSON
    message's body is Celery's ``[args, kwargs, embed]`` in the same JSON, kept as it
    came rather than encoded again, and the rest of its canvas read from its headers
    (its request dict) rather than from a task context built for it (the two were a
    fifth of a batching worker's intake: docs/benchmarks.md#batching)."""
    body = getattr(request, "body", None)
    headers = getattr(request, "request_dict", None)
    if (
        isinstance(body, bytes)
        and isinstance(headers, dict)
        and getattr(request, "content_type", None) == "application/json"
    ):
        try:
            text = body.decode(getattr(request, "content_encoding", None) or "utf-8")
        except (UnicodeDecodeError, LookupError):
            text = None
        if text is not None and text.lstrip().startswith("["):
            return f'{{"body":{text},"canvas":{_encoded_canvas(headers)}}}'
    return encode_call(request.args, request.kwargs, internals.request_context(request))


#: The canvas fields a message's headers carry (the others are in its body's embed).
HEADER_CANVAS_FIELDS = tuple(name for name in CANVAS_FIELDS if name not in EMBED_FIELDS)

#: JSON of the header values seen whole before (a queue's ``delivery_info``: the same in
#: every message of a queue), by their items; emptied past its size.
_ENCODED_VALUES: dict[Any, str] = {}
_ENCODED_VALUES_MAX = 256
#: Values JSON writes the same whatever the encoder (no date, UUID or decimal).
_PLAIN = frozenset({str, int, float, bool, type(None)})


def _encoded_canvas(headers: dict[str, Any]) -> str:
    """The JSON of a message's canvas headers, as ``kombu_json.dumps`` of their dict
    writes it: strings and numbers written here (kombu's encoder took a tenth of a
    batching worker's intake), a flat dict of plain values encoded once per content, and
    anything else by kombu (dates, UUIDs)."""
    parts = []
    for name in HEADER_CANVAS_FIELDS:
        value = headers.get(name)
        if not value:
            continue
        kind = type(value)
        if kind is str:
            encoded = _quote(value)
        elif kind is int:
            encoded = str(value)
        elif kind is dict and all(type(v) in _PLAIN for v in value.values()):
            items = tuple(value.items())
            encoded = _ENCODED_VALUES.get(items) or ""
            if not encoded:
                if len(_ENCODED_VALUES) >= _ENCODED_VALUES_MAX:
                    _ENCODED_VALUES.clear()
                encoded = _ENCODED_VALUES[items] = _json.dumps(value)
        else:
            encoded = kombu_json.dumps(value)  # type: ignore[no-untyped-call]
        parts.append(f'"{name}":{encoded}')
    return "{" + ",".join(parts) + "}"


def decode_call(call_id: str, encoded: str) -> tuple[Call, dict[str, Any]]:
    """The call, and its canvas fields (either form ``encode_request_call`` writes)."""
    decoded = kombu_json.loads(encoded)  # type: ignore[no-untyped-call]
    if isinstance(decoded, dict):  # a message's own body, [args, kwargs, embed]
        (args, kwargs, *rest), canvas = decoded["body"], decoded["canvas"]
        embed = rest[0] if rest and isinstance(rest[0], dict) else {}
        canvas = {**{k: v for k in EMBED_FIELDS if (v := embed.get(k))}, **canvas}
    else:
        args, kwargs = decoded[0], decoded[1]
        canvas = decoded[2] if len(decoded) > 2 else {}
    return Call(task_id_of(call_id), tuple(args), dict(kwargs or {})), dict(canvas)


def batch_body(fun: Callable[..., Any], *, bound: bool) -> Callable[..., Any]:
    """The task's ``run`` for a batched body ``fun(calls)`` (``fun(self, calls)`` when
    bound). It takes any call's arguments, so Celery's argument check at publish passes
    a call's own arguments (``index_docs.delay(account_id=7, doc_id=1)``)."""
    if bound:

        def run_bound(self: Any, *args: Any, **kwargs: Any) -> Any:
            return run_batch(self, fun, args, kwargs, bound=True)

        run: Callable[..., Any] = run_bound
    else:

        def run_plain(*args: Any, **kwargs: Any) -> Any:
            from celery import current_task

            return run_batch(current_task, fun, args, kwargs, bound=False)

        run = run_plain
    # Its name and module, not __wrapped__: the signature seen must stay (*args, **kwargs).
    for attr in ("__name__", "__qualname__", "__module__", "__doc__"):
        setattr(run, attr, getattr(fun, attr, None))
    run.__baton_batch_body__ = fun  # type: ignore[attr-defined]
    return run


def wrap_task(task: Any) -> None:
    """Make a registered batched task's ``run`` the batch runner (a task declared before
    ``Baton(app)``, or whose class was made elsewhere): once."""
    run = type(task).__dict__.get("run")
    fun = getattr(run, "__func__", run)  # a staticmethod's function
    if fun is None or hasattr(fun, "__baton_batch_body__"):
        return
    bound = not isinstance(run, staticmethod)
    wrapped = batch_body(fun, bound=bound)
    type(task).run = wrapped if bound else staticmethod(wrapped)
    if "_orig_run" in vars(task):  # Celery's autoretry_for wrapper calls the body it took
        task._orig_run = type(task).run.__get__(task) if bound else wrapped
    type(task).typing = False  # its __header__ is the body's (calls), not a call's


def run_batch(task: Any, fun: Callable[..., Any], args: Any, kwargs: Any, *, bound: bool) -> Any:
    request = task.request
    batch = getattr(request, BATCH_FIELD, None)
    own = str(getattr(request, "id", None) or "")
    if not batch:
        calls = [Call(own, tuple(args), dict(kwargs))]
        ((ok, value),) = outcomes(calls, _invoke(task, fun, calls, bound=bound))
        if not ok:
            raise value
        return value
    decoded = [decode_call(call_id, encoded) for call_id, encoded in batch["calls"]]
    calls = [call for call, _ in decoded]
    canvas = {call.id: fields for call, fields in decoded}
    others = [call for call in calls if call.id != own]
    try:
        returned = _invoke(task, fun, calls, bound=bound)
    except Retry as retry:
        # self.retry() in the body: Celery published the carrier's retry and marks it
        # RETRY; every other call of the batch is retried the same way, under its own
        # task id, then the batch is done (each retry is a call of its own).
        when = retry.sig.options if getattr(retry, "sig", None) is not None else {}
        given = {
            "countdown": when.get("countdown"),
            "eta": when.get("eta"),
            "max_retries": getattr(task, "override_max_retries", None),
        }
        _retry_batch(task, batch, calls, others, canvas, retry.exc, lambda _: given)
        raise
    except Exception as exc:
        if _autoretried(task, exc):
            # autoretry_for: Celery's wrapper around this runner retries the carrier;
            # every other call is retried alike, its backoff counted from its own retries.
            _retry_batch(
                task, batch, calls, others, canvas, exc, lambda c: _autoretry_options(task, c)
            )
            raise
        # A body that raises fails every call of its batch (the carrier by Celery, below),
        # each with the body's traceback, as the carrier's record has it.
        told = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
        _write_all(task, [_written(task, c, canvas[c.id], False, exc, told) for c in others])
        _done(task, batch, calls)
        raise
    results = outcomes(calls, returned)
    own_outcome: tuple[bool, Any] = (True, None)
    written = []
    for call, (ok, value) in zip(calls, results, strict=True):
        if call.id == own:
            own_outcome = (ok, value)
        else:
            written.append(_written(task, call, canvas[call.id], ok, value))
    _write_all(task, written)
    _done(task, batch, calls)
    ok, value = own_outcome
    if not ok:
        raise value
    return value


def _invoke(task: Any, fun: Callable[..., Any], calls: list[Call], *, bound: bool) -> Any:
    return fun(task, calls) if bound else fun(calls)


def fail_the_others(task: Any, carrier: Any, batch: dict[str, Any], exc: BaseException) -> None:
    """Every call of ``batch`` but its ``carrier``'s (a Celery request, failed by Celery
    itself) fails with ``exc``: written from the worker's main process when the batch's
    process or greenlet was killed at its hard time limit, as Celery writes a timed-out
    task's failure there."""
    own = str(carrier.id)
    decoded = [decode_call(call_id, encoded) for call_id, encoded in batch["calls"]]
    told = f"{type(exc).__name__}: {exc}"
    written = [
        _written(task, call, fields, False, exc, told, carrier=carrier)
        for call, fields in decoded
        if call.id != own
    ]
    _write_all(task, written)


def _context(task: Any, call: Call, canvas: dict[str, Any], carrier: Any = None) -> Any:
    """A call's request as Celery's trace would have it: its id, arguments and canvas;
    the worker's fields from its ``carrier``'s request (the task's own, in the pool)."""
    from celery.app.task import Context

    carrier = task.request if carrier is None else carrier
    return Context(
        {
            # The batch's worker ran it (its record's ``worker``); a call stored by an
            # earlier version without its own delivery_info: the carrier's queue.
            "hostname": getattr(carrier, "hostname", None),
            "delivery_info": getattr(carrier, "delivery_info", None) or {},
            **canvas,
            "id": call.id,
            "task": task.name,
            "args": call.args,
            "kwargs": call.kwargs,
        }
    )


def _retry_batch(
    task: Any,
    batch: dict[str, Any],
    calls: list[Call],
    others: list[Call],
    canvas: dict[str, dict[str, Any]],
    exc: BaseException | None,
    options: Callable[[dict[str, Any]], dict[str, Any]],
) -> None:
    """Retry every call of ``batch`` but its carrier (Celery retries that one), each with
    the ``retry()`` options its canvas gets, then tell the store the batch ran: each
    retry is a call of its own."""
    for call in others:
        _retry(task, call, canvas[call.id], exc=exc, **options(canvas[call.id]))
    _done(task, batch, calls)


def _retry(
    task: Any,
    call: Call,
    canvas: dict[str, Any],
    *,
    exc: BaseException | None,
    countdown: float | None,
    eta: Any,
    max_retries: int | None,
) -> None:
    """Retry one call of a batch whose body called ``self.retry()`` (or raised an
    ``autoretry_for`` error): published again as Celery's ``Task.retry`` publishes a
    task's retry (its own id, args, canvas and retry count; the carrier's queue), its
    state RETRY; past ``max_retries`` it fails with ``MaxRetriesExceededError``."""
    request = _context(task, call, canvas)
    request.delivery_info = task.request.delivery_info  # its queue: the carrier's
    request.called_directly = False  # a worker's run (retry() raises Retry otherwise)
    # Its own request alone (Celery 5.7's push_request would merge the carrier's in).
    task.request_stack.push(request)
    try:
        task.retry(exc=exc, countdown=countdown, eta=eta, max_retries=max_retries, throw=False)
    except Exception as failed:  # MaxRetriesExceededError (or the exc given), or no publish
        _write(task, _written(task, call, canvas, False, failed))
        return
    finally:
        task.pop_request()
    try:
        task.backend.mark_as_retry(call.id, exc, request=request)
    except Exception:
        logger.exception("%s[%s]: its RETRY state could not be written", task.name, call.id)


def _autoretried(task: Any, exc: BaseException) -> bool:
    """Whether Celery's ``autoretry_for`` wrapper, around this runner, retries ``exc``."""
    from celery.exceptions import Ignore

    if not hasattr(task, "_orig_run"):  # no wrapper: nothing retries the carrier
        return False
    retried = tuple(getattr(task, "autoretry_for", ()) or ())
    kept = tuple(getattr(task, "dont_autoretry_for", ()) or ())
    return bool(retried) and isinstance(exc, retried) and not isinstance(exc, (Ignore, *kept))


def _autoretry_options(task: Any, canvas: dict[str, Any]) -> dict[str, Any]:
    """What Celery's autoretry gives ``retry()`` for a call of ``canvas``'s retry count:
    the task's ``retry_kwargs``, and with ``retry_backoff`` the exponential countdown."""
    from celery.utils.time import get_exponential_backoff_interval

    options = dict(getattr(task, "retry_kwargs", None) or {})
    backoff = float(getattr(task, "retry_backoff", False) or 0)
    if backoff:
        options["countdown"] = get_exponential_backoff_interval(
            factor=int(max(1.0, backoff)),
            retries=int(canvas.get("retries") or 0),
            maximum=int(getattr(task, "retry_backoff_max", 600)),
            full_jitter=getattr(task, "retry_jitter", True),
        )
    return {
        "countdown": options.get("countdown"),
        "eta": options.get("eta"),
        "max_retries": options.get("max_retries"),
    }


def _written(
    task: Any,
    call: Call,
    canvas: dict[str, Any],
    ok: bool,
    value: Any,
    told: str | None = None,
    *,
    carrier: Any = None,
) -> Written:
    """One call's outcome with its request as Celery's trace would have it."""
    request = _context(task, call, canvas, carrier)
    request.ignore_result = task.ignore_result
    return Written(call.id, request, ok, value, told)


def _write_all(task: Any, written: list[Written]) -> None:
    """The calls' results: on a Redis result backend, the records of those Celery writes
    nothing else for in one read and one pipeline (``batch_results.py``); then each call's own
    steps after its record (and its record too, where it was not written together)."""
    stored: set[str] = set()
    if len(written) > 1:
        stored = store(task.backend, [w for w in written if bulk_eligible(w)])
    for item in written:
        _write(task, item, stored=item.call_id in stored)


def _write(task: Any, item: Written, *, stored: bool = False) -> None:
    """One call's result under its own task id, as Celery's trace writes a task's: its
    record (unless ``stored`` already), its chord's counter, then its chain's next task
    and its link callbacks (on success) or its link_error callbacks (on failure)."""
    from celery import signature

    request, value = item.request, item.value
    backend = task.backend
    try:
        if not item.ok:
            backend.mark_as_failure(
                item.call_id,
                value,
                traceback=item.traceback,
                request=request,
                store_result=not stored,
            )
            return
        backend.mark_as_done(item.call_id, value, request=request, store_result=not stored)
        root_id = request.root_id or item.call_id
        for callback in request.callbacks or ():
            signature(callback, app=task.app).apply_async(
                (value,), parent_id=item.call_id, root_id=root_id
            )
        chain = list(request.chain or ())
        if chain:
            following = signature(chain.pop(), app=task.app)
            following.apply_async((value,), chain=chain, parent_id=item.call_id, root_id=root_id)
    except Exception:
        # One call's result or callback that could not be written must not keep the
        # others' from being written, nor the batch from being marked done.
        logger.exception(
            "%s[%s]: its result in batch could not be written", task.name, item.call_id
        )


def _done(task: Any, batch: dict[str, Any], calls: list[Call]) -> None:
    """Tell the store the batch ran: each holder acks its call's message. If the store
    cannot hear it, the run's lease lapses and the batch runs again (at least once)."""
    parts = installed_parts(task.app)
    if parts is None:
        return
    # A store down for a moment (a restart, a failover) is waited for: the run's lease
    # outlives half its ttl, and a batch told done is a batch that never runs again.
    deadline = time.monotonic() + parts.settings.lease_ttl / 2
    while True:
        try:
            done = batch.get("done") or [c.id for c in calls]
            parts.batches.done(batch["keys"], batch["run"], done, batch["keep"])
            return
        except BatonError as exc:
            if time.monotonic() < deadline:
                time.sleep(0.2)
                continue
            logger.error(
                "%s: batch %s ran but the store could not be told (%s): it may run again",
                task.name,
                batch["run"],
                exc,
            )
            return
