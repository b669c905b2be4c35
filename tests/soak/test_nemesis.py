"""The short nemesis soak: about two minutes of faults against real workers and beats.

``SOAK_SEED`` replays a seed (default: a new one each run, printed and named in the
failure message); ``SOAK_SECONDS`` sets the length of the fault phase (default 40 s in
the suite's run, 100 s with ``BATON_FULL=1``: tests/support/sizes.py);
``SOAK_PROFILES`` the worker profiles the workers take in turn (default: the prefork
ones of tests.soak.machines: prefork, recycling, autoscale, time limits; ``threads`` and
``gevent`` too with the long form's ``--profiles all``).
Every fault of the long form is injected (the broker's SIGKILL restart too) and no
finding is tolerated: the checker's known windows (docs/soak.md) are the only runs it
excuses, each with its recorded reason. The workload is the deployment's, not a tidy
one (issue 24): prefetch as Celery ships it, plain ``busy`` tasks in surges that take
every pool process, a store never declared new; the rate is judged at the runs' starts.
A worker that dies by itself is recorded as a
``worker_crash`` fault, restarted, and its runs judged as a killed worker's; the summary
counts such crashes: not a verdict on the guarantees, but each one is a bug to find
(docs/soak.md).
The long form is ``python -m tests.soak.nemesis --minutes 30`` (docs/soak.md).
"""

from __future__ import annotations

import os
import random
import re
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.soak.checks.history import Report
from tests.soak.machines import PREFORK_PROFILES
from tests.soak.nemesis import SoakConfig, soak
from tests.support.sizes import sized


@pytest.mark.soak
@pytest.mark.timeout(420)
# The checker reads hundreds of results through Celery's Redis result backend in this
# process; a connection of its pool collected unclosed (seen once, on a loaded machine)
# is the harness's, not the library's: the soak's verdict is the checker's.
@pytest.mark.filterwarnings(
    "ignore:Exception ignored in. <socket.socket:pytest.PytestUnraisableExceptionWarning"
)
def test_nemesis_soak() -> None:
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    seconds = float(os.environ.get("SOAK_SECONDS") or sized(40, 100))
    # The workers take in turn the ways the prefork pool runs (SOAK_PROFILES: a list).
    profiles = os.environ.get("SOAK_PROFILES", ",".join(PREFORK_PROFILES)).split(",")
    print(f"nemesis soak seed={seed} (replay: SOAK_SEED={seed})")
    # Logs outside pytest's rotating temporary directories: a failure's post-mortem needs them.
    logs = Path(tempfile.mkdtemp(prefix=f"baton-soak-{seed}-"))
    # The soak points this process's app at its own servers through os.environ; tests
    # after it must see the session's URLs again (their app modules read them on import).
    saved = dict(os.environ)
    try:
        config = SoakConfig(
            seed=seed,
            fault_seconds=seconds,
            drain_seconds=45,
            log_dir=logs,
            profiles=tuple(profiles),
        )
        report = soak(config)
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(report.summary())
    failed = report.failed_checks()
    assert not failed, f"seed={seed}, logs in {logs}\n{report.summary()}\n{_traces(report, logs)}"
    shutil.rmtree(logs, ignore_errors=True)


_TASK_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")


def _traces(report: Report, logs: Path, per_id: int = 12) -> str:
    """Every log line of the soak's processes that names a task id of a violation: a
    CI run's temporary directory is gone when its output is read, and a rare finding
    must be explained from what it printed."""
    ids = {
        m for found in report.violations.values() for line in found for m in _TASK_ID.findall(line)
    }
    files = sorted(logs.rglob("*.log"))
    out = []
    for task_id in sorted(ids)[:10]:
        lines = [
            f"  {path.relative_to(logs)}: {line.rstrip()[:300]}"
            for path in files
            for line in path.read_text(errors="replace").splitlines()
            if task_id in line
        ]
        out.append(f"{task_id}: {len(lines)} log lines" + "".join(f"\n{x}" for x in lines[:per_id]))
    return "\n".join(out)
