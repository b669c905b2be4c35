"""A stand-in for another machine, for tests of what processes share (or must not)."""

from __future__ import annotations

import contextlib
import os
import signal
from pathlib import Path


class Machine:
    """A stand-in for another machine: processes started with it share nothing local
    with the test or with another Machine (own ``TMPDIR``, ``XDG_RUNTIME_DIR``, working
    directory; no ``BATON_*`` variables): only the URLs they are configured with.

    Pass ``env=machine.env, cwd=machine.cwd`` to ``Workers.start`` / ``start_beat``.
    """

    def __init__(self, root: Path) -> None:
        self.root = root
        self.cwd = root / "cwd"
        self.tmp = root / "tmp"
        self.runtime = root / "run"
        for path in (self.cwd, self.tmp, self.runtime):
            path.mkdir(parents=True, exist_ok=True)
        self.runtime.chmod(0o700)
        self.env = {"TMPDIR": str(self.tmp), "XDG_RUNTIME_DIR": str(self.runtime)}

    def stop_embedded_servers(self) -> None:
        """Stop embedded stores a process started on this machine (they daemonize and
        would outlive a failed test)."""
        for pidfile in [*self.runtime.rglob("valkey.pid"), *self.tmp.rglob("valkey.pid")]:
            with contextlib.suppress(ValueError, OSError):
                os.kill(int(pidfile.read_text().strip()), signal.SIGKILL)

    def embedded_servers(self) -> list[Path]:
        """Sockets of embedded stores started on this machine (none when a URL is used)."""
        return sorted(self.runtime.glob("celery-baton-*/*.sock")) + sorted(
            self.tmp.glob("celery-baton-*/*.sock")
        )
