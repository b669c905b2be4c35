"""Celery signals celery-baton sends, so that every skip, hold and throttle is visible.

>>> from celery_baton.signals import task_skipped
>>> @task_skipped.connect
... def on_skip(sender, request, key, holder, reason, **kw):
...     print("skipped", request.id, "held by", holder)
"""

from __future__ import annotations

from celery.utils.dispatch import Signal

#: A delivery was not run: a duplicate of an exclusive run (``reason="exclusive"``),
#: a task id that already finished (``reason="already-run"``), one a newer publish
#: superseded (``reason="superseded"``; ``holder`` is the newer task id), one a later
#: publish of its debounce or trailing-throttle key runs for (``reason="coalesced"``), one
#: a throttle window dropped (``reason="throttled"``), a unique call published where its
#: options were unknown whose key another call holds as it arrives
#: (``reason="duplicate"``; ``task_deduplicated`` is sent too) or an invalid key.
task_skipped = Signal(name="baton_task_skipped")
#: A delivery waits in the worker's consumer (no pool slot) for ``key``.
task_held = Signal(name="baton_task_held")
#: A delivery was denied by a global rate limit; it waits ``retry_after`` seconds.
task_throttled = Signal(name="baton_task_throttled")
#: A held delivery went back to the broker (hold cap or time horizon reached).
task_handed_back = Signal(name="baton_task_handed_back")
#: A publish of a unique task found an earlier one queued or running; or, for a call
#: published where its options were unknown, a worker did as the call arrived.
task_deduplicated = Signal(name="baton_task_deduplicated")
