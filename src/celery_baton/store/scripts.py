"""Loads the Lua scripts in ``lua/`` and runs them with EVALSHA (reloading on NOSCRIPT).

One script per store operation; each file's header says what its KEYS and ARGV are
and what it returns. Scripts read the clock with ``TIME`` on the server, never the
caller's clock, so workers with skewed clocks agree.
"""

from __future__ import annotations

from collections.abc import Sequence
from functools import cache
from importlib import resources
from typing import Any

SCRIPT_NAMES = (
    "gate",
    "release",
    "renew",
    "unique_claim",
    "unique_release",
    "unlock",
    "beat_lead",
    "beat_resign",
    "beat_claim",
    "beat_sent",
    "beat_define",
    "beat_remove",
    "beat_mark",
)


@cache
def script_source(name: str) -> str:
    return resources.files("celery_baton.store").joinpath("lua", f"{name}.lua").read_text()


class Scripts:
    """The registered scripts of one client: ``scripts.run("gate", keys, args)``."""

    def __init__(self, client: Any) -> None:
        self._client = client
        self._registered: dict[str, Any] = {}

    def _script(self, name: str) -> Any:
        script = self._registered.get(name)
        if script is None:
            # redis-py's Script sends EVALSHA and falls back to loading on NOSCRIPT,
            # also inside pipelines (it loads the scripts before the pipeline runs).
            script = self._client.register_script(script_source(name))
            self._registered[name] = script
        return script

    def run(self, name: str, keys: Sequence[str], args: Sequence[Any], client: Any = None) -> Any:
        """Run script ``name``; ``client`` may be a pipeline of the same connection."""
        return self._script(name)(keys=keys, args=args, client=client or self._client)
