"""The checks of ordered keys and batches (each a function named ``check_*``):

* ``ordered`` -- per key of the ``inorder`` task (ordered="key"), the calls' runs start
  in publish order (the sequence number the one publisher thread gave each call of the
  key), never overlap, and each call runs to its end exactly once. What the guarantee
  (docs/guides/ordered.md) allows, and the check accepts only with its evidence:

  - a call whose position the gap bound skipped is *refused* if it comes: a
    ``task_skipped`` of reason ``out-of-order``, a ``TaskSkipped`` result, a worker's
    log line naming the key's skip before the refusal, and neither that line nor a
    later call of the key started sooner than ``ordered_gap_timeout`` after the first
    missing position before it became next (see :func:`_judge_refusal`);
  - a call whose message never reached a worker (kombu's Redis transport window around
    a SIGKILL: ``lost-in-transport``) never runs; its key goes on after the gap bound;
  - a run killed (``acks_late``) runs again, before the key's next call; a run whose
    process was killed right after its body ended (before its end was recorded) may run
    again (known window ``ordered-killed-after-body``);
  - an overlap when the earlier run's lease may have run out (a store outage of half a
    ``lease_ttl``, or its worker logged the loss: known window ``ordered-lease-lost``,
    as for ``exclusive``); an inversion of a call a worker logged as placed under an
    order record the store no longer had (known window ``ordered-record-lost``).

* ``batched`` -- every call of the ``batched`` task (batch="key") ends in exactly one
  successful batch run of its own key, and its caller's result is its own
  (``<key>:<n>:<id>``). Allowed (docs/guides/batching.md), with the evidence: a call
  lost in kombu's transport window never runs; a call whose batch's process was killed
  right after the body ended, before the calls were marked done, or whose runner's
  lease may have run out (a store outage), may run in a second batch (known window
  ``batched-twice``).

Messages name the key, the call's sequence number (``seq``) or number (``n``), its task
id and the runs concerned.
"""

from __future__ import annotations

import itertools
import json
from collections import defaultdict
from dataclasses import dataclass

from tests.soak.checks.accounting import KILL_SLACK, _lost_in_transport
from tests.soak.checks.history import (
    KILLS,
    SECOND,
    STORE_OUTAGES,
    History,
    Published,
    Report,
    Skip,
)
from tests.soak.checks.spans import _by_key, _describe, _lease_may_be_lost, _overlaps, _Span

ORDERED = "inorder"
BATCHED = "batched"
#: The publish kinds these checks account for (the accounting check leaves them here).
JUDGED_HERE = (ORDERED, BATCHED)
#: Seconds of slack on the gap bound (clocks: the store's and the observer's, one host).
GAP_SLACK = 2.0
#: Seconds after a run's body ended within which a kill of its process may have cut
#: the library's record of its end (an ordered call's end, a batch's done marks and
#: results: a few store and backend round trips, on a loaded machine).
AFTER_BODY = 1.0


@dataclass(frozen=True)
class _Call:
    key: str
    number: int  # seq (ordered) or n (batched)
    pub: Published

    @property
    def task_id(self) -> str:
        return self.pub.task_id


def _calls(history: History, task: str, number: str, failed: bool = False) -> dict[str, _Call]:
    """The sent calls of ``task`` (and, with ``failed``, those whose publish raised:
    some were sent after all, an ordered one with its place): task id -> key and
    number, from the publish's detail (``key=p seq=3`` / ``key=x n=17``)."""
    calls = {}
    for pub in history.published:
        if pub.task != task or pub.outcome not in (("sent", "failed") if failed else ("sent",)):
            continue
        fields = dict(part.split("=", 1) for part in pub.detail.split()[:2] if "=" in part)
        calls[pub.task_id] = _Call(fields["key"], int(fields[number]), pub)
    return calls


def _killed_after_body(history: History, span: _Span) -> str:
    """Why ``span`` (it ended) may not have been recorded as ended by the library: its
    process was killed within AFTER_BODY of its body's end ('' if not)."""
    end = span.run.end
    assert end is not None
    for fault in history.faults:
        if fault.kind not in KILLS or span.run.pid not in fault.pids:
            continue
        if end - int(KILL_SLACK * SECOND) <= fault.start <= end + int(AFTER_BODY * SECOND):
            return (
                f"its process was killed ({fault.kind}) {(fault.start - end) / SECOND:+.3f} s "
                "after its body ended"
            )
    return ""


