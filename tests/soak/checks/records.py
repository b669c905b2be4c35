"""The history's records read back: the observer's entries as runs (:class:`Run`), and
what the workers' logs say (received, lost leases, handed to the broker, why a worker died)."""

from __future__ import annotations

import re
from collections import defaultdict
from collections.abc import Iterable
from datetime import datetime
from typing import Any

from tests.soak.checks.history import SECOND, Run


def merge_runs(started: Iterable[dict[str, Any]], finished: Iterable[dict[str, Any]]) -> list[Run]:
    """One :class:`Run` per start entry of the observer, with its end if it finished."""
    ends: dict[tuple[str, str, int, int], list[int]] = defaultdict(list)
    for entry in finished:
        ends[_identity(entry)].append(int(entry["end"]))
    runs = []
    for entry in started:
        found = ends.get(_identity(entry))
        end = found.pop(0) if found else None
        fence = entry.get("fence")
        runs.append(
            Run(
                key=str(entry["key"]),
                task_id=str(entry.get("task_id") or ""),
                start=int(entry["start"]),
                end=end,
                fence=int(fence) if fence is not None else None,
                pid=int(entry.get("pid") or 0),
            )
        )
    return runs


def _identity(entry: dict[str, Any]) -> tuple[str, str, int, int]:
    return (str(entry["key"]), str(entry.get("task_id") or ""), int(entry["start"]), entry["pid"])


_LOST = re.compile(r"lost its lease \S+ \(owner ([^|\s)]+)|lease lost: \S+ held by ([^|\s]+)\|")


_RECEIVED = re.compile(r"\] Task [\w.]+\[([0-9a-f-]{36})\] received$", re.M)


def received_task_ids(log_text: str) -> set[str]:
    """Task ids a worker's log says it received (Celery's INFO line, logged before any
    of celery-baton's consumer code sees the message)."""
    return set(_RECEIVED.findall(log_text))


def received_moments(log_text: str) -> dict[str, list[int]]:
    """Each task id's moments a worker's log says it received it (us since the epoch,
    local clock): celery-baton screens a plain delivery for a cancel right after."""
    found: dict[str, list[int]] = defaultdict(list)
    for stamp, text in _LOG_AT.findall(log_text):
        received = _RECEIVED_TEXT.match(text)
        if received:
            at = datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp()
            found[received.group(1)].append(int(at * SECOND))
    return dict(found)


_RECEIVED_TEXT = re.compile(r"Task [\w.]+\[([0-9a-f-]{36})\] received$")
_UNCHECKED = re.compile(
    r"could not check whether [\w.]+\[([0-9a-f-]{36})\] is cancelled"
    r"|[\w.]+\[([0-9a-f-]{36})\]: asking about a cancel failed"
)


def unchecked_cancel_ids(log_text: str) -> set[str]:
    """Task ids a worker's log says it admitted (or started) without knowing whether
    they were cancelled: the store did not answer (documented: it runs then)."""
    return {a or b for a, b in _UNCHECKED.findall(log_text)}


_LOG_AT = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): [^\]]*\] (.*)$", re.M)
_HANDED = re.compile(r"\[([0-9a-f-]{36})\] handed back to the broker")
_PUT_BACK = re.compile(
    r"(?:held messages put back in their queues|held requests handed back to the broker, "
    r"for every worker)[^:]*?\): (.*)$"
)
_NAMED = re.compile(r"\[([0-9a-f-]{36})\]")


def broker_moments(log_text: str) -> dict[str, tuple[int, bool]]:
    """Each task id's last moment in a worker's log (us since the epoch, local clock),
    and whether it was handed to the broker then (handed back, or put back after a
    reconnect, or past its window at the end of a store-wide hold) rather than received
    or worked on."""
    last: dict[str, tuple[int, bool]] = {}
    for stamp, text in _LOG_AT.findall(log_text):
        at = int(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * SECOND)
        put_back = _PUT_BACK.search(text)
        if put_back:
            for task_id in put_back.group(1).split(", "):
                last[task_id] = (at, True)
            continue
        handed = _HANDED.search(text)
        for task_id in _NAMED.findall(text):
            last[task_id] = (at, bool(handed) and task_id == handed.group(1))
    return last


def lost_lease_task_ids(log_text: str) -> set[str]:
    """Task ids whose lease a worker's log says was lost (celery_baton's ERROR lines)."""
    return {a or b for a, b in _LOST.findall(log_text)}


_LOGGED = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): (CRITICAL|ERROR)/MainProcess\] (.*)$", re.M
)
_EXCEPTION = re.compile(r"^(\w+(?:\.\w+)*(?:Error|Exception)\b.*)$", re.M)


def crash_reason(log_text: str) -> tuple[str, float | None]:
    """Why a worker's main process died, from its log: Celery's ``Unrecoverable error``
    line (else its last CRITICAL line, else the last exception line) and, when the line
    has one, its time (seconds since the epoch, the worker's local clock)."""
    logged = _LOGGED.findall(log_text)
    chosen = next((e for e in reversed(logged) if "Unrecoverable error" in e[2]), None)
    chosen = chosen or next((e for e in reversed(logged) if e[1] == "CRITICAL"), None)
    if chosen is not None:
        at = datetime.strptime(chosen[0], "%Y-%m-%d %H:%M:%S,%f").timestamp()
        return chosen[2].strip()[:300], at
    found = _EXCEPTION.findall(log_text)
    return (found[-1].strip()[:300] if found else ""), None


_ORDER_SKIP = re.compile(
    r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}): \w+/MainProcess\] baton: ordered key (.+?) of "
    r"\S+ skipped position (\d+(?:-\d+)?): its call did not come",
    re.M,
)
_ORDER_LOST = re.compile(
    r"\[([0-9a-f-]{36})\] of ordered key .+? was placed under an order record the store no "
    r"longer has"
)


def ordered_log_notes(log_text: str) -> tuple[list[tuple[str, str, int]], set[str]]:
    """What a worker's log says of ordered keys: each gap skip (the key as logged, the
    positions skipped, when: us since the epoch, local clock) and the task ids placed
    under an order record the store lost."""
    skips = [
        (label, where, int(datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S,%f").timestamp() * SECOND))
        for stamp, label, where in _ORDER_SKIP.findall(log_text)
    ]
    return skips, set(_ORDER_LOST.findall(log_text))
