"""Celery's own integration suite, plain and with celery-baton installed; the differences.

    python tests/celery_suite/run.py            # the subset (tasks, canvas, replace,
                                                # chords, errbacks, signals)
    python tests/celery_suite/run.py --full     # t/integration/test_tasks.py and
                                                # test_canvas.py whole
    python tests/celery_suite/run.py -k 'replace' --modes plain,guard
    python tests/celery_suite/run.py --others   # the other files of t/integration
                                                # (beat, connection recovery, inspect...)

Takes ``t/`` from the sdist of the Celery version installed (``pip download --no-binary
:all: --no-deps celery==X``, cached in ``--cache``; never copied into this repository)
and runs the selected tests three ways, each against fresh servers it starts on free
ports (broker and result backend on one ``redis-server``, celery-baton's store on
another): ``plain``; ``defaults`` (``Baton(app)``); ``guard`` (also
``baton_redelivery_guard`` and ``baton_global_rate_limits``). celery-baton is installed
into the suite's apps by the pytest plugin beside this file
(``celery_baton_suite_plugin.py``). The store is declared new before each run (``celery
baton end-grace``), as an operator does for a new store.

Prints passed/failed/skipped and the time of each run, and every test whose outcome
differs from the plain run; exits 1 when a test fails (or is missing) with celery-baton
that did not fail plain, else 0.
Needs the ``suite`` extra (``pip install -e '.[suite]'``): Celery's integration tests
import pydantic, and mark flaky tests for pytest-rerunfailures.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import os
import subprocess
import sys
import tarfile
import tempfile
import time
import xml.etree.ElementTree as ET
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
if str(REPO) not in sys.path:  # tests.support, when run as a script
    sys.path.insert(0, str(REPO))

from tests.support.servers import StoreServer  # noqa: E402

MODES = ("plain", "defaults", "guard")
FULL = ("t/integration/test_tasks.py", "t/integration/test_canvas.py")
#: The subset: tasks, canvas, replace, chords, errbacks and signals (-k on FULL), 110
#: tests. Without test_replaced_task_nesting_level_0, a timing flake of the suite (its
#: task_received handler keeps the last task received, which may be a replacement
#: still arriving from the test before): it failed once plain, once with Baton(app).
SUBSET = (
    "(replace or errback or link_error or signal or received or frozen or reapplying "
    "or retry or stamp) and not test_replaced_task_nesting_level_0"
)
#: The files of t/integration beyond FULL (issue 39 §6): 106 tests on Celery 5.7.0,
#: ~9 minutes a run. Those here take seconds (~30 s together) and run with the subset
#: (CI's run); ``--others`` runs them all.
QUICK_OTHERS = (
    "t/integration/test_connection_recovery.py",
    "t/integration/test_database_backend.py",
    "t/integration/test_loader.py",
    "t/integration/test_logfile_format.py",
    "t/integration/test_request_backend_down.py",
)
PER_TEST_TIMEOUT = 300  # seconds (the suite's own flaky tests say 300 too)


@dataclass
class Run:
    mode: str
    seconds: float
    outcomes: dict[str, str] = field(default_factory=dict)  # test id -> outcome
    returncode: int = 0

    def count(self, outcome: str) -> int:
        return sum(1 for o in self.outcomes.values() if o == outcome)


def sdist_tests(version: str, cache: Path) -> Path:
    """The directory holding Celery ``version``'s ``t/`` (and its pytest settings),
    downloaded and extracted once into ``cache``."""
    root = cache / f"celery-{version}"
    if (root / "t" / "integration").is_dir():
        return root
    cache.mkdir(parents=True, exist_ok=True)
    archive = cache / f"celery-{version}.tar.gz"
    if not archive.exists():
        print(f"downloading the sdist of celery {version}", flush=True)
        download = [sys.executable, "-m", "pip", "download", "--no-binary", ":all:"]
        download += ["--no-deps", f"celery=={version}", "-d", str(cache)]
        subprocess.run(download, check=True)
    prefix = f"celery-{version}/"
    with tarfile.open(archive) as tar:
        # Only the tests and the pytest settings: the sdist's `celery/` package must not
        # shadow the installed Celery under test.
        wanted = [
            m
            for m in tar.getmembers()
            if m.name.startswith(prefix + "t/") or m.name == prefix + "pyproject.toml"
        ]
        if hasattr(tarfile, "data_filter"):  # Python 3.12, and 3.10.12 / 3.11.4 on
            tar.extractall(cache, members=wanted, filter="data")
        else:
            tar.extractall(cache, members=wanted)
    return root


def others(root: Path) -> list[str]:
    """Every test file of ``t/integration`` but FULL's, as paths relative to ``root``."""
    found = sorted((root / "t" / "integration").glob("test_*.py"))
    return [str(f.relative_to(root)) for f in found if str(f.relative_to(root)) not in FULL]