def _twice_why(history: History, first: _Span, second: _Span) -> str:
    """Why a call may run to its end in ``first`` and again in ``second`` ('')."""
    why = _killed_after_body(history, first) or _lease_may_be_lost(history, first, second.run.start)
    if why:
        return why
    assert first.run.end is not None
    threshold = int(history.limits.lease_ttl * SECOND / 2)
    for fault in history.faults:
        if (
            fault.kind in STORE_OUTAGES
            and fault.length >= threshold
            and first.run.end - int(KILL_SLACK * SECOND) <= fault.start <= second.run.start
        ):
            return f"{fault.kind} of {fault.length / SECOND:.1f} s right after it ran"
    return ""


def _names(label: str, key: str) -> bool:
    """Whether a worker's log line's key label (the key's material, ``{"key":"p"}``, or
    the key in words, ``inorder(key='p')``) names ordered ``key``."""
    if label == f"{ORDERED}(key={key!r})":
        return True
    try:
        return bool(json.loads(label) == {"key": key})
    except ValueError:
        return False


def _name(call: _Call, what: str = "seq") -> str:
    return f"{what} {call.number} ({call.task_id})"


# -- ordered --------------------------------------------------------------------------


def check_ordered(history: History, spans: list[_Span], report: Report) -> None:
    calls = _calls(history, ORDERED, "seq", failed=True)
    groups = _by_key(spans, (f"{ORDERED}:",))
    refusals = {
        s.task_id: s
        for s in history.skips
        if s.reason == "out-of-order" and s.task.endswith(f".{ORDERED}")
    }
    keys = sorted({c.key for c in calls.values()} | {k.split(":", 1)[1] for k in groups})
    for key in keys:
        group = groups.get(f"{ORDERED}:{key}", [])
        mine = sorted((c for c in calls.values() if c.key == key), key=lambda c: c.pub.at)
        _ordered_key(history, key, mine, group, calls, refusals, report)
    report.counts["ordered calls"] = sum(1 for c in calls.values() if c.pub.outcome == "sent")
    report.counts["ordered refused (gap bound)"] = sum(1 for t in refusals if t in calls)


def _ordered_key(
    history: History,
    key: str,
    mine: list[_Call],
    group: list[_Span],
    calls: dict[str, _Call],
    refusals: dict[str, Skip],
    report: Report,
) -> None:
    found = report.violations["ordered"]
    ours = []
    for span in group:
        call = calls.get(span.run.task_id)
        if call is None or call.key != key:
            found.append(
                f"key {key!r}: a run of a call not published for this key: {_describe(span)}"
            )
        else:
            ours.append((span, call))
    for earlier, later in _overlaps([s for s, _ in ours]):
        a, b = calls[earlier.run.task_id], calls[later.run.task_id]
        what = (
            f"key {key!r}: {_name(a)} [{earlier.run.start}, {earlier.end}) overlaps "
            f"{_name(b)} [{later.run.start}, {later.end})"
        )
        why = _lease_may_be_lost(history, earlier, later.run.start) if a is not b else ""
        if why:
            report.known["ordered-lease-lost"].append(f"{what}: {why}")
        else:
            found.append(what + (" (one call twice at once)" if a is b else ""))
    top: tuple[_Span, _Call] | None = None
    for span, call in ours:
        if top is not None and call.number < top[1].number:
            what = (
                f"key {key!r}: {_name(call)} started at {span.run.start}, after "
                f"{_name(top[1])} started at {top[0].run.start} (publish order inverted)"
            )
            if call.task_id in history.order_lost:
                report.known["ordered-record-lost"].append(
                    f"{what}: placed under an order record the store no longer had"
                )
            else:
                found.append(what)
        if top is None or call.number > top[1].number:
            top = (span, call)
    runs_of: dict[str, list[_Span]] = defaultdict(list)
    for span, call in ours:
        runs_of[call.task_id].append(span)
    for call in mine:
        _ordered_call(history, key, call, runs_of[call.task_id], ours, mine, refusals, report)


