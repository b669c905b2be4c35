"""Cancels that stick: records in the store that every worker consults. Celery-free.

Celery's ``revoke`` lives in each worker's memory: a worker that was offline, restarting
or new never hears of it. A cancel here is a record in the store, kept for a bounded
time (``ttl``), that the worker receiving a delivery consults before the delivery
starts, whichever worker it is and whenever it came:

* **by id** (``cancel_id.lua``): one record per task id, its hash tag the id (found
  from the id alone, spread over a Redis Cluster's slots);
* **by key** (``cancel_key.lua``): a task's sorted set of ``(cut, key)`` members in
  the task's family: a call of the task whose arguments hold the key's values and that
  was published at or before the cut (its publish stamp's time) is cancelled; calls
  published after it run.

**Plain tasks stay free of it.** A store-wide marker (``cancel_mark.lua``, a small hash)
says until when cancels by id, and each task's cancels by key, may live. A worker reads
it at start, on every cancel notice (the notice channel, pub/sub) and every
:data:`REFRESH` seconds; while it holds no live cancel by id, a delivery is not checked
at all, and key cancels are matched in the worker's memory (they are few: one per
cancelled key). Only while a cancel by id lives does a delivery pay one check
(``cancel_check.lua``, pipelined on the gate channel).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from celery_baton.core.gate import Release
from celery_baton.core.keys import KeyNames, KeySpec
from celery_baton.errors import KeySpecError
from celery_baton.store.connection import STORE_ERRORS, Store

logger = logging.getLogger("celery_baton.core.cancels")

#: Seconds between a worker's reads of the cancel marker: the bound on how late a
#: worker that missed a notice (its subscription broken) learns of a cancel.
REFRESH = 2.0

#: The most ids a worker remembers from notices (about 100 bytes each).
NOTICED_MAX = 10_000

ID_FIELD = "id"
KEY_FIELD_PREFIX = "key:"

_canonical_json = json.JSONEncoder(
    sort_keys=True, separators=(",", ":"), ensure_ascii=False, allow_nan=False
).encode


def key_material(task: str, key: Mapping[str, Any]) -> str:
    """The canonical text of a cancel's key: sorted compact JSON, as a key spec over the
    same argument names makes it (``KeySpec.material``), so the two compare equal."""
    if not isinstance(key, Mapping) or not key:
        raise KeySpecError("a cancel's key is a non-empty dict of argument values", subject=task)
    if not all(isinstance(name, str) for name in key):
        raise KeySpecError(f"a cancel's key names arguments by str, got {key!r}", subject=task)
    try:
        return _canonical_json(dict(key))
    except (TypeError, ValueError) as exc:
        raise KeySpecError(f"the key cannot be serialised: {exc}", subject=task) from exc


@dataclass(frozen=True)
class KeyCancel:
    """One cancel by key: calls published at or before ``cut_ms`` whose arguments hold
    the values of ``material`` (canonical JSON of ``{name: value}``)."""

    cut_ms: int
    material: str

    @property
    def member(self) -> str:
        return f"{self.cut_ms} {self.material}"

    @classmethod
    def from_member(cls, member: str) -> KeyCancel:
        cut, _, material = member.partition(" ")
        return cls(int(cut), material)

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(json.loads(self.material))

    def covers(self, sent_ms: int | None, material: str) -> bool:
        """Whether a call published at ``sent_ms`` (None: unknown, so before any cut)
        whose key over :attr:`names` is ``material`` is cancelled."""
        return material == self.material and (sent_ms is None or sent_ms <= self.cut_ms)


def cancel_notice(marker: str, kind: str, ttl_ms: int, subject: str) -> str:
    """The text published on the notice channel: ``<marker>\\n<kind>\\n<ttl ms>\\n<subject>``;
    kind ``id`` (subject: the task id) or ``key`` (subject: ``<task>\\n<member>``)."""
    return f"{marker}\n{kind}\n{ttl_ms}\n{subject}"


@dataclass(frozen=True)
class Notice:
    kind: str
    ttl: float
    task_id: str = ""
    task: str = ""
    cancel: KeyCancel | None = None


def parse_notice(marker: str, text: str) -> Notice | None:
    """A cancel notice, or None when ``text`` is not one (a release notice)."""
    if not text.startswith(marker + "\n"):
        return None
    parts = text.split("\n", 4)
    try:
        ttl = int(parts[2]) / 1000
        if parts[1] == ID_FIELD and len(parts) == 4:
            return Notice(ID_FIELD, ttl, task_id=parts[3])
        if parts[1] == "key" and len(parts) == 5:
            return Notice("key", ttl, task=parts[3], cancel=KeyCancel.from_member(parts[4]))
    except (ValueError, IndexError):
        pass
    logger.warning("a cancel notice that cannot be read: %r", text[:200])
    return None


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class Cancels:
    """The store side of cancels, on one store.

    >>> Cancels(store, names).cancel_id("5f0c...", ttl=3600)  # doctest: +SKIP
    """

    def __init__(self, store: Store, names: KeyNames) -> None:
        self.store = store
        self.names = names

    def _call(self, script: str, keys: Sequence[str], args: Sequence[Any]) -> Any:
        try:
            return self.store.scripts.call(script, keys, args)
        except STORE_ERRORS as exc:
            raise self.store.unavailable(exc) from exc

    def cancel_id(self, task_id: str, *, ttl: float) -> str:
        """Cancel every delivery of ``task_id`` for ``ttl`` seconds: the unique key a
        worker holds it under while it waits for its countdown or ETA ('' : none); that
        delivery will not start (``held_start``). Raises StoreUnavailable."""
        ttl_ms = max(1, round(ttl * 1000))
        # The marker first: a worker that sees the record has seen the marker.
        self._call("cancel_mark", [self.names.cancels], [ID_FIELD, ttl_ms])
        notice = cancel_notice(self.names.cancels, ID_FIELD, ttl_ms, task_id)
        held = self._call(
            "cancel_id",
            [self.names.cancel_id(task_id), self.names.held_for_later(task_id)],
            [ttl_ms, self.names.notice_channel, notice],
        )
        return _text(held) if held else ""

    def free_held(self, unique_key: str, task_id: str) -> None:
        """Free the unique claim of ``task_id``, cancelled while a worker held it for later
        (``cancel_id``'s reply); a claim another task took meanwhile stays. Raises
        StoreUnavailable."""
        release = Release.unique_claim(unique_key, task_id)
        keys, args = release.script_call(self.names.notice_channel)
        self._call("release", keys, args)

    def held_call(
        self, task_id: str, unique_key: str, ttl: float
    ) -> tuple[str, list[str], list[Any]]:
        """``held_for_later``'s script, keys and arguments (a worker holds ``task_id``,
        a unique task under ``unique_key``, for later), for a pipelined channel."""
        ttl_ms = max(1, round(ttl * 1000))
        return "held_for_later", [self.names.held_for_later(task_id)], [unique_key, ttl_ms]

    def start_call(self, task_id: str) -> tuple[str, list[str], list[Any]]:
        """``held_start``'s script, keys and arguments: the mark of a task held for later
        taken back as its time comes; replies 1 when the id is cancelled."""
        return (
            "held_start",
            [self.names.held_for_later(task_id), self.names.cancel_id(task_id)],
            [],
        )

    def cancel_key(self, task: str, cancel: KeyCancel, *, ttl: float) -> int:
        """Cancel the calls of ``task`` that ``cancel`` covers for ``ttl`` seconds; the
        number of the task's live key cancels. Raises StoreUnavailable."""
        ttl_ms = max(1, round(ttl * 1000))
        self._call("cancel_mark", [self.names.cancels], [KEY_FIELD_PREFIX + task, ttl_ms])
        notice = cancel_notice(self.names.cancels, "key", ttl_ms, f"{task}\n{cancel.member}")
        return int(
            self._call(
                "cancel_key",
                [self.names.cancel_keys(task)],
                [ttl_ms, cancel.member, self.names.notice_channel, notice],
            )
        )

    def is_cancelled(self, task_id: str) -> bool:
        return bool(self._call("cancel_check", [self.names.cancel_id(task_id)], []))

    def check_call(self, task_id: str) -> tuple[str, list[str], list[Any]]:
        """``cancel_check``'s script, keys and arguments, for a pipelined channel."""
        return "cancel_check", [self.names.cancel_id(task_id)], []

    def _read(self, key: str) -> list[tuple[str, int, float]]:
        """``(name, until ms, seconds left)`` of each live field or member of ``key``."""
        reply = self._call("cancel_read", [key], [])
        now_ms = int(reply[0])
        rest = reply[1:]
        read = []
        for i in range(0, len(rest), 2):
            until_ms = int(float(rest[i + 1]))
            read.append((_text(rest[i]), until_ms, (until_ms - now_ms) / 1000))
        return read

    def marker(self) -> dict[str, tuple[int, float]]:
        """The marker's live fields: field -> (until ms on the store's clock, seconds left)."""
        return {name: (until_ms, left) for name, until_ms, left in self._read(self.names.cancels)}

    def key_cancels(self, task: str) -> list[tuple[KeyCancel, float]]:
        """``task``'s live key cancels with their seconds left."""
        return [
            (KeyCancel.from_member(member), left)
            for member, _, left in self._read(self.names.cancel_keys(task))
        ]

    def key_cancel_covering(
        self,
        task: str,
        fun: Callable[..., Any] | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        sent_ms: int | None,
    ) -> KeyCancel | None:
        """The live key cancel of ``task`` in the store that covers this call, or None:
        asked where a call starts late, when its worker may not have learned of a cancel
        made meanwhile (one read; raises StoreUnavailable)."""
        live = [cancel for cancel, _ in self.key_cancels(task)]
        return covering(task, live, {}, fun, args, kwargs, sent_ms) if live else None


