"""Scale- and soak-sized tests: a short form in the default run, the full form on demand.

A test whose guarantee is judged alike at a smaller size (the same assertions, fewer
calls or a shorter fault phase) runs the smaller size in the README's ``python -m
pytest``; ``BATON_FULL=1`` runs every full form (the issues' own numbers), and a test's
own variable (``BATON_FAIR_FULL=1``, ``BATON_ORDERED_FULL=1``, ...) runs its own.
"""

from __future__ import annotations

import os

ALL = "BATON_FULL"


def full(own: str | None = None) -> bool:
    """Whether the full forms run: ``BATON_FULL=1``, or ``own=1`` (the test's variable)."""
    return any(os.environ.get(name) == "1" for name in (ALL, own) if name)


def sized(short: int, full_size: int, own: str | None = None) -> int:
    """``full_size`` when the full forms run (see :func:`full`), else ``short``."""
    return full_size if full(own) else short
