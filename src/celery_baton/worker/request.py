"""Release on every completion path, in the worker's main process.

An admitted request's class is swapped for a subclass of its own class (Celery builds
one per task in its strategy) that first gives back what the gate granted, then lets
Celery do what it always does. Every terminal path of a request passes through one of
these methods in the main process: success, failure (including retry, Reject, time
limits and ``WorkerLostError`` when a pool child is killed), hard timeout, revoke
(also with ``terminate=True``) and cancel. Release is idempotent, since some paths
run two of them (a hard time limit, then the failure).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

from billiard.einfo import ExceptionWithTraceback
from billiard.exceptions import WorkerLostError
from celery.exceptions import Reject, Retry, TimeLimitExceeded

if TYPE_CHECKING:
    from celery_baton.policy import RunPlan, TaskPolicy

RUN_ATTR = "_baton_run"


class Finisher(Protocol):
    def finish(self, request: Any, policy: TaskPolicy, plan: RunPlan, *, final: bool) -> None: ...


def _exception(exc_info: Any) -> BaseException:
    exc = exc_info.exception
    if isinstance(exc, ExceptionWithTraceback):
        exc = exc.exc
    return exc  # type: ignore[no-any-return]


def is_final(task: Any, exc: BaseException) -> bool:
    """Whether a failure ends the task id for good (False: the message comes back).

    Mirrors Celery's own ``Request.on_failure``: a retry re-publishes the same task id;
    ``Reject(requeue=True)``, a lost worker with ``reject_on_worker_lost`` and a time
    limit with ``acks_late`` but not ``acks_on_timeout`` requeue the message.
    """
    if isinstance(exc, Retry):
        return False
    if isinstance(exc, Reject):
        return not exc.requeue
    if isinstance(exc, WorkerLostError):
        if getattr(task, "retry_on_worker_lost", False):
            return False
        return not (task.acks_late and task.reject_on_worker_lost)
    if isinstance(exc, TimeLimitExceeded):
        return not (task.acks_late and not task.acks_on_timeout)
    return True


class BatonRequestMixin:
    """Mixed in front of a request's class once the gate admitted it."""

    __slots__ = ()

    def _baton_finish(self, *, final: bool) -> None:
        run = self.__dict__.pop(RUN_ATTR, None)
        if run is not None:
            finisher, policy, plan = run
            finisher.finish(self, policy, plan, final=final)

    def on_success(self, failed__retval__runtime: Any, **kwargs: Any) -> Any:
        if not failed__retval__runtime[0]:  # failures go on to on_failure
            self._baton_finish(final=True)
        return super().on_success(failed__retval__runtime, **kwargs)  # type: ignore[misc]

    def on_failure(
        self, exc_info: Any, send_failed_event: bool = True, return_ok: bool = False
    ) -> Any:
        self._baton_finish(final=is_final(self.task, _exception(exc_info)))  # type: ignore[attr-defined]
        return super().on_failure(exc_info, send_failed_event, return_ok)  # type: ignore[misc]

    def on_timeout(self, soft: bool, timeout: float) -> Any:
        if not soft:
            task = self.task  # type: ignore[attr-defined]
            self._baton_finish(final=not (task.acks_late and not task.acks_on_timeout))
        return super().on_timeout(soft, timeout)  # type: ignore[misc]

    def _announce_revoked(self, *args: Any, **kwargs: Any) -> Any:
        self._baton_finish(final=True)
        return super()._announce_revoked(*args, **kwargs)  # type: ignore[misc]

    def _announce_cancelled(self, *args: Any, **kwargs: Any) -> Any:
        # Cancelled because the broker connection was lost: the message comes back.
        self._baton_finish(final=False)
        return super()._announce_cancelled(*args, **kwargs)  # type: ignore[misc]


_classes: dict[type, type] = {}


def attach(request: Any, finisher: Finisher, policy: TaskPolicy, plan: RunPlan) -> None:
    """Make ``request`` give back ``plan``'s leases when it ends, whichever way."""
    cls = type(request)
    if not issubclass(cls, BatonRequestMixin):
        sub = _classes.get(cls)
        if sub is None:
            sub = type(f"Baton{cls.__name__}", (BatonRequestMixin, cls), {"__slots__": ()})
            _classes[cls] = sub
        request.__class__ = sub
    request.__dict__[RUN_ATTR] = (finisher, policy, plan)
