"""The checks of what runs once (each a function named ``check_*``):

* ``guard`` -- a redelivery-guarded task id never runs twice (at most one finished run,
  no two runs at once).
* ``beat`` -- a beat slot runs once (at most one finished run, no two at once).
"""

from __future__ import annotations

import itertools

from tests.soak.checks.history import SECOND, History, Report
from tests.soak.checks.spans import _by_key, _death_right_after, _describe, _overlaps, _Span


def _once(history: History, spans: list[_Span], prefix: str, name: str, report: Report) -> None:
    for key, group in sorted(_by_key(spans, (prefix,)).items()):
        for earlier, later in _overlaps(group):
            report.violations[name].append(
                f"{key!r}: {_describe(earlier)} and {_describe(later)} at once"
            )
        finished = [s for s in group if not s.killed]
        if len(finished) < 2:
            continue
        what = f"{key!r} ran {len(finished)} times: " + "; ".join(_describe(s) for s in finished)
        # Its end is recorded (the done marker) by the pool process right after the body:
        # a worker killed in that moment takes the record with it, and the copy runs.
        # Only the last run may have been recorded.
        unrecorded = [
            (s, death)
            for s in sorted(finished, key=lambda s: s.run.start)[:-1]
            if (death := _death_right_after(history, s.run)) is not None
        ]
        if len(unrecorded) == len(finished) - 1:
            span, death = unrecorded[0]
            assert span.run.end is not None
            report.known["run-end-unrecorded"].append(
                f"{what}; the first's worker died {(death.start - span.run.end) / SECOND:+.3f} s"
                f" from its end ({death.kind}), before its pool process recorded it"
            )
        else:
            report.violations[name].append(what)


def check_guard(history: History, spans: list[_Span], report: Report) -> None:
    _once(history, spans, "guarded:", "guard", report)


def check_beat(history: History, spans: list[_Span], report: Report) -> None:
    for span in spans:
        if span.run.key.startswith("beat:") and span.run.key.endswith("|None"):
            report.violations["beat"].append(f"a tick without its slot header: {_describe(span)}")
    _once(history, spans, "beat:", "beat", report)
    report.counts["beat slots"] = len(_by_key(spans, ("beat:",)))
    # Two leaders (say, beats that do not share one store) fire every tick twice, each
    # under a slot of its own: one entry's slots closer than its period give that away.
    for entry, period in history.limits.beat_periods.items():
        slots = sorted(
            {
                int(slot)
                for span in spans
                for name, _, slot in [span.run.key.removeprefix("beat:").partition("|")]
                if span.run.key.startswith("beat:") and name == entry and slot.isdigit()
            }
        )
        close = [(a, b) for a, b in itertools.pairwise(slots) if b - a < period * 1000]
        if close:
            shown = ", ".join(f"{a}/{b}" for a, b in close[:5])
            report.violations["beat"].append(
                f"{entry} (every {period:g} s): {len(close)} pair(s) of slots closer than its "
                f"period, i.e. ticks fired more than once: {shown}"
            )
