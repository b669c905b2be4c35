"""The version matrix: celery-baton on each Celery minor (with its kombu) and Python.

    python3 tests/matrix/run.py                    # every cell: demo + quick suite
    python3 tests/matrix/run.py --cells celery5.3-py3.10,celery5.7-py3.13
    python3 tests/matrix/run.py --rotate --short   # one cell of the declared range by the
                                                   # day of the year, unit and store
                                                   # tests only (.ci/run)
    python3 tests/matrix/run.py --cells celery5.7-py3.13 --full   # + the whole suite
    python3 tests/matrix/run.py --list             # the cells and their interpreters

A cell is a Celery minor (pinned ``celery[redis]==X.Y.*`` and ``kombu==X.Y.*`` by a
constraint file, so installing the project cannot move them) on one Python: 3.10 and the
newest Python that Celery release supports which this machine has. Each cell gets its own
virtualenv under ``--cache`` (``~/.cache/celery-baton-matrix/<cell>``; rebuilt when
``pyproject.toml`` or the pins change) with this checkout installed editable with its
``test`` and ``embedded`` extras, then runs, from that virtualenv:

* ``python -m celery_baton demo`` (the README's first command);
* the quick suite: ``tests/unit`` and ``tests/store`` (``tests/unit/test_internals.py``
  among them: every private Celery/kombu name the worker relies on, present and shaped
  as expected) and the real-worker tests of ``WORKER_TESTS``, which drive each internal;
* with ``--full``, the README's test command (``python -m pytest``).

Cells run one after another (real servers and workers: never two at once on a small
machine). Prints a table (cell, celery, kombu, python, result, seconds) and, with
``--markdown``, the same as Markdown for docs/compatibility.md. Exits 1 when a cell
failed. A cell that could not be set up because the package index or the interpreter is
not there is printed as NOT TESTED with the reason, and does not fail the run: only code
that fails does.
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DEFAULT_CACHE = Path.home() / ".cache" / "celery-baton-matrix"

#: Celery minor -> the newest Python its release declares (its classifiers); every
#: cell also runs on 3.10, the oldest Python celery-baton supports.
CELERY_NEWEST_PYTHON = {
    "5.3": "3.12",
    "5.4": "3.12",
    "5.5": "3.13",
    "5.6": "3.13",
    "5.7": "3.14",
}
OLDEST_PYTHON = "3.10"

#: The real-worker tests of the quick suite, by the internal each one drives.
WORKER_TESTS = (
    # kombu's Redis channel close (_brpop_read) and held_return (_delivered,
    # restore_by_tag): the broker SIGKILLed while requests are held.
    "tests/transport/test_held_broker_kill.py",
    # the prefork semaphore (_process_task_sem, _process_task, LaxBoundedSemaphore) and
    # CountedSlots (worker.state.reserved_requests): limits judged at the body's start.
    "tests/limits/test_at_start.py",
    # qos.increment_eventually and the consumer's timer: held requests.
    "tests/limits/test_hold.py",
    # Request._announce_revoked / _announce_cancelled / on_failure (WorkerLostError),
    # Request._context (skipped duplicates' results): exclusive keys under faults.
    "tests/exclusive/test_faults.py",
    # kombu's Redis channel handlers["BRPOP"], client.parse_response, QoS.append, the
    # unacked index and hash, _delivered and connection._deliver: every worker's intake
    # (and Celery's worker_disable_prefetch, where it exists).
    "tests/transport/test_intake.py",
    # kombu's _lookup / _q_for_pri / priority_steps / unacked_key: failed acks.
    "tests/transport/test_ack_fate.py",
    # Request._announce_revoked: a run terminated by a replacing publish.
    "tests/flow/test_replaced_result.py",
    # the task_received signal before the strategy's ETA timer, and apply_eta_task
    # handing the request to on_task_request at its time: a held-for-later unique task.
    "tests/unique/test_after_the_result.py::test_a_publish_after_a_cancel_before_the_start_was_seen_is_a_new_run",
)
SHORT_TESTS = ("tests/unit", "tests/store")
QUICK_TESTS = (*SHORT_TESTS, *WORKER_TESTS)

#: pip's words for a package index it could not reach.
NETWORK_ERRORS = re.compile(
    r"NewConnectionError|Failed to establish a new connection|Temporary failure in name "
    r"resolution|Name or service not known|Max retries exceeded|ConnectTimeoutError|"
    r"ReadTimeoutError|Network is unreachable|Could not fetch URL|ProxyError"
)


@dataclass(frozen=True)
class Cell:
    celery: str  # "5.3"
    python: str  # "3.10"

    @property
    def name(self) -> str:
        return f"celery{self.celery}-py{self.python}"


@dataclass
class Outcome:
    cell: Cell
    result: str = "passed"  # passed / FAILED (...) / NOT TESTED (...)
    celery: str = "-"
    kombu: str = "-"
    python: str = "-"
    seconds: dict[str, float] = field(default_factory=dict)

    @property
    def failed(self) -> bool:
        return self.result.startswith("FAILED")


def interpreter(version: str) -> str | None:
    """A ``python<version>`` on PATH, else pyenv's, else uv's (None: not here)."""
    found = shutil.which(f"python{version}")
    if found and _runs(found):
        return found
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv")) / "versions"
    for candidate in sorted(pyenv.glob(f"{version}.*"), reverse=True):
        binary = candidate / "bin" / f"python{version}"
        if binary.exists() and _runs(str(binary)):
            return str(binary)
    uv = shutil.which("uv")
    if uv:
        done = subprocess.run(
            [uv, "python", "find", version], capture_output=True, text=True, check=False
        )
        if done.returncode == 0 and done.stdout.strip():
            return done.stdout.strip()
    return None


def _runs(binary: str) -> bool:
    return subprocess.run([binary, "-c", "import venv"], capture_output=True).returncode == 0


def newest_python(celery: str) -> str:
    """The newest Python ``celery`` supports that this machine has (else the newest
    it supports, reported NOT TESTED when run)."""
    newest = CELERY_NEWEST_PYTHON[celery]
    minor = int(newest.split(".")[1])
    while minor > int(OLDEST_PYTHON.split(".")[1]):
        if interpreter(f"3.{minor}"):
            return f"3.{minor}"
        minor -= 1
    return newest


def all_cells() -> list[Cell]:
    cells = []
    for celery in CELERY_NEWEST_PYTHON:
        for python in dict.fromkeys((OLDEST_PYTHON, newest_python(celery))):
            cells.append(Cell(celery, python))
    return cells


def declared(celery: str) -> bool:
    """Whether the Celery minor ``celery`` ("5.7") is in the range pyproject.toml declares
    (``celery[redis]>=5.3,<5.8``): the cells CI rotates over must pass."""
    found = re.search(r'"celery\[redis\]([^"]*)"', (REPO / "pyproject.toml").read_text())
    version = tuple(int(p) for p in f"{celery}.0".split("."))
    for op, bound in re.findall(r"(>=|<=|==|<|>)\s*([\d.]+)", found.group(1) if found else ""):
        limit = tuple(int(p) for p in bound.split("."))
        limit += (0,) * (len(version) - len(limit))
        holds = {
            ">=": version >= limit,
            "<=": version <= limit,
            "==": version[: len(limit)] == limit,
            "<": version < limit,
            ">": version > limit,
        }[op]
        if not holds:
            return False
    return True


def run(cmd: list[str], log: Path, *, env: dict[str, str], cwd: Path, timeout: float) -> int:
    """Run ``cmd`` with its output appended to ``log``; its exit status (124: timeout)."""
    with log.open("a") as out:
        out.write(f"\n$ {' '.join(cmd)}\n")
        out.flush()
        try:
            return subprocess.run(
                cmd, stdout=out, stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout
            ).returncode
        except subprocess.TimeoutExpired:
            out.write(f"\n[matrix] timed out after {timeout:.0f} s\n")
            return 124


def stamp(cell: Cell) -> str:
    pyproject = (REPO / "pyproject.toml").read_bytes()
    return hashlib.sha256(pyproject + f"{cell.name}|{REPO}".encode()).hexdigest()


def requirements() -> list[str]:
    """pyproject.toml's dependencies but Celery's, with the test and embedded extras."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10 runs this script too
        import tomli as tomllib  # type: ignore[no-redef]
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    wanted = [*project["dependencies"], *extras["test"], *extras["embedded"]]
    return [r for r in dict.fromkeys(wanted) if not re.match(r"celery(\[|[<>=!~ ]|$)", r)]