def _ordered_call(
    history: History,
    key: str,
    call: _Call,
    runs: list[_Span],
    ours: list[tuple[_Span, _Call]],
    mine: list[_Call],
    refusals: dict[str, Skip],
    report: Report,
) -> None:
    found = report.violations["ordered"]
    ended = [s for s in runs if not s.killed]
    for first, again in itertools.pairwise(ended):
        what = (
            f"key {key!r}: {_name(call)} ran to its end twice: [{first.run.start}, "
            f"{first.end}) pid {first.run.pid} and [{again.run.start}, {again.end}) pid "
            f"{again.run.pid}"
        )
        why = _killed_after_body(history, first)
        if why:
            report.known["ordered-killed-after-body"].append(f"{what}: {why}")
        else:
            found.append(what)
    result = history.results.get(call.task_id, "")
    if call.task_id in refusals:
        _judge_refusal(history, key, call, runs, ours, mine, refusals[call.task_id], report)
        return
    if ended:
        value = history.values.get(call.task_id)
        if result == "SUCCESS" and value == call.number:
            return
        what = (
            f"key {key!r}: {_name(call)} ran, but its result is {result or 'missing'} ({value!r})"
        )
        why = _killed_after_body(history, ended[-1])
        if not result and why:
            report.known["ordered-result-lost-in-kill"].append(f"{what}: {why}")
        else:
            found.append(what)
        return
    if call.pub.outcome == "failed":
        return  # its publish raised: it need not run (it ran in order if it did)
    fault = None if result else _lost_in_transport(history, call.pub)
    if fault is not None and not runs:
        report.known["ordered-lost-in-transport"].append(
            f"key {key!r}: {_name(call)} published at {call.pub.at}, "
            f"{(fault.start - call.pub.at) / SECOND:+.3f} s from a {fault.kind}, never received"
        )
        return
    killed = "; ".join(_describe(s) for s in runs)
    found.append(
        f"key {key!r}: {_name(call)} published at {call.pub.at} never ran to its end and was "
        f"not refused (result: {result or 'none'}{'; killed runs: ' + killed if killed else ''})"
    )


def _judge_refusal(
    history: History,
    key: str,
    call: _Call,
    runs: list[_Span],
    ours: list[tuple[_Span, _Call]],
    mine: list[_Call],
    refusal: Skip,
    report: Report,
) -> None:
    """A call refused as out of order: judged against what the gap bound allows.

    The bound skips the key's next position once it has not run for
    ``ordered_gap_timeout`` (since it became next, or its last lease ran out), and with
    it every later position up to the first call that waits: so the refused call's own
    position need not have waited the bound, the first missing one before it must.
    That one became next no sooner than the end of the last run before it (of an
    earlier call, or of this call's own killed run) and the publish of the first call
    after that run: a lower bound, so the bound is never judged undercut by a guess.
    """
    at = refusal.at
    found = report.violations["ordered"]
    what = f"key {key!r}: {_name(call)} refused at {at} (its position skipped by the gap bound)"
    result = history.results.get(call.task_id, "")
    if result != "FAILURE:TaskSkipped" and not any(not s.killed for s in runs):
        found.append(f"{what}, but its result is {result or 'missing'} (expected TaskSkipped)")
    slack = int(GAP_SLACK * SECOND)
    # A time of 0: a history from before the skips' times were recorded (not judged).
    skipped_at = [
        t for label, _, t in history.order_skips if _names(label, key) and t <= at + slack
    ]
    if not skipped_at:
        found.append(f"{what}, but no worker logged a gap skip of key {key!r} before")
    before = [(s, c) for s, c in ours if c.number < call.number and s.run.start < at]
    before += [(s, call) for s in runs if s.run.start < at]
    last_ran = max((c.number for _, c in before), default=0)
    ended = max((s.end for s, _ in before), default=0)
    first = min((c for c in mine if c.number > last_ran), key=lambda c: c.number, default=call)
    if any(c is call for _, c in before):
        first = call  # its own run was the key's: its position was next then
    became_next = max(ended, first.pub.at)
    gap = history.limits.ordered_gap
    bound = became_next + int(gap * SECOND) - slack
    since = f"{_name(first)} became next (at the latest {became_next})"
    later = [(s, c) for s, c in ours if c.number > call.number and s.run.start <= at]
    if later:
        span, successor = min(later, key=lambda sc: sc[0].run.start)
        if span.run.start < bound:
            found.append(
                f"{what}: {_name(successor)} started {(span.run.start - became_next) / SECOND:.1f}"
                f" s after {since}, within ordered_gap_timeout {gap:g} s"
            )
            return
    if skipped_at and max(skipped_at) > 0:
        latest = max(skipped_at)
        if latest < bound:
            found.append(
                f"{what}: the key's latest gap skip before it was logged "
                f"{(latest - became_next) / SECOND:.1f} s after {since}, within "
                f"ordered_gap_timeout {gap:g} s"
            )
            return
        report.known["ordered-refused"].append(
            f"{what}: the key's gap skip was logged {(latest - became_next) / SECOND:.1f} s "
            f"after {since} (ordered_gap_timeout {gap:g} s)"
        )


