"""A running ``celery -A app baton web`` process and a client of its HTTP side, for the
web view's tests (tests/ops/test_web_http.py, tests/ops/test_web_browser.py; their
fixtures ``web_server`` and ``browser`` are in tests/ops/conftest.py)."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from tests.support.celery_processes import _process_env
from tests.support.processes import REPO_ROOT
from tests.support.servers import free_port
from tests.support.waiting import wait_until
from tests.support.workers import Workers

APP = "tests.apps.exclusive"
TOKEN = "s3cret-token"


class Web:
    """A running ``celery -A app baton web`` process and a client of its HTTP side."""

    def __init__(
        self, workers: Workers, app: str, token: str | None, log: Path, refresh: float = 60
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {k: v for k, v in workers.env.items() if k != "BATON_WEB_TOKEN"}
        if token is not None:
            env["BATON_WEB_TOKEN"] = token  # the documented way to pass it
        self.log = log
        # A slow refresh: the page must not reload under the browser's clicks.
        command = ["-A", app, "baton", "web", "--port", str(self.port), "--refresh", f"{refresh:g}"]
        with log.open("wb") as out:  # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "celery", *command],
                env=_process_env(env),
                cwd=REPO_ROOT,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
        wait_until(self._up, timeout=30, what=f"baton web on {self.port}; log: {log}")

    def _up(self) -> bool:
        assert self.proc.poll() is None, self.log.read_text()
        try:
            self.get("/api/state")
        except (urllib.error.URLError, ConnectionError):
            return False
        return True

    def get(self, path: str) -> str:
        with urllib.request.urlopen(self.url + path, timeout=10) as reply:
            text: str = reply.read().decode()
            return text

    def fetch(self, path: str) -> tuple[int, str, str]:
        """(status, content type, body), whatever the status."""
        try:
            with urllib.request.urlopen(self.url + path, timeout=10) as reply:
                return reply.status, reply.headers["Content-Type"], reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.headers["Content-Type"], exc.read().decode()

    def state(self) -> Any:
        return json.loads(self.get("/api/state"))

    def post(self, path: str, form: dict[str, str], token: str | None = None) -> tuple[int, str]:
        headers = {"Authorization": f"Bearer {token}"} if token is not None else {}
        request = urllib.request.Request(
            self.url + path, data=urllib.parse.urlencode(form).encode(), headers=headers
        )
        try:
            with urllib.request.urlopen(request, timeout=10) as reply:
                return reply.status, reply.read().decode()
        except urllib.error.HTTPError as exc:
            return exc.code, exc.read().decode()

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
