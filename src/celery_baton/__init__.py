"""celery-baton: coordination for Celery that holds under failure.

>>> from celery import Celery
>>> from celery_baton import Baton
>>> app = Celery("feeds", broker="redis://127.0.0.1:6379/0")
>>> baton = Baton(app)
>>> @app.task(exclusive="feed_url")
... def import_feed(feed_url): ...
"""

from importlib import metadata as _metadata
from typing import TYPE_CHECKING

from celery_baton.baton import Baton
from celery_baton.core.batch import Call
from celery_baton.core.policy.options import TaskOptions
from celery_baton.errors import (
    AlreadyQueued,
    BatchResultError,
    BatonError,
    ConfigError,
    CostError,
    KeySpecError,
    LeaseNotOwned,
    LimitTimeout,
    NotInExclusiveTask,
    RateSpecError,
    StoreUnavailable,
    TaskDeduplicated,
    TaskSkipped,
    TaskSuperseded,
)
from celery_baton.worker.pool.context import fence

# The one version source is pyproject.toml; an install records it in the package's
# metadata, read here. A source tree on sys.path that was never installed has none.
try:
    __version__ = _metadata.version("celery-baton")
except _metadata.PackageNotFoundError:
    __version__ = "0+unknown"

#: Names a user guesses at the package's top level that live in ``celery_baton.beat``:
#: ``celery beat -S celery_baton.Scheduler`` (or ``beat_scheduler = "celery_baton:Scheduler"``)
#: failed deep in Celery's ``symbol_by_name`` with a bare "module 'celery_baton' has no
#: attribute 'Scheduler'". They are not re-exported (one documented path), only pointed at.
_BEAT_NAMES = {
    "Scheduler": "the beat scheduler is celery_baton.beat:Scheduler "
    "(celery beat -S celery_baton.beat:Scheduler)",
    "ScheduleStore": "it is in celery_baton.beat (from celery_baton.beat import ScheduleStore)",
    "DjangoScheduler": "it is celery_baton.beat.django:DjangoScheduler",
}


if not TYPE_CHECKING:  # a module __getattr__ seen by mypy would type every name as valid

    def __getattr__(name: str) -> object:
        message = f"module 'celery_baton' has no attribute {name!r}"
        if name in _BEAT_NAMES:
            message += f": {_BEAT_NAMES[name]}"
        raise AttributeError(message)


__all__ = [
    "AlreadyQueued",
    "BatchResultError",
    "Baton",
    "BatonError",
    "Call",
    "ConfigError",
    "CostError",
    "KeySpecError",
    "LeaseNotOwned",
    "LimitTimeout",
    "NotInExclusiveTask",
    "RateSpecError",
    "StoreUnavailable",
    "TaskDeduplicated",
    "TaskOptions",
    "TaskSkipped",
    "TaskSuperseded",
    "fence",
]