def install(cell: Cell, home: Path, log: Path) -> str | None:
    """The cell's virtualenv, made (or kept) under ``home``; None, or why it is not there
    (``NOT TESTED`` when pip could not reach the index, ``FAILED`` otherwise)."""
    venv = home / "venv"
    stamp_file = home / "stamp"
    if stamp_file.exists() and stamp_file.read_text() == stamp(cell):
        return None
    binary = interpreter(cell.python)
    if binary is None:
        return f"NOT TESTED (no Python {cell.python} on this machine)"
    shutil.rmtree(home, ignore_errors=True)
    home.mkdir(parents=True)
    env = {**os.environ, "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    if run([binary, "-m", "venv", str(venv)], log, env=env, cwd=REPO, timeout=300):
        return "FAILED (venv)"
    constraints = home / "constraints.txt"
    constraints.write_text(f"celery=={cell.celery}.*\nkombu=={cell.celery}.*\n")
    pip = [str(venv / "bin" / "python"), "-m", "pip", "install", "-q"]
    # The project's requirements but its Celery range (a cell may lie outside the range
    # it declares: that is how the range is found), then the project without them.
    status = run(
        [*pip, "-c", str(constraints), f"celery[redis]=={cell.celery}.*", *requirements()],
        log,
        env=env,
        cwd=REPO,
        timeout=1200,
    ) or run([*pip, "--no-deps", "-e", "."], log, env=env, cwd=REPO, timeout=300)
    if status:
        if NETWORK_ERRORS.search(log.read_text()):
            return "NOT TESTED (the package index could not be reached: see the log)"
        return "FAILED (install)"
    stamp_file.write_text(stamp(cell))
    return None


def versions(python: Path) -> tuple[str, str, str]:
    code = (
        "import celery, kombu, platform; "
        "print(celery.__version__, kombu.__version__, platform.python_version())"
    )
    done = subprocess.run([str(python), "-c", code], capture_output=True, text=True, check=False)
    parts = done.stdout.split()
    return (parts[0], parts[1], parts[2]) if len(parts) == 3 else ("?", "?", "?")


def run_cell(cell: Cell, cache: Path, *, full: bool, short: bool = False) -> Outcome:
    home = cache / cell.name
    home.mkdir(parents=True, exist_ok=True)
    log = cache / f"{cell.name}.log"
    log.write_text(f"[matrix] {cell.name} at {datetime.datetime.now().isoformat()}\n")
    outcome = Outcome(cell)
    started = time.monotonic()
    print(f"[matrix] {cell.name}: installing (log: {log})", flush=True)
    problem = install(cell, home, log)
    outcome.seconds["install"] = time.monotonic() - started
    if problem:
        outcome.result = problem
        return outcome
    python = home / "venv" / "bin" / "python"
    outcome.celery, outcome.kombu, outcome.python = versions(python)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("BATON_", "TEST_", "PYTHON"))}
    env["PATH"] = f"{python.parent}{os.pathsep}{env.get('PATH', '')}"
    env["VIRTUAL_ENV"] = str(home / "venv")
    # This checkout's code, whatever else the virtualenv may hold.
    env["PYTHONPATH"] = f"{REPO / 'src'}{os.pathsep}{REPO}"
    tests = SHORT_TESTS if short else QUICK_TESTS
    steps: list[tuple[str, list[str], Path, float]] = [
        ("demo", [str(python), "-m", "celery_baton", "demo"], Path(tempfile.gettempdir()), 300),
        (
            "quick",
            [str(python), "-m", "pytest", "-n", "0", "-q", "-m", "not slow", *tests],
            REPO,
            1800,
        ),
    ]
    if full:
        steps.append(("full", [str(python), "-m", "pytest", "-q"], REPO, 5400))
    failed = []
    for label, cmd, cwd, timeout in steps:
        print(f"[matrix] {cell.name}: {label}", flush=True)
        begun = time.monotonic()
        if run(cmd, log, env=env, cwd=cwd, timeout=timeout):
            failed.append(label)
        outcome.seconds[label] = time.monotonic() - begun
    if failed:
        outcome.result = f"FAILED ({', '.join(failed)}: see {log})"
    return outcome