# -- batched --------------------------------------------------------------------------


def check_batched(history: History, spans: list[_Span], report: Report) -> None:
    calls = _calls(history, BATCHED, "n")
    failed = {p.task_id for p in history.published if p.task == BATCHED and p.outcome == "failed"}
    found = report.violations["batched"]
    runs_of: dict[str, list[_Span]] = defaultdict(list)
    sizes = []
    for span in sorted(spans, key=lambda s: s.run.start):
        if not span.run.key.startswith(f"{BATCHED}:"):
            continue
        keys = span.run.key.split(":", 1)[1].split("|")
        ids = span.run.task_id.split(",")
        sizes.append(len(ids))
        if len(keys) != 1:
            found.append(f"a batch run mixed keys {keys}: {_describe(span)}")
        if len(set(ids)) != len(ids):
            found.append(f"a batch run holds one call twice: {_describe(span)}")
        for task_id in dict.fromkeys(ids):
            call = calls.get(task_id)
            if call is None:
                if task_id in failed:  # sent after all, though its publish raised
                    report.counts["batched ran despite a failed publish"] = (
                        report.counts.get("batched ran despite a failed publish", 0) + 1
                    )
                else:
                    found.append(f"a batch ran call {task_id}, never published: {_describe(span)}")
                continue
            if keys != [call.key]:
                found.append(
                    f"key {call.key!r}: {_name(call, 'n')} ran in a batch of {keys}: "
                    f"{_describe(span)}"
                )
            runs_of[task_id].append(span)
    for call in sorted(calls.values(), key=lambda c: c.pub.at):
        _batched_call(history, call, runs_of[call.task_id], report)
    report.counts["batched calls"] = len(calls)
    report.counts["batch runs"] = len(sizes)
    if sizes:
        report.counts["batch mean size x10"] = round(10 * sum(sizes) / len(sizes))


def _batched_call(history: History, call: _Call, runs: list[_Span], report: Report) -> None:
    found = report.violations["batched"]
    name = f"key {call.key!r}: {_name(call, 'n')}"
    ended = [s for s in runs if not s.killed]
    for first, again in itertools.pairwise(ended):
        what = f"{name} ran in two successful batches: {_describe(first)} and {_describe(again)}"
        why = _twice_why(history, first, again)
        if why:
            report.known["batched-twice"].append(f"{what}: {why}")
        else:
            found.append(what)
    result = history.results.get(call.task_id, "")
    value = history.values.get(call.task_id)
    if ended:
        expected = f"{call.key}:{call.number}:{call.task_id}"
        if result == "SUCCESS" and value == expected:
            return
        what = (
            f"{name} ran, but its caller got {result or 'no result'} ({value!r}, not {expected!r})"
        )
        why = _killed_after_body(history, ended[-1])
        if not result and why:
            report.known["batched-result-lost-in-kill"].append(f"{what}: {why}")
        else:
            found.append(what)
        return
    fault = None if result else _lost_in_transport(history, call.pub)
    if fault is not None and not runs:
        report.known["batched-lost-in-transport"].append(
            f"{name} published at {call.pub.at}, {(fault.start - call.pub.at) / SECOND:+.3f} s "
            f"from a {fault.kind}, never received"
        )
        return
    killed = "; ".join(_describe(s) for s in runs)
    found.append(
        f"{name} published at {call.pub.at} ended in no successful batch (result: "
        f"{result or 'none'}{'; killed runs: ' + killed if killed else ''})"
    )
