"""A key built at the publish is the key the worker builds (``unique``, ``ordered``,
``debounce``), whatever the serializer does to the arguments on the way.

json and msgpack read a tuple as a list: a key over a template or a key function of a
tuple argument is the text ``(1, 2)`` in the publisher and ``[1, 2]`` in the worker.
A key made at the publish over the first and looked up, freed or ordered by the worker
over the second is two keys: the unique claim is never freed by its run (the next
publish is deduplicated into a finished call until the claim's ttl), an ordered call's
place is taken in a line the worker never reads. The publisher now builds its keys
over the arguments as a worker reads them (the task's serializer, both ways).

Judged from outside: the results the caller sees, the starts an observer records.
"""

from __future__ import annotations

import importlib
import time
from types import ModuleType

import pytest

from tests.support.observer import Observer
from tests.support.workers import Workers

APP = "tests.apps.delivered_keys"
SERIALIZERS = ["json", "msgpack"]


def _app(serializer: str) -> ModuleType:
    """The test app, publishing with ``serializer`` (its workers get it by env)."""
    if serializer == "msgpack":
        pytest.importorskip("msgpack", reason="msgpack is in the test extra")
    module = importlib.import_module(APP)
    for task in module.app.tasks.values():
        # A task reads the setting when bound, and its publish options once, cached.
        task.serializer = serializer
        task._exec_options = None
    return module


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", SERIALIZERS)
@pytest.mark.parametrize("task_name", ["uq_template", "uq_function"])
def test_a_unique_key_over_a_tuple_is_freed_by_its_run(
    workers: Workers, serializer: str, task_name: str
) -> None:
    app = _app(serializer)
    task = getattr(app, task_name)
    workers.start(APP, concurrency=2, env={"TEST_SERIALIZER": serializer})
    deduplicated = []
    for n in range(3):
        first = task.delay((n, 2))
        assert first.get(timeout=30) == first.id
        again = task.delay((n, 2))
        if again.id == first.id:
            deduplicated.append(n)
            continue
        assert again.get(timeout=30) == again.id
    assert not deduplicated, (
        f"{len(deduplicated)} of 3 publishes made after the run ended were deduplicated "
        "into it: the run did not free the key its publish claimed"
    )
    # Still a duplicate while queued (no worker reads "nobody"), a list as a tuple too:
    # a worker reads both as the same list.
    held = task.apply_async(((9, 9),), queue="nobody")
    assert task.apply_async(((9, 9),), queue="nobody").id == held.id
    assert task.apply_async(([9, 9],), queue="nobody").id == held.id


@pytest.mark.timeout(180)
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_an_ordered_line_over_a_tuple_keeps_publish_order(
    workers: Workers, observer: Observer, serializer: str
) -> None:
    """Call 0 of a line waits in a queue no worker reads yet; calls 1 and 2 reach a
    worker at once and must wait for it (its place comes first in the line)."""
    app = _app(serializer)
    env = {"TEST_SERIALIZER": serializer}
    workers.start(APP, concurrency=2, env=env)
    first = app.ord_template.apply_async(((1, 2), 0), queue="later")
    rest = [app.ord_template.delay((1, 2), n) for n in (1, 2)]
    time.sleep(3)  # calls 1 and 2 are in the worker: they must not start
    early = [s for s in observer.started() if s["task_id"] in {r.id for r in rest}]
    assert not early, f"{len(early)} call(s) started before call 0 of their line was read"
    workers.start(APP, concurrency=2, queues="later", env=env)
    assert first.get(timeout=60) == 0
    assert [r.get(timeout=60) for r in rest] == [1, 2]
    ids = [first.id] + [r.id for r in rest]
    starts = sorted(
        (s for s in observer.started() if s["task_id"] in ids), key=lambda s: s["start"]
    )
    assert [s["task_id"] for s in starts] == ids


@pytest.mark.timeout(120)
@pytest.mark.parametrize("serializer", SERIALIZERS)
def test_a_debounced_burst_over_a_tuple_runs_once_with_the_latest_call(
    workers: Workers, observer: Observer, serializer: str
) -> None:
    app = _app(serializer)
    workers.start(APP, concurrency=2, env={"TEST_SERIALIZER": serializer})
    for n in range(3):
        app.deb_template.delay((3, 4), n)
    time.sleep(5)  # the 1 s window, and the run
    runs = sorted(s["key"] for s in observer.started() if s["key"].startswith("deb-"))
    assert runs == ["deb-[3, 4]-2"]