def table(outcomes: list[Outcome], *, markdown: bool) -> str:
    head = ("cell", "celery", "kombu", "python", "result", "seconds")
    rows = [
        (
            o.cell.name,
            o.celery,
            o.kombu,
            o.python,
            o.result,
            " + ".join(f"{k} {v:.0f}" for k, v in o.seconds.items()),
        )
        for o in outcomes
    ]
    if markdown:
        lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
        return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) for r in [head, *rows]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--cells", help="comma-separated cell names (default: all)")
    parser.add_argument("--rotate", action="store_true", help="one cell, by day of year")
    parser.add_argument("--full", action="store_true", help="also the whole test suite")
    parser.add_argument("--short", action="store_true", help="unit and store tests only")
    parser.add_argument("--list", action="store_true", help="print the cells and stop")
    parser.add_argument("--markdown", action="store_true", help="the table as Markdown")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    args = parser.parse_args(argv)
    cells = all_cells()
    if args.list:
        for cell in cells:
            print(f"{cell.name:20} {interpreter(cell.python) or 'no interpreter here'}")
        return 0
    if args.cells:
        by_name = {cell.name: cell for cell in cells}
        unknown = [n for n in args.cells.split(",") if n not in by_name]
        if unknown:
            parser.error(f"unknown cells {unknown}; known: {', '.join(by_name)}")
        cells = [by_name[n] for n in args.cells.split(",")]
    elif args.rotate:
        # Over the cells of the declared range only: the others are documented as not
        # passing (docs/compatibility.md), and CI must pass.
        cells = [c for c in cells if declared(c.celery)]
        cells = [cells[datetime.date.today().timetuple().tm_yday % len(cells)]]
    args.cache.mkdir(parents=True, exist_ok=True)
    outcomes = []
    for cell in cells:
        outcome = run_cell(cell, args.cache, full=args.full, short=args.short)
        outcomes.append(outcome)
        print(f"[matrix] {cell.name}: {outcome.result}", flush=True)
        with (args.cache / "results.jsonl").open("a") as out:
            record = {"at": time.time(), "cell": cell.name, "full": args.full, "short": args.short}
            record |= {k: getattr(outcome, k) for k in ("result", "celery", "kombu", "python")}
            out.write(json.dumps({**record, "seconds": outcome.seconds}) + "\n")
    print(table(outcomes, markdown=args.markdown))
    for outcome in outcomes:
        if outcome.result.startswith("NOT TESTED"):
            print(f"[matrix] WARNING: {outcome.cell.name} was NOT TESTED: {outcome.result}")
    return 1 if any(o.failed for o in outcomes) else 0


if __name__ == "__main__":
    sys.exit(main())
