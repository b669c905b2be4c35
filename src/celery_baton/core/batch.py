"""Batching by key across all workers (``@app.task(batch="account_id", batch_size=100,
batch_wait=1.0)``): the options, the ``Call`` a body receives, what its return value
means for each call, and the store's side of a key's batch. Celery-free.

Where the calls wait: as broker messages, held unacked in the consumer of the worker
that received them. The store holds a copy of each call (id, arguments, which worker
holds it) under the batch key, so any worker can run a batch of calls held by several
workers; the message is acked by its holder only once its call ran in a batch (a done
marker per call id). A store that forgets loses no call: each holder registers its
calls again (docs/guides/batching.md says what each failure does).

A key's state, one hash slot (the ``{batch:<task>:<key>}`` tag), in the store:

* ``pending``  sorted set: call id -> when it was registered (ms, the store's clock);
* ``calls``    hash: call id -> the call's arguments as the holder encoded them;
* ``holder``   hash: call id -> the worker holding its message;
* ``workers``  sorted set: worker -> until when it is alive (renewed by its ticks);
* ``claimed``  hash: call id -> ``"<run> <registered ms>"``, the calls of running batches;
* ``done``     sorted set: call id -> until when it is remembered as run;
* ``runs``     sorted set: the running batches' ids (``<worker>/<micros>``) -> until
  when their lease lasts (renewed by their runner's ticks);
* ``finished`` hash: worker -> the ids (comma separated) that ran since its last tick;
* ``epoch``    string: ``"<until when no batch is claimed (ms)> <replication id>"``,
  written when the key is first seen by this server: a server that restarted empty
  waits one run ttl from its start, so that a batch running meanwhile is written back
  by its runner first; and when the server was promoted from a replica (a failover: it
  may lack its old master's last claims and done markers), one run ttl from then, in
  which runners write their runs back and mark the batches they ran done again;
* ``label``    string: the key in words (keys.task_words), for the operator, kept while
  a worker ticks the key;
* ``here``     string, never replicated: this server checked its replication id for the
  key within the last second.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, TypeVar

from celery_baton.core.keys import KeyNames, KeySpec, digest
from celery_baton.errors import BatchResultError, ConfigError, CostError, KeySpecError
from celery_baton.store.connection import STORE_ERRORS, Store

if TYPE_CHECKING:
    from celery_baton.core.shared_limits import SharedLimit

#: The options a batched task cannot have, and why (said at declaration).
INCOMPATIBLE = {
    "exclusive": "not yet: batches of one key run side by side (issue 37)",
    "unique": "every call of a batch is a caller waiting for its own result",
    "debounce": "debounce keeps one call of a burst, batch keeps them all",
    "throttle": "throttle drops calls, batch keeps them all",
    "ordered": "not yet: a batch runs many calls of a key at once, ordered= one at a time",
}

DEFAULT_SIZE = 100
DEFAULT_WAIT = 1.0


@dataclass(frozen=True)
class Call:
    """One call of a batched task, as its body receives it::

        @app.task(batch="account_id", batch_size=100, batch_wait=1.0)
        def index_docs(calls):
            return [index(c.kwargs["doc_id"]) for c in calls]

    ``id`` is the call's task id (its caller's ``AsyncResult.id``).
    """

    id: str
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


#: Between a task id and its retry count in a delivery's id (``"<task id>~<retries>"``).
_RETRY_MARK = "~"


def delivery_id(task_id: str, retries: int) -> str:
    """A call's id in the store: its task id, and for a retry (Celery publishes it under
    the same task id) the retry's count too, so that a retry is a call of its own and
    not one that already ran (a done call's message that comes back is acked, not run)."""
    return f"{task_id}{_RETRY_MARK}{retries}" if retries else task_id


def task_id_of(call_id: str) -> str:
    """The task id of a delivery id (``delivery_id``)."""
    return call_id.split(_RETRY_MARK, 1)[0]


@dataclass(frozen=True)
class BatchPolicy:
    """A batched task's key, size and wait."""

    key: KeySpec
    size: int
    wait: float

    def material(self, task: str, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The text of a call's batch key; KeySpecError saying how to call when the call
        lacks the key's arguments (passed by position, or not at all)."""
        try:
            return self.key.material(args, kwargs)
        except KeySpecError as exc:
            names = ", ".join(f"{n}=..." for n in self.key.names) or "..."
            raise KeySpecError(
                f"{exc}; a batched task's calls pass the key's arguments by keyword: "
                f"{task.rsplit('.', 1)[-1]}.delay({names}, ...)"
            ) from exc


def any_call(*args: Any, **kwargs: Any) -> None:
    """The signature a batch key is bound to: the body takes the list of calls, so a
    key names the keyword arguments of a call (or a callable reads the call)."""


def body_of(fun: Callable[..., Any]) -> Callable[..., Any]:
    """The user's body behind a batched task's ``run`` (worker/pool/batch_run.py)."""
    return getattr(fun, "__baton_batch_body__", fun)


def compile_batch(
    name: str, options: Callable[[str], Any], fun: Callable[..., Any], *, bound: bool
) -> BatchPolicy | None:
    """Validate ``batch``, ``batch_size`` and ``batch_wait`` of task ``name`` (``fun``:
    its body); None when it is not batched. Raises ConfigError naming the task."""
    spec = options("batch")
    if spec is None or spec is False:
        for option in ("batch_size", "batch_wait"):
            if options(option) is not None:
                raise ConfigError(f"{option} needs batch", subject=name)
        return None
    for option, why in INCOMPATIBLE.items():
        if options(option):
            raise ConfigError(f"batch with {option}: {why}", subject=name)
    size = options("batch_size")
    size = DEFAULT_SIZE if size is None else size
    if isinstance(size, bool) or not isinstance(size, int) or size < 1:
        raise ConfigError(f"must be an int >= 1, got {size!r}", subject=f"{name}.batch_size")
    wait = options("batch_wait")
    wait = DEFAULT_WAIT if wait is None else wait
    if (
        isinstance(wait, bool)
        or not isinstance(wait, int | float)
        or not wait > 0
        or wait == float("inf")
    ):
        raise ConfigError(
            f"must be a number of seconds > 0 and finite, got {wait!r}",
            subject=f"{name}.batch_wait",
        )
    body = body_of(fun)
    # A bound task's run read from the task is a method (self already given), but the
    # body behind it is the plain function, self first.
    _check_body(name, body, bound=bound or (body is not fun and inspect.ismethod(fun)))
    key = KeySpec.build(spec, any_call, subject=f"{name}.batch")
    if key.names and "calls" in key.names:
        raise ConfigError(
            "batch key names 'calls', the body's list: name an argument the callers pass "
            "(batch='account_id' for index_docs.delay(account_id=7, ...))",
            subject=f"{name}.batch",
        )
    _check_fair_key(name, spec, key, options("fair_key"))
    return BatchPolicy(key, size, float(wait))


def _check_fair_key(name: str, spec: Any, key: KeySpec, fair: Any) -> None:
    """``fair_key`` on a batched task: a batch run is one admission of the shared limit,
    asked for under its carrier's fair key, so every call of a batch must have that fair
    key: each argument the fair key reads is one of the batch key's (then calls of one
    batch key share one fair key). Refused, naming what is missing, otherwise."""
    if fair is None or fair is False or fair is True:
        return  # none, or True: refused with the fair key's own rules (policy/compile.py)
    subject = f"{name}.fair_key"
    if key.whole_task:
        raise ConfigError(
            "batch=True with fair_key: batch=True makes one batch of every caller's calls, "
            "whatever their fair key, and a batch run is admitted under one fair key; "
            "batch by the fair key's arguments (batch=<the fair key's arguments>, or a "
            "list holding them)",
            subject=subject,
        )
    if key.func is not None:
        raise ConfigError(
            "batch with fair_key: the batch key is a callable, so which arguments it reads "
            "is unknown, and a batch's calls may not share one fair key; name the batch "
            "key's arguments (batch=['tenant', 'account_id'])",
            subject=subject,
        )
    fair_key = KeySpec.build(fair, any_call, subject=subject)
    if fair_key.func is not None:
        raise ConfigError(
            "batch with fair_key: a callable fair_key reads arguments that cannot be known, "
            "and a batch's calls may not share one fair key; name its arguments (each one "
            "also an argument of the batch key)",
            subject=subject,
        )
    missing = [n for n in fair_key.names if n not in key.names]
    if missing:
        said = ", ".join(repr(n) for n in dict.fromkeys(missing))
        wanted = list(dict.fromkeys([*key.names, *missing]))
        raise ConfigError(
            f"batch with fair_key: fair_key reads {said}, which the batch key {spec!r} does "
            "not: one batch would hold calls of several fair keys, and a batch run is "
            f"admitted under one; add it to the batch key (batch={wanted!r})",
            subject=subject,
        )


def _check_body(name: str, fun: Callable[..., Any], *, bound: bool) -> None:
    """A batched body takes one argument, the list of calls: a body written for one call
    (``def index_docs(account_id, doc_id)``) is the likeliest mistake."""
    try:
        params = list(inspect.signature(fun).parameters.values())
    except (TypeError, ValueError):
        return
    if bound:
        params = params[1:]
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    variadic = (inspect.Parameter.VAR_POSITIONAL, inspect.Parameter.VAR_KEYWORD)
    required = [p for p in params if p.default is p.empty and p.kind not in variadic]
    if not positional or len(required) > 1:
        takes = ", ".join(p.name for p in params) or "nothing"
        raise ConfigError(
            f"a batched task's body takes one argument, the list of calls "
            f"(def {getattr(fun, '__name__', 'body')}(calls): ...), but it takes: {takes}",
            subject=name,
        )


def check_batch_cost(
    name: str, batch: BatchPolicy, cost: object, shared: Sequence[SharedLimit]
) -> None:
    """A batched task's ``cost=``: a number is spent by each batch run (checked against
    the limits' bursts with the limits); a callable gets the batch's list of calls, as
    its body does (``cost=len``: one unit per call). ``cost=len`` with batches a limit's
    burst cannot hold would never run a full batch: refused. ConfigError naming the task."""
    if not callable(cost):
        return
    try:
        inspect.signature(cost).bind([])
    except TypeError:
        raise ConfigError(
            "a batched task's cost= gets the batch's list of calls, as its body does "
            "(cost=len: one unit per call; cost=lambda calls: sum(...)), but it takes: "
            f"{inspect.signature(cost)}",
            subject=f"{name}.cost",
        ) from None
    except ValueError:  # a callable without a signature Python can read: asked at runs
        pass
    for limit in shared:
        if cost is len and batch.size > limit.burst:
            raise ConfigError(
                f"cost=len: a full batch of {batch.size} calls costs {batch.size}, more than "
                f"the burst {limit.burst} of limit {limit.name!r} could ever admit; set "
                f"batch_size <= {limit.burst} (or the limit's burst >= {batch.size})",
                subject=f"{name}.cost",
            )


T = TypeVar("T")


def fit_batch(
    calls: list[T], carrier: int, price: Callable[[list[T]], float]
) -> tuple[list[T], float]:
    """The calls of a claimed batch that one admission of its named limits can take (in
    their order), and their cost (``price``: a batch's cost, CostError when a limit's
    burst could never admit it). All of them when they fit; else ``calls[carrier]`` (its
    message carries the run) and as many of the others, oldest first, as fit (found by
    halving: a batch's cost grows with its calls). CostError when the carrier alone does
    not fit: it can never run, as a plain call of that cost never would."""
    try:
        return calls, price(calls)
    except CostError:
        if len(calls) == 1:
            raise
    others = [i for i in range(len(calls)) if i != carrier]

    def first(k: int) -> list[T]:
        return [calls[i] for i in sorted([carrier, *others[:k]])]

    best = first(0)
    cost = price(best)
    low, high = 0, len(others) - 1  # first(low) fits; first(high + 1), all, does not
    while low < high:
        middle = (low + high + 1) // 2
        try:
            cost, best, low = price(first(middle)), first(middle), middle
        except CostError:
            high = middle - 1
    return best, cost


def outcomes(calls: Sequence[Call], returned: Any) -> list[tuple[bool, Any]]:
    """Each call's outcome from a body's return value: ``(True, result)`` or ``(False,
    error)``. A list (or tuple) gives one result per call, in order; a mapping gives
    them by call id, and a call it lacks fails with a BatchResultError naming it."""
    if isinstance(returned, Mapping):
        return [
            (True, returned[call.id])
            if call.id in returned
            else (
                False,
                BatchResultError(
                    f"the batch's body returned no result for call {call.id} (a mapping "
                    f"of {len(returned)} results for {len(calls)} calls)",
                    call_id=call.id,
                ),
            )
            for call in calls
        ]
    if isinstance(returned, list | tuple) and len(returned) == len(calls):
        return [(True, value) for value in returned]
    what = (
        f"{len(returned)} results"
        if isinstance(returned, list | tuple)
        else f"a {type(returned).__name__}"
    )
    return [
        (
            False,
            BatchResultError(
                f"the batch's body returned {what} for {len(calls)} calls: return one "
                "result per call, in order, or a mapping by call id",
                call_id=call.id,
            ),
        )
        for call in calls
    ]


def batch_keys(names: KeyNames, task: str, key_digest: str) -> list[str]:
    """The store keys of one batch key, in the order every batch script takes them."""
    base = f"{names.prefix}:{{batch:{task}:{key_digest}}}"
    return [
        f"{base}:{part}"
        for part in (
            "pending",
            "calls",
            "holder",
            "workers",
            "claimed",
            "done",
            "runs",
            "finished",
            "epoch",
            "label",
            "here",
        )
    ]


def _ms(seconds: float) -> int:
    return max(1, int(seconds * 1000))


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


@dataclass
class Claim:
    """A batch this worker claimed: run it with ``carrier``'s message."""

    run: str
    carrier: str
    calls: list[tuple[str, str]]  # (call id, encoded arguments), oldest first


@dataclass
class TickReply:
    """What batch_tick.lua said about one key."""

    finished: list[str]  # held calls that ran (or had run): ack them
    missing: list[str]  # held calls the store does not know: register them again
    due: float | None  # seconds until a batch is due (None: nothing waits)
    claims: list[Claim]  # the batches this worker claimed, oldest first
    # Seconds of the grace this tick started: the server was promoted from a replica
    # (a failover) and may lack its old master's last claims and done markers (0: none).
    promoted: float = 0.0
    redone: int = 0  # calls of ``done`` whose marker the store had lost: done again
    # Seconds left of the key's grace (no claim: the store may have lost claims and done
    # markers; 0: none): the batches this worker ran are sent as ``done`` meanwhile.
    grace: float = 0.0


@dataclass
class KeyTick:
    """One key's tick: what this worker asks and tells of it."""

    keys: list[str]
    size: int
    wait: float
    run_ttl: float = 8.0  # the task's lease_ttl: how long a run outlives its last renewal
    runs: list[str] = field(default_factory=list)  # the batches this worker runs of it
    # Their calls, (run, call id), at a full check (else none): written back when the
    # store forgot a run.
    run_calls: list[tuple[str, str]] = field(default_factory=list)
    gone: list[str] = field(default_factory=list)  # held calls cancelled: they leave
    new: list[tuple[str, str]] = field(default_factory=list)  # calls to register
    held: list[str] | None = None  # every held call id: a full check (None: not now)
    label: str = ""  # the key in words, for the operator
    # Calls of batches this worker ran to their end within the last run ttl (at a full
    # check in the key's grace, else none): marked done again where the store lost the
    # marker (a failover).
    done: list[str] = field(default_factory=list)
    keep: float = 0.0  # how long a done call is remembered
    most: int = 1  # how many due batches it may claim (its free processes; 0: none)


class Batches:
    """The store's side of batching: one script call per key per tick, and the end of a
    run. Raises StoreUnavailable."""

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def keys(self, task: str, material: str) -> list[str]:
        return batch_keys(self.names, task, digest(material))

    def tick(self, worker: str, presence: float, ticks: Sequence[KeyTick]) -> list[TickReply]:
        """Register new calls, renew this worker's presence and its runs, learn which
        held calls ran, and claim due batches: every key's in one round trip."""
        calls = []
        for t in ticks:
            args: list[Any] = [
                worker,
                _ms(presence),
                t.size,
                _ms(t.wait),
                _ms(t.run_ttl),
                " ".join(t.runs),
                t.label,
                max(0, t.most),
                len(t.new),
            ]
            for call_id, payload in t.new:
                args += [call_id, payload]
            args.append(len(t.run_calls))
            for run, call_id in t.run_calls:
                args += [run, call_id]
            args += [len(t.done), _ms(t.keep), *t.done]
            args += [len(t.gone), *t.gone]
            if t.held is not None:
                args += ["1", *t.held]
            else:
                args.append("0")
            calls.append((t.keys, args))
        try:
            replies = self.store.scripts.call_many("batch_tick", calls)
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc
        return [_tick_reply(reply) for reply in replies]

    def done(self, keys: list[str], run: str, call_ids: Sequence[str], keep: float) -> None:
        """The batch ``run`` ran (its results are written): its calls are done."""
        try:
            self.store.scripts.call("batch_done", keys, [run, _ms(keep), *call_ids])
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def end(
        self,
        keys: list[str],
        run: str,
        carrier: str,
        done: Sequence[str] = (),
        keep: float = 0.0,
    ) -> int:
        """The run's carrying request left the pool: calls it did not mark done wait
        again; the carrier's own call is Celery's (acked or requeued with its message).
        ``done``: the batch's calls, when its body returned (marked done again, in case
        the store lost the marker its pool process wrote). Returns how many of them
        the store did not have done (their marker lost): done now."""
        args: list[Any] = [run, carrier]
        if done:
            args += [_ms(keep), *done]
        try:
            reply = self.store.scripts.call("batch_end", keys, args)
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc
        return int(reply[1]) if isinstance(reply, list | tuple) and len(reply) > 1 else 0


def _tick_reply(reply: Sequence[Any]) -> TickReply:
    finished = [_text(x) for x in reply[0]]
    missing = [_text(x) for x in reply[1]]
    due_ms = int(reply[2])
    claims = [
        Claim(
            _text(raw[0]),
            _text(raw[1]),
            [(_text(raw[i]), _text(raw[i + 1])) for i in range(2, len(raw), 2)],
        )
        for raw in reply[3]
    ]
    promoted = int(reply[4]) / 1000 if len(reply) > 4 else 0.0
    redone = int(reply[5]) if len(reply) > 5 else 0
    grace = int(reply[6]) / 1000 if len(reply) > 6 else 0.0
    return TickReply(
        finished, missing, None if due_ms < 0 else due_ms / 1000, claims, promoted, redone, grace
    )
