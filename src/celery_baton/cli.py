"""The ``celery baton`` sub-command's former entry point, ``celery_baton.cli:baton``.

The commands live in ``celery_baton.ops.cli``. An install made before they moved there
still names this path in its entry-point metadata until it is installed again.
"""

from celery_baton.ops.cli import baton

__all__ = ["baton"]