@dataclass
class _TaskKeys:
    cancels: dict[KeyCancel, float] = field(default_factory=dict)  # -> monotonic end
    specs: dict[tuple[str, ...], KeySpec] = field(default_factory=dict)


class CancelWatch:
    """What one worker knows of the cancels: until when cancels by id live (then every
    delivery is checked against the store), each task's live key cancels (matched
    here), and the ids it was told of (a held delivery is dropped at its next turn).

    Learned from the marker (:meth:`refresh`) and from notices (:meth:`notice`), both
    on other threads than the consumer's: a lock guards the state.
    """

    def __init__(self, cancels: Cancels, *, keep_noticed: float) -> None:
        self.cancels = cancels
        self.keep_noticed = keep_noticed
        self._lock = threading.Lock()
        self._ids_until = 0.0
        self._marker_keys: dict[str, int] = {}  # task -> its marker field's until (ms), as read
        self._keys: dict[str, _TaskKeys] = {}
        self._noticed: dict[str, float] = {}  # task id -> monotonic end
        #: Whether the marker was ever read: until then, whether cancels by id live is
        #: not known (a worker started while the store was down), so every delivery is
        #: checked (the check of a store still down fails: admitted, and logged).
        self._marker_read = False

    # -- learning ---------------------------------------------------------------------

    def refresh(self) -> list[str]:
        """Read the marker, and the key cancels of a task whose field changed: the names
        of those tasks (their key cancels read anew). Raises StoreUnavailable."""
        fields = self.cancels.marker()
        now = time.monotonic()
        with self._lock:
            self._ids_until = max(self._ids_until, now + fields.get(ID_FIELD, (0, 0.0))[1])
            self._marker_read = True
        stale = []
        for name, (until_ms, _) in fields.items():
            if not name.startswith(KEY_FIELD_PREFIX):
                continue
            task = name[len(KEY_FIELD_PREFIX) :]
            # A new cancel of the task moved its field: read its key cancels again.
            if self._marker_keys.get(task) != until_ms:
                stale.append((task, until_ms))
        for task, until in stale:
            live = self.cancels.key_cancels(task)
            with self._lock:
                keys = self._keys.setdefault(task, _TaskKeys())
                for cancel, left in live:
                    keys.cancels[cancel] = max(keys.cancels.get(cancel, 0.0), now + left)
            self._marker_keys[task] = until
        return [task for task, _ in stale]

    def notice(self, notice: Notice) -> None:
        now = time.monotonic()
        with self._lock:
            if notice.kind == ID_FIELD:
                self._ids_until = max(self._ids_until, now + notice.ttl)
                self._noticed[notice.task_id] = now + min(notice.ttl, self.keep_noticed)
                if len(self._noticed) > NOTICED_MAX:
                    self._forget_noticed(now)
            elif notice.cancel is not None:
                keys = self._keys.setdefault(notice.task, _TaskKeys())
                keys.cancels[notice.cancel] = max(
                    keys.cancels.get(notice.cancel, 0.0), now + notice.ttl
                )

    def _forget_noticed(self, now: float) -> None:
        """Bound the ids remembered from notices: the expired go, then the oldest half.
        Safe: a delivery of a forgotten id is still found by the store check; only its
        drop at the notice is lost."""
        live = {k: end for k, end in self._noticed.items() if end > now}
        if len(live) > NOTICED_MAX:
            kept = sorted(live.items(), key=lambda item: item[1])[len(live) // 2 :]
            live = dict(kept)
        self._noticed = live

    # -- asking -----------------------------------------------------------------------

    def ids_live(self) -> bool:
        """Whether a delivery must be checked against the store (cancels by id live, or
        the marker was never read)."""
        return not self._marker_read or time.monotonic() < self._ids_until

    def has_key_cancels(self, task: str) -> bool:
        """Whether ``task`` may have live key cancels (a dict lookup: every delivery)."""
        return task in self._keys

    def key_cancel_end(self, task: str, cancel: KeyCancel) -> float:
        """Until when (``time.monotonic()``) ``task``'s key cancel ``cancel`` lives; 0.0
        when it is not known here."""
        keys = self._keys.get(task)
        if keys is None:
            return 0.0
        with self._lock:
            return keys.cancels.get(cancel, 0.0)

    def noticed(self, task_id: str) -> bool:
        """Whether this worker was told that ``task_id`` is cancelled (lately)."""
        end = self._noticed.get(task_id)
        return end is not None and time.monotonic() < end

    def key_cancelled(
        self,
        task: str,
        fun: Callable[..., Any] | None,
        args: Sequence[Any],
        kwargs: Mapping[str, Any],
        sent_ms: int | None,
        *,
        only: KeyCancel | None = None,
    ) -> KeyCancel | None:
        """The live key cancel that covers this call of ``task`` (``fun``: its function,
        to bind the arguments to; None: kwargs only), or None. A key whose arguments the
        call does not bind covers nothing. ``only``: that cancel alone is matched (one
        just learned, against the calls held)."""
        keys = self._keys.get(task)
        if keys is None:
            return None
        now = time.monotonic()
        with self._lock:
            live = [c for c, end in keys.cancels.items() if end > now]
            for gone in [c for c, end in keys.cancels.items() if end <= now]:
                del keys.cancels[gone]
        if only is not None:
            live = [only] if only in live else []
        return covering(task, live, keys.specs, fun, args, kwargs, sent_ms)


def covering(
    task: str,
    cancels: Sequence[KeyCancel],
    specs: dict[tuple[str, ...], KeySpec],
    fun: Callable[..., Any] | None,
    args: Sequence[Any],
    kwargs: Mapping[str, Any],
    sent_ms: int | None,
) -> KeyCancel | None:
    """The first of ``cancels`` (key cancels of ``task``) that covers this call, or None
    (``specs``: the key specs built so far, by argument names, added to here)."""
    for cancel in cancels:
        if sent_ms is not None and sent_ms > cancel.cut_ms:
            continue
        names = cancel.names
        spec = specs.get(names)
        if spec is None:
            try:
                spec = KeySpec.build(list(names), fun or _any_kwargs, subject=task)
            except KeySpecError as exc:
                logger.warning("a cancel of %s names no argument of it: %s", task, exc)
                continue
            specs[names] = spec
        try:
            material = spec.material(args, kwargs)
        except KeySpecError:
            continue
        if cancel.covers(sent_ms, material):
            return cancel
    return None


def _any_kwargs(**kwargs: Any) -> None:
    """The signature of a task whose function is unknown: its arguments by name only."""
