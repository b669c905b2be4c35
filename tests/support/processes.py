"""Subprocess plumbing shared by the server and worker wrappers.

Every process started through :func:`spawn` is killed when the test session's
interpreter exits, so a crashed or interrupted run does not leave servers and workers
behind to disturb the next one.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import signal
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path

#: The repository root (the directory holding ``pyproject.toml``).
REPO_ROOT = Path(__file__).resolve().parents[2]

_live: set[subprocess.Popen[bytes]] = set()


def spawn(
    cmd: Sequence[str],
    *,
    log_path: Path,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """Start ``cmd`` with stdout and stderr appended to ``log_path``.

    The child gets its own session, so a Ctrl-C in the terminal reaches pytest only and
    the fixtures decide how each process ends.
    """
    with open(log_path, "ab") as log:
        proc = subprocess.Popen(
            list(cmd),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env) if env is not None else None,
            cwd=cwd,
            start_new_session=True,
        )
    _live.add(proc)
    return proc


def end(proc: subprocess.Popen[bytes], *, timeout: float, sigterm: bool = True) -> int:
    """SIGTERM ``proc``, wait up to ``timeout`` seconds, then SIGKILL; return its exit code.

    ``sigterm=False``: the caller has sent SIGTERM already; only wait, then SIGKILL.
    """
    if proc.poll() is None:
        if sigterm:
            signal_quietly(proc, signal.SIGTERM)
            # A SIGSTOPped process would keep the SIGTERM pending forever.
            signal_quietly(proc, signal.SIGCONT)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            signal_quietly(proc, signal.SIGKILL)
            proc.wait()
    _live.discard(proc)
    return proc.returncode


def kill(proc: subprocess.Popen[bytes]) -> int:
    """SIGKILL ``proc`` and reap it; return its exit code."""
    signal_quietly(proc, signal.SIGKILL)
    proc.wait()
    _live.discard(proc)
    return proc.returncode


def signal_quietly(proc: subprocess.Popen[bytes], sig: int) -> None:
    """Send ``sig`` unless the process has already been reaped."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(proc.pid, sig)


def log_tail(path: Path, lines: int = 40) -> str:
    """The last ``lines`` lines of a log file ('' if it does not exist)."""
    try:
        text = path.read_text(errors="replace")
    except FileNotFoundError:
        return ""
    return "\n".join(text.splitlines()[-lines:])


@atexit.register
def _kill_leftovers() -> None:
    # Each child leads its own process group: kill the group, so that pool children
    # of a worker go too.
    for proc in list(_live):
        with contextlib.suppress(OSError):
            os.killpg(proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            kill(proc)
