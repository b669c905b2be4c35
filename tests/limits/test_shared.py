"""Named limits shared by tasks (issue 15 §3), with real workers, judged from outside.

The budget is checked on admission instants read from the store's clock (the fence of
an always-free exclusive lease, as in test_rate_limits.py), weighted by each run's cost:
in any window ``[s_i, s_j]`` the costs admitted sum to at most ``burst + (s_j - s_i) *
rate`` (a token bucket of ``burst`` that refills at ``rate``).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from typing import Any

import pytest

from tests.limits.test_rate_limits import admissions
from tests.support.observer import Observer, Run
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.shared_limits"


def weighted_excess(starts: Sequence[tuple[int, float]], per_second: float, burst: int) -> float:
    """By how much (in cost units) the worst window ``[s_i, s_j]`` exceeds ``burst +
    (s_j - s_i) * rate``; <= 0: the budget held everywhere."""
    s = sorted(starts)
    worst = float("-inf")
    for i in range(len(s)):
        total = 0.0
        for j in range(i, len(s)):
            total += s[j][1]
            allowed = burst + (s[j][0] - s[i][0]) * per_second / 1e6
            worst = max(worst, total - allowed)
    return worst


def costed(runs: Iterable[Run]) -> list[tuple[int, float]]:
    """(admission instant, cost) of each run: the fence, and the cost in its key."""
    runs = list(runs)
    return list(zip(admissions(runs), (float(r.key.rsplit(":", 1)[1]) for r in runs), strict=True))


def start(workers: Workers, n: int = 2, **kw: Any) -> None:
    kw.setdefault("pool", "solo")
    kw.setdefault("concurrency", 1)
    started = [workers.start(APP, wait=False, **kw) for _ in range(n)]
    for worker in started:
        worker.wait_ready()


_numbers = itertools.count()


def publish(task: Any, *args: Any) -> Any:
    return task.apply_async(args, {"n": next(_numbers)})


def test_weighted_checker_on_hand_made_starts() -> None:
    assert weighted_excess([(0, 5), (0, 5), (500_000, 5)], 10, 10) <= 0  # 10 + 0.5 s x 10
    assert weighted_excess([(0, 5), (0, 5), (400_000, 5)], 10, 10) == pytest.approx(1)


def test_two_tasks_share_one_budget(workers: Workers, observer: Observer) -> None:
    """api_a and api_b both use "api" (10/s, a bucket of 10) on two workers: together,
    never more than the one budget; each alone would have passed twice as fast. One
    worker asks on its event loop (prefork: pipelined), the other at once (solo)."""
    from tests.apps import shared_limits

    start(workers, 1)
    start(workers, 1, pool="prefork", concurrency=2)
    for _ in range(15):
        publish(shared_limits.api_a)
        publish(shared_limits.api_b)
    runs = observer.wait_for(30, timeout=60)

    assert {r.key for r in runs} == {"api_a:1", "api_b:1"}
    starts = costed(runs)
    assert weighted_excess(starts, 10, 10) <= 1e-3, sorted(starts)
    span = (max(s for s, _ in starts) - min(s for s, _ in starts)) / 1e6
    assert 1.5 < span < 20  # (30 - 10) / 10 = 2 s: paced, not stuck


def test_costs_weigh_on_the_budget_and_a_cost_above_the_burst_is_refused(
    workers: Workers, observer: Observer
) -> None:
    """complete(tokens) spends its tokens of "tokens" (200/s, burst 200)."""
    from tests.apps import shared_limits

    start(workers)
    too_big = publish(shared_limits.complete, 201)
    costs = [150, 50, 120, 80, 200, 30, 170, 100]
    for tokens in costs:
        publish(shared_limits.complete, tokens)
    runs = observer.wait_for(len(costs), timeout=60)

    starts = costed(runs)
    assert sorted(c for _, c in starts) == sorted(costs)  # the 201 never ran
    assert weighted_excess(starts, 200, 200) <= 1e-3, sorted(starts)
    span = (max(s for s, _ in starts) - min(s for s, _ in starts)) / 1e6
    assert 2 < span < 30  # (900 - 200) / 200 = 3.5 s
    wait_until(lambda: too_big.state == "FAILURE", timeout=10, what="the refusal")
    assert "larger than the burst 200" in str(too_big.result)


def test_penalize_holds_every_worker_until_it_ends(workers: Workers, observer: Observer) -> None:
    """A 429 seen in code: penalize(2) holds "pen" on both workers; held requests take
    no pool slot (an unlimited task runs meanwhile); all run once it ends."""
    from tests.apps import shared_limits

    start(workers)
    shared_limits.baton.limit("pen").penalize(2.0)
    until_us = int(shared_limits.baton.store.client.get("baton:{limit:pen}:penalty"))
    for _ in range(4):
        publish(shared_limits.call_api)
    shared_limits.unlimited.delay()
    runs = observer.wait_for(5, timeout=30)

    limited = [r for r in runs if r.key == "call_api:1"]
    assert len(limited) == 4
    assert min(admissions(limited)) >= until_us  # store clock: none before the end
    (free,) = [r for r in runs if r.key == "unlimited:0"]
    assert free.end < min(r.start for r in limited)  # observer clock: it ran meanwhile
    assert all("held" in w.log_text() or "penalty" in w.log_text() for w in workers.started)


def test_baton_limit_in_code_blocks_times_out_and_tries(app_environ: None) -> None:
    from celery_baton.errors import LimitTimeout
    from tests.apps import shared_limits

    baton = shared_limits.baton
    baton.store.client.delete("baton:{limit:api}:rate")
    with baton.limit("api", cost=10) as decision:  # the whole bucket
        assert decision.granted
    assert not baton.limit("api").try_acquire(cost=5).granted
    with pytest.raises(LimitTimeout), baton.limit("api", cost=5, timeout=0.1):
        pass
    began = time.monotonic()
    with baton.limit("api", cost=5, timeout=5):
        assert 0.2 < time.monotonic() - began < 5  # 5 units at 10/s: ~0.5 s


def test_a_callable_option_gets_the_call_arguments_not_the_task(
    workers: Workers, observer: Observer
) -> None:
    """``exclusive=lambda doc, sleep: doc`` (and ``cost=``): Celery keeps options as
    class attributes, so reading one from the task bound the task as its first argument
    and the key's call raised: the worker died ("Unrecoverable error: TypeError('<lambda>()
    takes 2 positional arguments but 3 were given')")."""
    from tests.apps import shared_limits
    from tests.support.observer import assert_no_overlap

    start(workers, 1, pool="threads", concurrency=2)
    for _ in range(2):
        shared_limits.keyed_by_callable.delay("d1", 0.5)
    assert_no_overlap(observer.runs_of("d1", 2, timeout=20))


def test_an_unknown_limit_stops_the_worker_at_start(workers: Workers) -> None:
    worker = workers.start("tests.apps.shared_limits_typo", wait=False, concurrency=1)
    wait_until(lambda: not worker.is_running, timeout=30, what="the worker to refuse")
    assert "unknown limit 'opneai' (did you mean `openai`?)" in worker.log_text()


def test_limits_command_shows_named_limits_and_their_penalty(workers: Workers) -> None:
    from tests.apps import shared_limits
    from tests.ops.test_commands import as_json, baton

    shared_limits.baton.limit("pen").penalize(30)
    named = {n["limit"]: n for n in as_json(workers, "limits", app=APP)["named_limits"]}
    assert named["api"] == {
        "limit": "api", "rate": "10/s", "burst": 10, "penalty_left": 0.0, "tasks": 2,
    }  # fmt: skip
    assert 20 < named["pen"]["penalty_left"] <= 30
    text = baton(workers, "limits", app=APP).stdout
    assert "[api]" in text and "named limit" in text