def run_mode(mode: str, root: Path, selection: list[str], results: Path, *, verbose: bool) -> Run:
    """One run of the selection with fresh servers; its outcomes from the JUnit XML."""
    broker = StoreServer(name="suite-broker", persistent=False)
    store = StoreServer(name="suite-store", persistent=False)
    try:
        broker.start()
        store.start()
        _declare_new(store.url(0))
        env = {
            **os.environ,
            "TEST_BROKER": broker.url(0),
            "TEST_BACKEND": broker.url(0),
            "REDIS_HOST": "127.0.0.1",
            "REDIS_PORT": str(broker.port),
            "BATON_URL": store.url(0),
            "CELERY_BATON_SUITE": mode,
            "PYTHONPATH": os.pathsep.join(
                [str(HERE), str(REPO / "src"), os.environ.get("PYTHONPATH", "")]
            ),
        }
        xml = results / f"{mode}.xml"
        log = results / f"{mode}.log"
        cmd = [
            sys.executable, "-m", "pytest", "-p", "celery_baton_suite_plugin",
            "-p", "no:cacheprovider", "-o", f"timeout={PER_TEST_TIMEOUT}",
            "--junitxml", str(xml), "-q", "-rfE", *selection,
        ]  # fmt: skip
        print(f"[{mode}] {' '.join(cmd[3:])}", flush=True)
        started = time.monotonic()
        with open(log, "w") as out:
            proc = subprocess.run(
                cmd, cwd=root, env=env, stdout=None if verbose else out, stderr=subprocess.STDOUT
            )
        run = Run(mode, time.monotonic() - started, returncode=proc.returncode)
        run.outcomes = _outcomes(xml)
        return run
    finally:
        broker.close()
        store.close()


def _declare_new(url: str) -> None:
    """``celery baton end-grace``: the store is new, its first leases need no grace."""
    from celery_baton.store.connection import connect
    from celery_baton.store.inspect import end_grace

    store = connect(url)
    try:
        end_grace(store, "baton")
    finally:
        store.client.close()


def _outcomes(xml: Path) -> dict[str, str]:
    outcomes: dict[str, str] = {}
    if not xml.exists():
        return outcomes
    for case in ET.parse(xml).getroot().iter("testcase"):
        name = f"{case.get('classname', '')}::{case.get('name', '')}"
        outcome = "passed"
        for child in case:
            if child.tag in ("failure", "error"):
                outcome = "failed"
            elif child.tag == "skipped" and outcome == "passed":
                outcome = "skipped"
        # A test can be reported twice (a failure in its teardown): the worse counts.
        if outcomes.get(name) != "failed":
            outcomes[name] = outcome
    return outcomes


def report(runs: list[Run]) -> int:
    """Print the table and the differences from the first run; 1 if any."""
    base = runs[0]
    print(f"\n{'mode':<10}{'passed':>8}{'failed':>8}{'skipped':>9}{'time':>10}{'x plain':>9}")
    for run in runs:
        ratio = run.seconds / base.seconds if base.seconds else 0.0
        print(
            f"{run.mode:<10}{run.count('passed'):>8}{run.count('failed'):>8}"
            f"{run.count('skipped'):>9}{run.seconds:>9.0f}s{ratio:>8.2f}x"
        )
    worse = 0
    for run in runs[1:]:
        names = sorted(set(base.outcomes) | set(run.outcomes))
        changed = [
            (n, base.outcomes.get(n, "absent"), run.outcomes.get(n, "absent"))
            for n in names
            if base.outcomes.get(n, "absent") != run.outcomes.get(n, "absent")
        ]
        # Worse: failed (or missing) where the plain run did not fail. A test that fails
        # plain and passes here is printed, not counted (the suite has timing flakes).
        bad = ("failed", "absent")
        worse += sum(1 for _, was, now in changed if now in bad and was not in bad)
        print(f"\n{run.mode}: {len(changed)} test(s) differ from {base.mode}")
        for name, was, now in changed:
            print(f"  {name}: {was} -> {now}")
    for run in runs:
        if not run.outcomes:
            print(f"\n{run.mode}: no results (exit code {run.returncode}); see its log")
            worse += 1
    return 1 if worse else 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--full", action="store_true", help="the whole of " + " and ".join(FULL))
    parser.add_argument(
        "--others",
        action="store_true",
        help="the other files of t/integration (beat, connection recovery, inspect, ...)",
    )
    parser.add_argument(
        "--files", nargs="+", help="these files of t/ instead of " + FULL[0] + "..."
    )
    parser.add_argument("-k", dest="keyword", help="a pytest -k expression instead of the subset")
    parser.add_argument("--modes", default=",".join(MODES), help="comma-separated, plain first")
    parser.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache"))
        / "celery-baton"
        / "celery-suite",
        help="where the sdist is downloaded and extracted",
    )
    parser.add_argument("--results", type=Path, help="where logs and JUnit XML go")
    parser.add_argument("--verbose", action="store_true", help="pytest's output to the terminal")
    args = parser.parse_args(argv)

    modes = args.modes.split(",")
    if bad := [m for m in modes if m not in MODES]:
        parser.error(f"unknown mode(s) {bad}: choose from {MODES}")
    version = importlib.metadata.version("celery")
    root = sdist_tests(version, args.cache)
    selection = list(args.files or FULL)
    if args.others:
        selection = others(root)
    if args.keyword:
        selection += ["-k", args.keyword]
    elif not (args.full or args.others or args.files):
        # The subset, and the quick files of the others whole.
        selection += QUICK_OTHERS
        quick = " or ".join(Path(f).stem for f in QUICK_OTHERS)
        selection += ["-k", f"({SUBSET}) or {quick}"]
    results = args.results or Path(tempfile.mkdtemp(prefix="celery-suite-"))
    results.mkdir(parents=True, exist_ok=True)
    print(f"celery {version}: tests from {root}; logs and results in {results}", flush=True)
    runs = [run_mode(m, root, selection, results, verbose=args.verbose) for m in modes]
    return report(runs)


if __name__ == "__main__":
    sys.exit(main())
