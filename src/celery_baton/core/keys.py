"""Canonical keys from a key spec and a call's arguments. Celery-free, pure logic.

A key spec says which arguments make two calls "the same":

* ``True``: one key for the whole task;
* ``"feed_url"``: an argument name; ``["tenant", "host"]``: several names;
* ``"{tenant}/{host}"``: a template over argument names;
* a callable ``(*args, **kwargs) -> str``.

Arguments are bound to the function's signature with defaults applied, so ``f(1, b=2)``,
``f(a=1, b=2)`` and ``f(1, 2)`` give one key. Values are serialised as sorted JSON and
hashed, so a key never leaks argument values into the store and has a bounded length.
"""

from __future__ import annotations

import hashlib
import inspect
import json
import string
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from celery_baton.errors import KeySpecError
from celery_baton.store.schema import hash_tag

KeySpecValue = bool | str | Sequence[str] | Callable[..., Any]

_formatter = string.Formatter()


def _template_fields(template: str, subject: str) -> list[str]:
    names = []
    try:
        fields = list(_formatter.parse(template))
    except ValueError as exc:  # "{k": Python's own words alone named neither task nor option
        raise KeySpecError(
            f"template {template!r} is not a format string: {exc} (a literal brace is "
            "written twice: '{{' or '}}')",
            subject=subject,
        ) from None
    for _, name_expr, _, conversion in fields:
        if name_expr is None:
            continue
        if conversion not in (None, "r", "s", "a"):
            raise KeySpecError(
                f"template {template!r} has the conversion !{conversion}; only !r, !s and !a exist",
                subject=subject,
            )
        # "{user.id}" or "{items[0]}" read from the argument "user" / "items".
        root = name_expr.split(".", 1)[0].split("[", 1)[0]
        if not root:
            raise KeySpecError(
                f"template {template!r} has a positional field; name arguments",
                subject=subject,
            )
        names.append(root)
    return names


