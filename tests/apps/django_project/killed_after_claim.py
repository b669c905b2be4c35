"""A DjangoScheduler that SIGKILLs itself right after it claimed a slot of one entry,
before it sends it, once (``celery -S tests.apps.django_project.killed_after_claim:Scheduler``).

``DJBEAT_KILL_AFTER_CLAIM=<entry>:<marker path>``: the first beat to publish a slot of
``<entry>`` creates the marker and dies; the claim is in the store's outbox, the message
is not sent, the row is not written. Every later publish (the next leader's re-send) goes
through. A leader killed in that moment, made to happen every time.
"""

from __future__ import annotations

import os
import signal
from typing import Any

from celery_baton.beat.django import DjangoScheduler
from celery_baton.beat.entries import CompiledEntry


class Scheduler(DjangoScheduler):
    def publish(self, compiled: CompiledEntry, slot_ms: int, task_id: str, **kw: Any) -> Any:
        entry, _, marker = os.environ.get("DJBEAT_KILL_AFTER_CLAIM", "").partition(":")
        if compiled.name == entry and marker:
            try:
                os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
            except FileExistsError:
                pass
            else:
                os.kill(os.getpid(), signal.SIGKILL)
        return super().publish(compiled, slot_ms, task_id, **kw)
