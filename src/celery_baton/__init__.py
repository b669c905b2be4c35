"""celery-baton: coordination for Celery that holds under failure.

>>> from celery import Celery
>>> from celery_baton import Baton
>>> app = Celery("feeds", broker="redis://127.0.0.1:6379/0")
>>> baton = Baton(app)
>>> @app.task(exclusive="feed_url")
... def import_feed(feed_url): ...
"""

from importlib import metadata as _metadata

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
