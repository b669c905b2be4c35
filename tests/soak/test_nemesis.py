"""The short nemesis soak: about two minutes of faults against real workers and beats.

``SOAK_SEED`` replays a seed (default: a new one each run, printed and named in the
failure message); ``SOAK_SECONDS`` sets the length of the fault phase (default 100 s);
``SOAK_STRICT=1`` injects every fault (the broker's SIGKILL restart too) and tolerates no
finding, as the long form does.
The long form is ``python -m tests.soak.nemesis --minutes 30`` (docs/soak.md).

Two edge windows the checker cannot yet tell from a bug of ours are open (issue 11):

* on a broker SIGKILL restart, Celery 5.7's consumer can die with kombu's
  ``AttributeError("'NoneType' object has no attribute 'hostname'")`` in its reconnect
  path; a run that ends in a worker dying that way is not recorded (its release and done
  marker go with it), so its copy may run again. The short form leaves that fault out;
  the long form keeps it, and the worker tests restart the broker under a worker
  (tests/worker/test_exclusive_faults.py);
* a worker SIGKILLed in the milliseconds between a unique run's ack and the release of
  its claim leaves the claim to a finished task (publishes are deduplicated into it).

So the short form holds every guarantee exactly, and tolerates a few accounting
findings (``ACCOUNTING_TOLERANCE`` of what was sent, printed): losing messages for real
loses many, not one holder's handful. A worker that dies by itself is recorded as a
``worker_crash`` fault, restarted, and its runs judged as a killed worker's; the summary
counts such crashes (a Celery/kombu bug to report, not a verdict on celery-baton).
"""

from __future__ import annotations

import os
import random
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.soak.nemesis import SoakConfig, soak

#: The fault mix of the short form (see the module's docstring).
WEIGHTS = {**SoakConfig(seed=0).weights, "restart_broker": 0.0}
#: Accounting findings tolerated, as a share of the publishes sent (see above).
ACCOUNTING_TOLERANCE = 0.02


@pytest.mark.soak
@pytest.mark.timeout(420)
def test_nemesis_soak() -> None:
    seed = int(os.environ.get("SOAK_SEED") or random.SystemRandom().randrange(1 << 30))
    seconds = float(os.environ.get("SOAK_SECONDS", "100"))
    strict = os.environ.get("SOAK_STRICT", "") not in ("", "0")
    weights = SoakConfig(seed=0).weights if strict else WEIGHTS
    tolerance = 0.0 if strict else ACCOUNTING_TOLERANCE
    print(
        f"nemesis soak seed={seed} (replay: SOAK_SEED={seed}"
        + (" SOAK_STRICT=1): every fault, no tolerance" if strict else ")")
    )
    # Logs outside pytest's rotating temporary directories: a failure's post-mortem needs them.
    logs = Path(tempfile.mkdtemp(prefix=f"baton-soak-{seed}-"))
    # The soak points this process's app at its own servers through os.environ; tests
    # after it must see the session's URLs again (their app modules read them on import).
    saved = dict(os.environ)
    try:
        report = soak(
            SoakConfig(
                seed=seed, fault_seconds=seconds, drain_seconds=45, log_dir=logs, weights=weights
            )
        )
    finally:
        os.environ.clear()
        os.environ.update(saved)
    print(report.summary())
    failed = report.failed_checks()
    if failed == ["accounting"]:
        sent = report.counts.get("published sent", 0)
        found = len(report.violations["accounting"])
        print(f"accounting: {found} finding(s) of {sent} sent (edge windows, issue 11)")
        failed = [] if found <= tolerance * sent else failed
    assert not failed, f"seed={seed}, logs in {logs}\n{report.summary()}"
    shutil.rmtree(logs, ignore_errors=True)
