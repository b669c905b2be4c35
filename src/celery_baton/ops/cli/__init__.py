"""``celery -A proj baton status | locks | unlock KEY | limits | schedule | cancel | web``.

Registered through Celery's ``celery.commands`` entry point (``celery_baton.ops.cli:baton``).
Every command takes ``--json`` (its errors are JSON too); tables fit the terminal's
width. One module per command group, each rendering the read model (``ops/state.py``):

- ``group``: the ``baton`` group and the :class:`~celery_baton.ops.cli.group.Context`
- ``output``: tables, JSON, ``--watch``
- ``status`` (and ``end-grace``), ``locks`` (and ``unlock``), ``limits``, ``schedule``,
  ``web``
"""

from celery_baton.ops.cli import cancel, limits, loading, locks, schedule, status, web
from celery_baton.ops.cli.group import baton

# Loaded by the `celery` command before it imports -A: a bad task option is one line.
loading.install()

__all__ = ["baton", "cancel", "limits", "locks", "schedule", "status", "web"]