@dataclass(frozen=True)
class KeySpec:
    """A validated key spec bound to one function's signature.

    >>> def fetch(host, path="/"): ...
    >>> spec = KeySpec.build("host", fetch, subject="fetch")
    >>> spec.key(("example.org",), {}) == spec.key((), {"host": "example.org", "path": "/x"})
    True
    """

    subject: str
    signature: inspect.Signature | None
    names: tuple[str, ...]
    template: str | None = None
    func: Callable[..., Any] | None = None
    whole_task: bool = False
    _binder: _Binder | None = field(default=None, init=False, repr=False, compare=False)
    # One argument named, passed by position: (its position, the arity, the text before
    # its value); see ``_one_value``.
    _one: tuple[int, int, str] | None = field(default=None, init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        binder = _Binder(self.signature) if self.signature is not None else None
        binder = binder if binder and binder.simple else None
        object.__setattr__(self, "_binder", binder)
        if (
            binder is not None
            and len(self.names) == 1
            and self.template is None
            and self.func is None
            and not self.whole_task
            and self.names[0] in binder.positional
            and set(binder.required) <= set(binder.positional)
        ):
            name = self.names[0]
            before = "{" + _canonical_json(name) + ":"
            object.__setattr__(
                self, "_one", (binder.positional.index(name), len(binder.positional), before)
            )

    @classmethod
    def build(
        cls, spec: KeySpecValue, fun: Callable[..., Any], *, subject: str, bound: bool = False
    ) -> KeySpec:
        """Validate ``spec`` against ``fun``'s signature; raise KeySpecError now, not later.

        ``bound``: ``fun`` takes ``self`` first (a ``bind=True`` task) which is not an argument.
        """
        try:
            signature: inspect.Signature | None = inspect.signature(fun)
        except (TypeError, ValueError):
            signature = None
        if bound and signature is not None:
            signature = signature.replace(parameters=list(signature.parameters.values())[1:])
        if spec is True:
            return cls(subject, signature, (), whole_task=True)
        if spec is False or spec is None:
            raise KeySpecError("a key spec cannot be False/None here", subject=subject)
        if callable(spec):
            return cls(subject, signature, (), func=spec)
        template: str | None = None
        if isinstance(spec, str):
            if "{" in spec:
                template = spec
                names = tuple(_template_fields(spec, subject))
            else:
                names = (spec,)
        elif isinstance(spec, Sequence) and all(isinstance(n, str) for n in spec):
            names = tuple(spec)
        else:
            raise KeySpecError(
                f"expected True, an argument name, a list of names, a '{{template}}' or a "
                f"callable, got {spec!r}",
                subject=subject,
            )
        if not names:
            # celery-once's `once={"keys": []}` copied as is: its meaning is ours `True`.
            raise KeySpecError(
                f"key spec {spec!r} names no argument (one key for the whole task is True)",
                subject=subject,
            )
        if signature is not None:
            params = signature.parameters
            takes_kwargs = any(p.kind is p.VAR_KEYWORD for p in params.values())
            for name in names:
                if name not in params and not takes_kwargs:
                    raise KeySpecError(
                        f"key spec {spec!r} names argument {name!r}, which the function does "
                        f"not take (it takes: {', '.join(params) or 'nothing'})",
                        subject=subject,
                    )
        return cls(subject, signature, names, template=template)

    def arguments(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any]:
        """The call's arguments by name, defaults applied (``**kw`` merged in)."""
        if self.signature is None:
            return dict(kwargs)
        binder = self._binder
        named = binder.bind(args, kwargs) if binder is not None else None
        if named is not None:
            return named
        try:
            bound = self.signature.bind(*args, **kwargs)
        except TypeError as exc:
            raise KeySpecError(
                f"arguments do not match the task: {exc}", subject=self.subject
            ) from exc
        bound.apply_defaults()
        named = dict(bound.arguments)
        for name, param in self.signature.parameters.items():
            if param.kind is param.VAR_KEYWORD:
                named.update(named.pop(name, {}))
        return named

    def material(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """The canonical, human-readable text of the key (before hashing)."""
        if self.whole_task:
            return ""
        if self._one is not None and not kwargs:
            text = self._one_value(args)
            if text is not None:
                return text
        if self.func is not None:
            try:
                value = self.func(*args, **kwargs)
            except Exception as exc:  # the app's own code: its error refuses the call
                raise KeySpecError(f"key function raised {exc!r}", subject=self.subject) from exc
            if not isinstance(value, str):
                raise KeySpecError(
                    f"key function returned {type(value).__name__}, not str", subject=self.subject
                )
            return value
        named = self.arguments(args, kwargs)
        if self.template is not None:
            try:
                return self.template.format_map(named)
            except Exception as exc:  # a field missing, or a format spec that does not fit
                # (ValueError, TypeError), or an argument's own __format__ failing
                raise KeySpecError(
                    f"template {self.template!r}: {exc!r}", subject=self.subject
                ) from exc
        missing = [n for n in self.names if n not in named]
        if missing:
            raise KeySpecError(f"call lacks argument(s) {missing}", subject=self.subject)
        try:
            return _canonical_json({n: named[n] for n in self.names})
        except (TypeError, ValueError) as exc:
            raise KeySpecError(
                f"argument cannot be serialised into a key: {exc}", subject=self.subject
            ) from exc

    def key(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> str:
        """A short stable digest of the canonical key text."""
        return digest(self.material(args, kwargs))

    def _one_value(self, args: Sequence[Any]) -> str | None:
        """The material of the commonest key, built without binding the call: one
        argument named (an id), an int or a str, every argument given by position (so
        the binding could not fail). The same text as the general path's JSON; None
        for anything else."""
        assert self._one is not None
        position, arity, before = self._one
        if len(args) != arity:
            return None
        value = args[position]
        kind = type(value)
        if kind is int:
            return f"{before}{int.__repr__(value)}}}"
        if kind is str:
            return f"{before}{_json_string(value)}}}"
        return None


#: Sorted, compact, unescaped JSON (one encoder, built once: json.dumps with options
#: builds a new encoder per call).
_canonical_json = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode
#: A str as that encoder writes it (``ensure_ascii=False``).
_json_string: Callable[[str], str] = json.encoder.encode_basestring


class _Binder:
    """``Signature.bind`` + ``apply_defaults`` for the common signature (named parameters,
    optional ``**kwargs``), at a fraction of its cost: keys are built for every
    delivery on the worker's event loop. Any call it does not vouch for (too many
    arguments, a missing or unknown one, positional-only or ``*args`` parameters) goes
    to ``Signature.bind``, which gives the exact error."""

    def __init__(self, signature: inspect.Signature) -> None:
        params = list(signature.parameters.values())
        kinds = {p.kind for p in params}
        self.simple = not kinds & {
            inspect.Parameter.POSITIONAL_ONLY,
            inspect.Parameter.VAR_POSITIONAL,
        }
        named = [p for p in params if p.kind is not p.VAR_KEYWORD]
        self.positional = tuple(p.name for p in named if p.kind is p.POSITIONAL_OR_KEYWORD)
        self.names = frozenset(p.name for p in named)
        self.defaults = tuple((p.name, p.default) for p in named if p.default is not p.empty)
        self.required = tuple(p.name for p in named if p.default is p.empty)
        self.takes_kwargs = inspect.Parameter.VAR_KEYWORD in kinds

    def bind(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> dict[str, Any] | None:
        """The arguments by name, or None to let ``Signature.bind`` decide."""
        if len(args) > len(self.positional):
            return None
        named = dict(zip(self.positional, args, strict=False))  # args may be fewer
        for name, value in kwargs.items():
            if name in named or (name not in self.names and not self.takes_kwargs):
                return None
            named[name] = value
        for name, default in self.defaults:
            if name not in named:
                named[name] = default
        for name in self.required:
            if name not in named:
                return None
        return named


def digest(text: str) -> str:
    return hashlib.blake2b(text.encode(), digest_size=12).hexdigest()


def epoch_key(key: str) -> str:
    """The store epoch key of the family that lease ``key`` belongs to.

    The gate creates it with a family's first lease and returns its value with every
    grant; it is never deleted, so only a store that lost its data is without it (or has
    another one). It also names the replication id of the server that wrote it: found on
    a replica promoted since, it is replaced (gate.lua, "E"). Renewals compare it to tell
    a lease the store forgot (write it back) from one that was released, unlocked or
    expired (never write it back). It shares
    ``key``'s ``{hash tag}``, so one script call may use both on Redis Cluster:
    ``"baton:{t}:ex:k"`` -> ``"baton:{t}:epoch"`` (:meth:`KeyNames.epoch`). A key
    without a tag gets an epoch of its own, on its own slot: ``"k"`` -> ``"{k}:epoch"``.
    """
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    if end > start + 1:
        return f"{key[: end + 1]}:epoch"
    return f"{{{key}}}:epoch"


#: Bounds of a key in words: each value, and the whole.
WORDS_VALUE = 60
WORDS_MAX = 160


def _cut(text: str, limit: int) -> str:
    return text if len(text) <= limit else text[: limit - 1] + "…"


def beat_slot_material(entry: str, slot_ms: Any) -> str:
    """What a beat slot's run lease is, for :func:`words`: the entry and slot it runs
    once (``store.inspect.lease_kind`` names such a lease a beat slot by these words)."""
    try:
        moment = datetime.fromtimestamp(int(slot_ms) / 1000, tz=timezone.utc)
        slot = moment.strftime("%Y-%m-%dT%H:%M:%SZ")
    except (TypeError, ValueError, OverflowError, OSError):
        slot = str(slot_ms)
    return f"beat entry {entry!r}, slot {slot}"


def words(lease_key: str, material: str) -> str:
    """A key in words, from its task and the text its digest was made of:
    ``import_feed(feed_url='https://…')``; a template's or a function's text as it is;
    ``import_feed (the whole task)``. Bounded to :data:`WORDS_MAX` characters."""
    return task_words(hash_tag(lease_key), material)


def task_words(task_name: str, material: str) -> str:
    """:func:`words` of a key of task ``task_name`` (a batch key's store keys are tagged
    ``{batch:<task>:<digest>}``, not ``{<task>}``)."""
    task = task_name.rsplit(".", 1)[-1]
    if material == "":
        return _cut(f"{task} (the whole task)", WORDS_MAX)
    try:
        named = json.loads(material)
    except ValueError:
        named = None
    if not isinstance(named, dict):  # a template's or a key function's text
        return _cut(f"{task}: {material}", WORDS_MAX)
    shown = []
    for name, value in named.items():
        # A cut string keeps its closing quote: the operator sees where it was cut.
        text = repr(_cut(value, WORDS_VALUE - 2)) if isinstance(value, str) else repr(value)
        shown.append(f"{name}={_cut(text, WORDS_VALUE)}")
    inner = _cut(", ".join(shown), WORDS_MAX - len(task) - 2)
    return f"{task}({inner})"


@dataclass(frozen=True)
class KeyNames:
    """Builds store key names. Every key of one task shares the ``{task name}`` hash tag,
    so one gate call's keys always live on one Redis Cluster slot."""

    prefix: str = "baton"

    def family(self, task: str) -> str:
        return f"{self.prefix}:{{{task}}}"

    def lease(self, task: str, kind: str, key: str) -> str:
        """kind: "ex" (exclusive), "cc" (concurrency), "run" (redelivery guard)."""
        return f"{self.family(task)}:{kind}:{key}"

    def rate(self, task: str, key: str) -> str:
        return f"{self.family(task)}:rate:{key}"

    def unique(self, task: str, key: str) -> str:
        return f"{self.family(task)}:uq:{key}"

    def supersede(self, task: str, key: str) -> str:
        """The publish order of an exclusive key whose duplicates supersede each other."""
        return f"{self.family(task)}:sup:{key}"

    def ordered(self, task: str, key: str) -> str:
        """An ordered key's order record (positions given, the next to start)."""
        return f"{self.family(task)}:ord:{key}"

    def superseded(self, task: str, task_id: str) -> str:
        """Whether a unique ``replace`` publish superseded ``task_id`` (or it started)."""
        return f"{self.family(task)}:sby:{task_id}"

    def debounce(self, task: str, key: str) -> str:
        """A debounced key's state hash; its other keys add a suffix (same hash tag)."""
        return f"{self.family(task)}:db:{key}"

    def throttle(self, task: str, key: str) -> str:
        return f"{self.family(task)}:th:{key}"

    def done(self, task: str, task_id: str) -> str:
        return f"{self.family(task)}:done:{task_id}"

    def slot_runs(self, task: str, app: str, entry: str) -> str:
        """The slots of beat entry ``entry`` (of app ``app``) that ran (policy/slot_runs.py)."""
        return f"{self.family(task)}:beat-runs:{digest(json.dumps([app, entry]))}"

    def limits(self, task: str) -> str:
        return f"{self.family(task)}:limits"

    def fair(self, task: str, kind: str, key: str) -> str:
        """The fairness state of one shared limit (kind "cc" or "rate", its key); its
        parts are this name with ``:q``, ``:p`` and ``:s`` (gate.lua, "F")."""
        return f"{self.family(task)}:fair:{kind}:{key}"

    def epoch(self, task: str) -> str:
        """The family's store epoch (see :func:`epoch_key`, which finds it from a lease key)."""
        return f"{self.family(task)}:epoch"

    def shared_rate(self, limit: str) -> str:
        """A named limit's GCRA key (``baton_limits``): its own hash tag, shared by
        every task that uses it (on Cluster, its own slot: see Gate.decide)."""
        return f"{self.prefix}:{{limit:{limit}}}:rate"

    def shared_penalty(self, limit: str) -> str:
        """A named limit's penalty (``penalize``): beside its rate key, on its slot."""
        return f"{self.prefix}:{{limit:{limit}}}:penalty"

    @property
    def store_epoch(self) -> str:
        """The store-wide epoch: when the store was last found new, without its data or
        promoted from a replica (ms), and its replication id then; no new lease is
        granted for one lease ttl after that (gate.lua, "G")."""
        return f"{self.prefix}:epoch"

    @property
    def cancels(self) -> str:
        """The store-wide cancel marker (a hash, ``core/cancels.py``): field ``id`` and
        ``key:<task>`` hold until when (ms, store clock) cancels of that kind may live.
        A worker reads it to know whether a delivery needs a cancel check at all."""
        return f"{self.prefix}:cancels"

    def cancel_id(self, task_id: str) -> str:
        """The cancel record of one task id. Its hash tag is the id: ``baton.cancel``
        knows only the id, and on Redis Cluster the records spread over the slots."""
        return f"{self.prefix}:cancel:{{{task_id}}}"

    def held_for_later(self, task_id: str) -> str:
        """The mark of a unique task a worker holds for later (its countdown or ETA): the
        unique key it holds, read by ``baton.cancel`` of its id. Its cancel record's hash
        tag (the id): the cancel reads it in the same step."""
        return f"{self.prefix}:held:{{{task_id}}}"

    def cancel_keys(self, task: str) -> str:
        """The key cancels of ``task`` (a sorted set, ``core/cancels.py``), in its family."""
        return f"{self.family(task)}:cancel-keys"

    @property
    def notice_channel(self) -> str:
        return f"{self.prefix}:released"

    def worker(self, hostname: str) -> str:
        return f"{self.prefix}:worker:{hostname}"


def given_back(unique_key: str, task_id: str) -> str:
    """The mark a give-back leaves for ``task_id``'s claim of ``unique_key`` that the store
    had not written yet (a claim whose reply was lost, still buffered by a paused store):
    the late claim finds it and writes nothing. Same hash tag as the unique key."""
    family, _, digest = unique_key.rpartition(":uq:")
    return f"{family}:uq-given-back:{digest}:{task_id}"
