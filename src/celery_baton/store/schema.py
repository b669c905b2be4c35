"""The formats of what celery-baton writes in the store, read and written here only.

* **Keys** are ``<prefix>:{<task>}:<kind>:<digest>`` (``core/keys.py`` names them). The
  ``{...}`` is the key's hash tag: Redis Cluster hashes only that part, so every key of
  one task lives on one slot and one script call may use them all.
* **Owners** of leases and claims are ``<task id>|<worker>|<nonce>``: unique to one
  delivery of a message (a unique claim made at publish has no worker: ``<task id>||``).
* **Runtime limit overrides** (``celery baton limits set``) are fields of the task's
  limits hash: ``concurrency`` is a count, ``rate`` is ``"<interval_us> <burst>"``, read
  by the gate (lua/gate/override.lua) in place of the declared limit.
"""

from __future__ import annotations

OWNER_SEP = "|"


def hash_tag(key: str) -> str:
    """The part of ``key`` Redis Cluster hashes: the text of its first ``{...}`` (a
    celery-baton key's task), else the whole key."""
    start = key.find("{")
    end = key.find("}", start + 1) if start >= 0 else -1
    return key[start + 1 : end] if end > start + 1 else key


def make_owner(task_id: str, worker: str, nonce: str) -> str:
    return f"{task_id}{OWNER_SEP}{worker}{OWNER_SEP}{nonce}"


def owner_parts(owner: str) -> tuple[str, str, str]:
    """``(task id, worker, nonce)`` of an owner token; missing parts are ''."""
    task_id, worker, nonce = [*owner.split(OWNER_SEP, 2), "", ""][:3]
    return task_id, worker, nonce


def rate_override(interval_us: int, burst: int) -> str:
    return f"{interval_us} {burst}"


def parse_rate_override(value: str) -> tuple[int, int]:
    """``(interval in microseconds, burst)`` of a stored rate override."""
    interval, _, burst = value.partition(" ")
    return int(interval), int(burst or 1)
