"""Flower showing celery-baton's decisions: the screenshots in docs/operations.md.

Starts its own redis-server, a worker of ``tests.apps.events`` with ``-E`` and Flower,
publishes one task per decision (held, skipped, superseded, debounced, throttled),
and saves Flower's task list and a skipped task's page from headless Chromium::

    pip install -e '.[embedded]' flower selenium    # a virtualenv of its own
    python examples/flower/screenshots.py docs/img

Needs ``redis-server``, ``chromium`` and ``chromedriver`` on PATH; run it from the
repository's root. Everything it starts is stopped at the end.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def wait_http(url: str, timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            urllib.request.urlopen(url, timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


def publish(ids: dict[str, str]) -> None:
    """One task per decision; the ids of the held and the skipped one go in ``ids``."""
    from tests.apps.events import fetch, latest, notify, save, skip_busy, wait_turn

    wait_turn.delay("report-42", 60)  # holds the key for a minute
    time.sleep(0.5)
    ids["held"] = wait_turn.delay("report-42", 0).id  # waits for it
    skip_busy.delay("feed-7", 60)
    time.sleep(0.5)
    ids["skipped"] = skip_busy.delay("feed-7", 0).id  # a duplicate: skipped
    latest.delay("doc-3", 1, 3)
    time.sleep(0.3)
    latest.delay("doc-3", 2)  # superseded by the next one
    time.sleep(0.3)
    latest.delay("doc-3", 3)
    for n in range(3):
        save.delay("doc-9", n)  # the first two are debounced
    notify.delay("alice", 1)
    time.sleep(1)
    notify.delay("alice", 2)  # throttled
    fetch.delay("api.example.com")
    fetch.delay("api.example.com")  # held by the rate, then admitted


def screenshots(base: str, out: Path, skipped: str) -> None:
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    for arg in ("--headless=new", "--no-sandbox", "--disable-gpu", "--window-size=1900,1250"):
        options.add_argument(arg)
    options.binary_location = shutil.which("chromium") or "chromium"
    service = Service(shutil.which("chromedriver") or "chromedriver")
    driver = webdriver.Chrome(service=service, options=options)
    try:
        driver.get(f"{base}/tasks")
        time.sleep(3)
        driver.save_screenshot(str(out / "flower-tasks.png"))
        driver.get(f"{base}/task/{skipped}")
        time.sleep(2)
        driver.save_screenshot(str(out / "flower-skipped-task.png"))
    finally:
        driver.quit()


def main() -> None:
    out = Path(sys.argv[1] if len(sys.argv) > 1 else "docs/img").resolve()
    out.mkdir(parents=True, exist_ok=True)
    port, flower_port = free_port(), free_port()
    url = f"redis://127.0.0.1:{port}"
    os.environ.update(
        TEST_BROKER_URL=f"{url}/0",
        TEST_RESULT_URL=f"{url}/1",
        BATON_URL=f"{url}/2",
        PYTHONPATH=os.pathsep.join([os.getcwd(), os.environ.get("PYTHONPATH", "")]),
    )
    sys.path.insert(0, os.getcwd())
    started: list[subprocess.Popen[bytes]] = []
    logs = subprocess.DEVNULL
    try:
        redis_cmd = ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", ""]
        started.append(subprocess.Popen(redis_cmd, stdout=logs))
        time.sleep(0.5)
        # A new store, declared so: no grace before the first lease.
        subprocess.run(
            ["redis-cli", "-p", str(port), "-n", "2", "set", "baton:epoch", "0"], stdout=logs
        )
        celery = [sys.executable, "-m", "celery", "-A", "tests.apps.events"]
        worker = ["worker", "-E", "-c", "6", "--hostname", "feeds@host1", "--without-mingle"]
        started.append(subprocess.Popen([*celery, *worker], stdout=logs, stderr=logs))
        flower = [
            "flower",
            "--address=127.0.0.1",
            f"--port={flower_port}",
            "--tasks_columns=name,uuid,state,args,received,worker,exception",
        ]
        started.append(subprocess.Popen([*celery, *flower], stdout=logs, stderr=logs))
        base = f"http://127.0.0.1:{flower_port}"
        wait_http(f"{base}/tasks")
        time.sleep(3)  # the worker is up and Flower listens to its events
        ids: dict[str, str] = {}
        publish(ids)
        time.sleep(5)
        screenshots(base, out, ids["skipped"])
        print(f"saved {out}/flower-tasks.png and {out}/flower-skipped-task.png")
    finally:
        for process in reversed(started):
            # SIGQUIT: Celery's cold shutdown, which ends the pool's processes too.
            process.send_signal(signal.SIGQUIT)
            try:
                process.wait(15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


if __name__ == "__main__":
    main()
