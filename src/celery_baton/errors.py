"""Every error celery-baton raises; one base class, each carrying what it is about."""

from __future__ import annotations


class BatonError(Exception):
    """Base class of every celery-baton error."""


class ConfigError(BatonError, ValueError):
    """An invalid option or setting, reported when it is declared or read."""

    def __init__(self, message: str, *, subject: str | None = None) -> None:
        super().__init__(f"{subject}: {message}" if subject else message)
        self.subject = subject


class KeySpecError(ConfigError):
    """A key spec that cannot build a key: unknown argument, bad template, bad value."""


class RateSpecError(ConfigError):
    """A rate string or number that is not a valid positive rate."""


class CostError(ConfigError):
    """A call's ``cost`` that a named limit can never admit (larger than its burst) or
    that is not a number >= 0: refused at once, never a silent wait."""


class LimitTimeout(BatonError):
    """``baton.limit(name).acquire(timeout=...)`` found no room within its timeout."""

    def __init__(self, message: str, *, limit: str, retry_after: float) -> None:
        super().__init__(message)
        self.limit = limit
        self.retry_after = retry_after


class StoreUnavailable(BatonError):
    """The store did not answer; raised ``from`` the client's own error."""

    def __init__(self, message: str, *, url: str | None = None) -> None:
        super().__init__(f"{message} (store {url})" if url else message)
        self.url = url


class LeaseNotOwned(BatonError):
    """An operation on a lease that this owner does not hold (any more)."""

    def __init__(self, message: str, *, key: str) -> None:
        super().__init__(f"{message}: {key}")
        self.key = key


class NotInExclusiveTask(BatonError):
    """``fence()`` was called outside a task run that holds an exclusive lease."""


class TaskSkipped(BatonError):
    """Stored as the result of a duplicate run that ``exclusive_conflict="skip"`` skipped."""

    def __init__(self, message: str, key: str = "", holder: str = "") -> None:
        super().__init__(message, key, holder)
        self.key = key
        self.holder = holder

    def __str__(self) -> str:
        return str(self.args[0])


class TaskDeduplicated(BatonError):
    """Stored for a pre-assigned task id (a group or chain member) whose publish found an
    earlier task with the same unique key: that id will never run; ``holder`` does."""

    def __init__(self, message: str, holder: str = "") -> None:
        super().__init__(message, holder)
        self.holder = holder

    def __str__(self) -> str:
        return str(self.args[0])


class TaskSuperseded(BatonError):
    """Stored, with the state ``REVOKED``, for a task that a newer publish of the same key
    replaced (``exclusive_conflict="replace"``/``"keep_last"``, ``unique_conflict=
    "replace"``): it never runs, or was terminated; ``replaced_by`` is the task id that
    runs instead."""

    def __init__(self, message: str, replaced_by: str = "") -> None:
        super().__init__(message, replaced_by)
        self.replaced_by = replaced_by

    def __str__(self) -> str:
        return str(self.args[0])


class AlreadyQueued(BatonError):
    """A publish of a ``unique`` task whose key is held by a task queued or running
    (raised with ``unique_conflict="raise"``; the default returns that task's result)."""

    def __init__(self, message: str, *, existing_id: str, key: str) -> None:
        super().__init__(message)
        self.existing_id = existing_id
        self.key = key


class BeatEntryError(BatonError, ValueError):
    """A beat schedule entry that cannot be scheduled: bad schedule, unknown task, 0 s."""

    def __init__(self, message: str, *, entry: str) -> None:
        super().__init__(f"beat entry {entry!r}: {message}")
        self.entry = entry


class BatchResultError(BatonError):
    """A batched task's body gave no result for a call (a mapping without its id, or a
    list of another length): that call fails with this error, naming it."""

    def __init__(self, message: str, call_id: str = "") -> None:
        super().__init__(message, call_id)
        self.call_id = call_id

    def __str__(self) -> str:
        return str(self.args[0])
