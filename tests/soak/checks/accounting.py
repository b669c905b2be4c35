"""The ``accounting`` check: every published id ran, or is accounted for: a skip recorded
by the worker with the reason (a skipped exclusive duplicate also has its ``TaskSkipped``
result), a deduplicated publish (``TaskDeduplicated`` result, against a holder that was
really queued or running), or an expiry (``REVOKED``). A skip must name a holder that was
really running. Ordered and batched calls are accounted for by their own checks
(:mod:`tests.soak.checks.keyed`), and cancelled ones by theirs
(:mod:`tests.soak.checks.cancels`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence

from tests.soak.checks.history import (
    BROKER_OUTAGES,
    SECOND,
    Fault,
    History,
    Published,
    Report,
    Skip,
)
from tests.soak.checks.spans import (
    _ack_due,
    _death_right_after,
    _describe,
    _outages_until,
    _release_due,
    _Span,
)

#: Publish kinds judged by checks of their own: ordered calls and batched calls
#: (tests.soak.checks.keyed), whose runs and refusals those checks account for, and the
#: calls of the ``cancelled`` kind (tests.soak.checks.cancels), REVOKED when cancelled.
JUDGED_APART = ("inorder", "batched", "cancelled", "cancelled_rated")

#: Seconds around a worker's SIGKILL in which a message it was taking off the queue
#: may be lost by kombu's Redis transport (see ``lost-in-transport``).
TRANSPORT_WINDOW = 0.25


#: Seconds within which a message a worker handed back to the broker (at the hold
#: horizon, or put back after a reconnect) is delivered again, on a loaded machine.
REDELIVERY_WINDOW = 3.0
#: Seconds a fault's recorded start may come after what it caught: it is recorded just
#: before the signal is sent, and the process dies a few milliseconds later.
KILL_SLACK = 0.5


def _lost_in_transport(history: History, pub: Published) -> Fault | None:
    """The fault that may have lost ``pub`` in kombu's Redis transport before any worker
    received it: a worker SIGKILLed as it was published (and taken off the queue), or the
    broker SIGKILLed after it was published, while it may still have been waiting in
    the queue. None if some worker logged it received (then it was ours to keep)."""
    handed = history.to_broker.get(pub.task_id)
    if handed is not None:
        # Received, then handed back to the broker and never seen again: delivered
        # anew, and exposed to the same window as a first delivery, moments later.
        return next(
            (
                f
                for f in history.faults
                if f.kind == "restart_broker"
                and -KILL_SLACK * SECOND <= f.start - handed <= REDELIVERY_WINDOW * SECOND
            ),
            None,
        )
    if history.received is not None and pub.task_id in history.received:
        return None
    window = int(TRANSPORT_WINDOW * SECOND)
    waited = int(history.limits.redelivery * SECOND)
    return next(
        (
            f
            for f in history.faults
            if (f.kind == "kill_worker" and f.start - window <= pub.at <= f.end + window)
            or (f.kind == "restart_broker" and pub.at <= f.start <= pub.at + waited)
        ),
        None,
    )


def _ran_around(spans: Sequence[_Span], since: int, at: int, slack: int, killed_slack: int) -> bool:
    """Whether one of these runs of a task id held (or was about to hold) its key at some
    instant of ``[since, at]``: queued or admitted (it starts later), or running."""
    for span in spans:
        after = killed_slack if span.killed else slack
        if (span.run.start - slack <= at and span.end + after >= since) or span.run.start > at:
            return True
    return False


def _discarded(history: History, pub: Published, holder: list[_Span]) -> bool:
    """Whether ``pub`` was deduplicated into a run killed with its worker whose copy,
    given back by the broker, was discarded (REVOKED) rather than run again."""
    last = max(holder, key=lambda s: s.end)
    later = any(s.run.start > pub.at for s in holder)
    return last.killed and not later and history.results.get(pub.into) == "REVOKED"


def _judge_late_holder(
    history: History, pub: Published, holder: list[_Span], report: Report
) -> None:
    """A publish deduplicated into a holder that was neither running nor ran again later.

    The key is the holder's until Celery is done with its message, not until its run
    ended: a run that finished while the broker was down keeps its key until its ack
    went through (the ack comes first, then the key is freed). A run killed with its
    worker keeps it until the broker gives the message back (``Limits.redelivery``),
    and the copy then runs (not this case: it ran later); but a run whose message
    expires holds its key only while it lives (renewed; lapsing within ``lease_ttl``
    of its death), since a copy given back expired is discarded (REVOKED). A publish
    deduplicated into such a holder before its claim lapsed is the known window
    "unique-expired-holder": its caller gets the holder's REVOKED result.
    """
    limits = history.limits
    slack = int(limits.slack * SECOND)
    last = max(holder, key=lambda s: s.end)
    what = (
        f"{pub.task} {pub.task_id} deduplicated at {pub.at} into {pub.into}, which was no "
        "longer queued or running: " + "; ".join(_describe(s) for s in holder)
    )
    if not last.killed:
        if pub.at <= max(_ack_due(history, last.end), _release_due(history, last.end)) + slack:
            report.counts["dedup while the holder's ack waited"] = (
                report.counts.get("dedup while the holder's ack waited", 0) + 1
            )
            return
        # A restart fails the ack; so does a pause longer than the client's socket
        # timeout (seed 993991265: a 7.1 s pause, "Couldn't ack", the claim kept).
        failed_ack = limits.broker_socket_timeout * SECOND
        restarted = any(
            (
                f.kind == "restart_broker"
                or (f.kind == "pause_broker" and f.end - f.start > failed_ack)
            )
            and f.start <= last.end + slack
            and f.end >= last.end - slack
            for f in history.faults
        )
        if not restarted:  # its ack went through, at once or when a paused broker answered
            report.violations["accounting"].append(what)
            return
        # It ended as the broker was restarted: its ack failed, and its claim was kept for
        # the copy the broker gives back (worker/releasing.py, for the redelivery
        # window): its message is still the broker's. The copy ran (another span: not
        # this case), or came back expired and was discarded, which freed the key; the
        # duplicate's caller has the run's result (or REVOKED): the known window, as for
        # a killed run's message.
        # The copy comes back within the redelivery window, pushed back by every broker
        # outage inside it (a paused or restarted broker restores nothing), as for a
        # killed run's message below (the 25-minute soak, seed 263512648: a 7.8 s pause
        # 18 s after the failed ack).
        back_by = _outages_until(
            history, BROKER_OUTAGES, last.end, last.end + int(limits.redelivery * SECOND)
        )
        if pub.at > back_by + slack:
            report.violations["accounting"].append(
                f"{what} (later than the redelivery window after its failed ack, at {back_by})"
            )
        else:
            report.known["unique-expired-holder"].append(
                f"{what}; its ack met a broker outage: its claim was kept for the copy, "
                "which came back expired and was discarded"
            )
        return
    result = history.results.get(pub.into, "")
    if last.run.end is not None and result.startswith(("SUCCESS", "FAILURE")):
        death = _death_right_after(history, last.run)
        if death is not None:
            # Finished and acked (its message never came back: it did not run again),
            # but its worker died before the claim's release went out (docs/soak.md).
            report.known["unique-claim-after-ack"].append(
                f"{what}; its worker died {(death.start - last.run.end) / SECOND:.3f} s after"
                f" the run ended ({death.kind}), after its ack, before its claim's release"
            )
            return
    sent = next((p for p in history.published if p.task_id == pub.into), None)
    if sent is not None and "expires=" in sent.detail:
        # Its run held the claim while it lived: lost with its worker, the claim lapsed
        # within lease_ttl (the message's expiry is shorter in the soak).
        back_by = last.end + int(limits.lease_ttl * SECOND)
        how = f"{limits.lease_ttl:g} s (lease_ttl) after its run was killed"
    else:
        back_by = _outages_until(
            history, BROKER_OUTAGES, last.end, last.end + int(limits.redelivery * SECOND)
        )
        how = "the broker gave its message back"
    if pub.at > back_by + slack:
        report.violations["accounting"].append(f"{what} (later than {how}, at {back_by})")
    elif result == "REVOKED":
        report.known["unique-expired-holder"].append(
            f"{what}; its copy came back expired and was discarded (REVOKED)"
        )
    elif result == "" or pub.at > last.end + int((limits.lease_ttl + limits.slack) * SECOND):
        report.violations["accounting"].append(f"{what} (its result is {result or 'missing'})")


def check_accounting(history: History, spans: list[_Span], report: Report) -> None:
    limits = history.limits
    slack = int(limits.slack * SECOND)
    # A killed worker's leases and claims live on until lease_ttl.
    killed_slack = int((limits.lease_ttl + limits.slack) * SECOND)
    by_id: dict[str, list[_Span]] = defaultdict(list)
    for span in spans:
        by_id[span.run.task_id].append(span)
    # A batch run's task id is its calls' ids, joined by commas.
    ran = {t for r in history.runs for t in r.task_id.split(",")}
    skips: dict[str, list[Skip]] = defaultdict(list)
    for skip in history.skips:
        skips[skip.task_id].append(skip)
    published = {p.task_id: p for p in history.published if p.outcome == "sent"}
    sent_at: dict[str, int] = {}
    for pub in history.published:
        if pub.outcome == "sent":
            sent_at.setdefault(pub.task_id, pub.at)
    outcomes: dict[str, int] = defaultdict(int)
    for pub in history.published:
        outcomes[pub.outcome] += 1
        if pub.outcome == "failed" or pub.task in JUDGED_APART:
            continue
        if pub.outcome == "deduplicated":
            result = history.results.get(pub.task_id, "")
            if result != "FAILURE:TaskDeduplicated":
                report.violations["accounting"].append(
                    f"{pub.task} {pub.task_id} deduplicated into {pub.into} but its result is "
                    f"{result or 'missing'} (expected a TaskDeduplicated failure)"
                )
            holder = by_id.get(pub.into, [])
            if pub.into not in published and not holder:
                tried = next((p for p in history.published if p.task_id == pub.into), None)
                how = (
                    f"whose publish failed ({tried.detail.strip()})" if tried else "never published"
                )
                report.violations["accounting"].append(
                    f"{pub.task} {pub.task_id} deduplicated at {pub.at} into {pub.into}, {how}, "
                    "which never ran"
                )
            elif holder and (
                _discarded(history, pub, holder)
                or not _ran_around(holder, pub.at, pub.at, slack, killed_slack)
            ):
                _judge_late_holder(history, pub, holder, report)
            continue
        if pub.task_id in ran:
            continue
        found = skips.get(pub.task_id)
        if found:
            continue  # each skip is judged below
        if history.results.get(pub.task_id, "").startswith("REVOKED"):
            report.known["expired"].append(f"{pub.task} {pub.task_id}: expired before it ran")
            continue
        fault = None if history.results.get(pub.task_id) else _lost_in_transport(history, pub)
        if fault is not None:
            # kombu's Redis transport takes a message off the queue (BRPOP) and only then
            # records it as unacked (HSET), before Celery sees it: a worker SIGKILLed
            # between the two, or a broker SIGKILLed after the first (its reply, or the
            # record, lost), loses it before Celery or celery-baton saw it. Not ours to
            # close; RabbitMQ has no such window.
            handed = history.to_broker.get(pub.task_id)
            report.known["lost-in-transport"].append(
                f"{pub.task} {pub.task_id} handed back to the broker at {handed}, "
                f"{(fault.start - handed) / SECOND:.3f} s before a {fault.kind}, never "
                "received again (kombu Redis: BRPOP, then the unacked record)"
                if handed is not None
                else f"{pub.task} {pub.task_id} published at {pub.at}, "
                f"{(fault.start - pub.at) / SECOND:+.3f} s from a {fault.kind}, never received"
                " by any worker (kombu Redis: BRPOP, then the unacked record)"
            )
            continue
        report.violations["accounting"].append(
            f"{pub.task} {pub.task_id} published at {pub.at} never ran and is not accounted for "
            f"(result: {history.results.get(pub.task_id) or 'none'})"
        )
    for skip in history.skips:
        if skip.reason == "already-run":
            coalesced = any(other.reason == "misfire" for other in skips[skip.task_id])
            if skip.task_id not in ran and not coalesced:  # a coalesced slot is recorded done
                report.violations["accounting"].append(
                    f"{skip.task_id} skipped as already run, but it never ran"
                )
            continue
        if skip.reason == "misfire" and skip.task.endswith(".tick"):
            # A held beat slot whose entry's next slot was already due is coalesced into
            # that later slot (baton_misfire's default): accounted for when a later slot
            # of a beat entry ran.
            if any(r.key.startswith("beat:") and r.start >= skip.at - slack for r in history.runs):
                report.known["coalesced-late-slot"].append(
                    f"{skip.task} {skip.task_id} coalesced into a later slot at {skip.at}"
                )
            else:
                report.violations["accounting"].append(
                    f"{skip.task} {skip.task_id} coalesced at {skip.at}, and no later slot ran"
                )
            continue
        if skip.reason == "out-of-order" and skip.task.endswith(".inorder"):
            continue  # refused by the gap bound: judged by the ordered check
        if skip.reason != "exclusive":
            report.violations["accounting"].append(
                f"{skip.task} {skip.task_id} skipped for {skip.reason!r}"
            )
            continue
        if skip.task_id not in ran:
            result = history.results.get(skip.task_id, "")
            if result != "FAILURE:TaskSkipped":
                report.violations["accounting"].append(
                    f"{skip.task} {skip.task_id} skipped (held by {skip.holder}) but its result "
                    f"is {result or 'missing'} (expected a TaskSkipped failure)"
                )
        # A duplicate that arrived while its holder ran may be skipped later (it waits out
        # a grace, or the store was down meanwhile): judge from its publish on.
        since = min(sent_at.get(skip.task_id, skip.at), skip.at)
        holder = by_id.get(skip.holder, [])
        if holder and not _ran_around(holder, since, skip.at, slack, killed_slack):
            last = max(holder, key=lambda s: s.end)
            if not last.killed and skip.at <= _release_due(history, last.end):
                # It ended while the store was down: its lease was freed once the store
                # answered again (counted, not a violation).
                report.counts["skipped while the holder's release waited"] = (
                    report.counts.get("skipped while the holder's release waited", 0) + 1
                )
                continue
        if not holder or not _ran_around(holder, since, skip.at, slack, killed_slack):
            report.violations["accounting"].append(
                f"{skip.task} {skip.task_id} skipped at {skip.at} as held by {skip.holder}, "
                "which was not running then: "
                + ("; ".join(_describe(s) for s in holder) or "it never ran")
            )
    for name, n in outcomes.items():
        report.counts[f"published {name}"] = n
    report.counts["skips"] = len(history.skips)
