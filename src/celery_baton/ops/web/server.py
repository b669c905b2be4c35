"""``celery -A proj baton web``: the HTTP side of the store-wide view for operators.

Standard library only. ``/`` is the page (``page.py``), ``/api/state`` the same data as
JSON (the read model, ``ops/state.py``), ``/metrics`` Prometheus' text (``metrics.py``).
The actions of the CLI (``actions.py``) are POSTs that need the token given to the
server (``--token`` or ``$BATON_WEB_TOKEN``): without it the page is read-only, and a
missing or wrong token is answered 403. When the store does not answer, the page shows
the last state read under a banner, and keeps refreshing until it is back.

Celery-free: the server reads through a :class:`~celery_baton.ops.state.Source` (the
CLI's ``Context``) and a :class:`~celery_baton.ops.state.Schedules` (``ScheduleStore``)::

    serve(Context(app), ScheduleStore(app), host="127.0.0.1", port=8765, token="s3cret")
"""

from __future__ import annotations

import hmac
import json
import logging
import re
import time
from collections.abc import Callable, Mapping
from http import HTTPStatus
from http.cookies import SimpleCookie
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlencode, urlsplit

from celery_baton.errors import BatonError
from celery_baton.ops.state import Schedules, Source, collect, empty_state
from celery_baton.ops.web.actions import CancelAction, Refused, act
from celery_baton.ops.web.metrics import metrics_text
from celery_baton.ops.web.page import forbidden_page, render_page

logger = logging.getLogger("celery_baton.ops.web")

COOKIE = "baton_token"
TOKEN_CHARS = re.compile(r"[A-Za-z0-9._~+/=-]+")  # what `secrets.token_urlsafe()` makes


class WebServer(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(
        self,
        address: tuple[str, int],
        source: Source,
        schedules: Schedules,
        *,
        token: str | None,
        refresh: float = 5.0,
        cancel: CancelAction | None = None,
    ) -> None:
        super().__init__(address, _Handler)
        self.source, self.schedules = source, schedules
        self.cancel = cancel
        self.token, self.refresh = token or None, refresh
        # What the store held when it last answered, and since when it does not.
        self.last_state: dict[str, Any] | None = None
        self.down_since: float | None = None

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        return f"http://{host!s}:{port}/"

    def state(self) -> dict[str, Any]:
        try:
            state = collect(self.source, self.schedules)
        except BatonError:
            if self.down_since is None:
                self.down_since = time.time()
                logger.warning("web: the store does not answer; the page says so")
            raise
        if self.down_since is not None:
            logger.warning("web: the store answers again")
        self.last_state, self.down_since = state, None
        return state

    def outage(self, exc: BatonError) -> tuple[dict[str, Any], str]:
        """The state to show while the store is down (the last one read, or an empty
        one), and what the banner says."""
        since = time.strftime("%H:%M:%SZ", time.gmtime(self.down_since or time.time()))
        state = self.last_state
        shown = f"what it held at {state['time']}" if state else "nothing (none read yet)"
        if state is None:
            state = empty_state(self.source.store.safe_url)
        text = (
            f"store unavailable since {since}: {exc}. Showing {shown}; this page "
            f"refreshes every {self.refresh:g}s and shows the store again once it answers."
        )
        return state, text


class _Handler(BaseHTTPRequestHandler):
    server: WebServer
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args: Any) -> None:
        logger.info("%s %s", self.address_string(), format % args)

    # -- routing

    def do_GET(self) -> None:
        url = urlsplit(self.path)
        routes: dict[str, Callable[[], None]] = {
            "/": lambda: self._page(parse_qs(url.query)),
            "/api/state": lambda: self._json(HTTPStatus.OK, self._state()),
            "/metrics": self._metrics,
        }
        route = routes.get(url.path)
        if route is None:
            self._send(HTTPStatus.NOT_FOUND, "text/plain", "not found\n")
            return
        try:
            route()
        except BatonError as exc:  # the store went away: say so, keep serving
            if url.path == "/":
                self._page(parse_qs(url.query), down=exc)
            elif url.path == "/metrics":
                self._send(HTTPStatus.OK, "text/plain; version=0.0.4", metrics_text(None))
            else:
                self._json(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})

    def do_POST(self) -> None:
        path = urlsplit(self.path).path
        form = self._form()
        if path == "/login":
            if not self._valid(form.get("token")):
                self._forbidden(form.get("token"), path)
                return
            self._redirect("/", cookie=f"{COOKIE}={form['token']}")
            return
        if path == "/logout":
            self._redirect("/", cookie=f"{COOKIE}=; Max-Age=0")
            return
        if path not in ("/action", "/api/action"):
            self._send(HTTPStatus.NOT_FOUND, "text/plain", "not found\n")
            return
        if not self._valid(self._token(form)):
            self._forbidden(self._token(form), path)
            return
        try:
            done = act(self.server.source, self.server.schedules, form, self.server.cancel)
        except Refused as exc:
            logger.warning("web: %s refused: %s", form.get("action"), exc)
            if path == "/api/action":
                self._json(HTTPStatus.CONFLICT, {"ok": False, "error": str(exc)})
            else:
                self._redirect("/?" + urlencode({"error": str(exc)}))
            return
        logger.warning("web: %s by %s", done, self.address_string())
        if path == "/api/action":
            self._json(HTTPStatus.OK, {"ok": True, "done": done})
        else:
            self._redirect("/?" + urlencode({"note": done}))

    # -- pages

    def _state(self) -> dict[str, Any]:
        return self.server.state()

    def _page(self, query: Mapping[str, list[str]], down: BatonError | None = None) -> None:
        state, outage = self.server.outage(down) if down else (self._state(), "")
        body = render_page(
            state,
            actions=self.server.token is not None,
            signed_in=self._valid(self._cookie()),
            refresh=self.server.refresh,
            note=query.get("note", [""])[0],
            error=query.get("error", [""])[0],
            outage=outage,
        )
        # A page still (it refreshes itself), with the status a probe understands.
        status = HTTPStatus.SERVICE_UNAVAILABLE if down else HTTPStatus.OK
        self._send(status, "text/html; charset=utf-8", body)

    def _metrics(self) -> None:
        self._send(HTTPStatus.OK, "text/plain; version=0.0.4", metrics_text(self._state()))

    # -- the token

    def _valid(self, given: str | None) -> bool:
        expected = self.server.token
        if expected is None or not given:
            return False
        return hmac.compare_digest(given.encode(), expected.encode())

    def _token(self, form: Mapping[str, str]) -> str | None:
        auth = self.headers.get("Authorization", "")
        if auth.startswith("Bearer "):
            return auth[len("Bearer ") :]
        return form.get("token") or self._cookie()

    def _cookie(self) -> str | None:
        cookie = SimpleCookie(self.headers.get("Cookie", ""))
        morsel = cookie.get(COOKIE)
        return morsel.value if morsel is not None and morsel.value else None

    def _forbidden(self, given: str | None, path: str) -> None:
        if self.server.token is None:
            why = "actions are disabled: the server was started without a token"
        elif given:
            # Someone tried a token: the operator must be able to see it (and how often).
            logger.warning("web: wrong token from %s on %s", self.address_string(), path)
            why = "wrong token: it is not the one this server was started with"
        elif path.startswith("/api/"):
            why = (
                "the token is missing: send the one `baton web` was started with as "
                "`Authorization: Bearer TOKEN`"
            )
        else:
            why = "this needs the server's token: sign in on the page first"
        if path.startswith("/api/"):
            self._json(HTTPStatus.FORBIDDEN, {"ok": False, "error": why})
            return
        self._send(HTTPStatus.FORBIDDEN, "text/html; charset=utf-8", forbidden_page(why))

    # -- plumbing

    def _form(self) -> dict[str, str]:
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(min(length, 64 * 1024)).decode("utf-8", "replace")
        if self.headers.get("Content-Type", "").startswith("application/json"):
            try:
                data = json.loads(raw or "{}")
            except ValueError:
                return {}
            return {str(k): str(v) for k, v in data.items()} if isinstance(data, dict) else {}
        return {k: v[0] for k, v in parse_qs(raw).items()}

    def _redirect(self, location: str, cookie: str | None = None) -> None:
        self.send_response(HTTPStatus.SEE_OTHER)
        self.send_header("Location", location)
        if cookie is not None:
            # SameSite=Strict: another site's page cannot make this browser post an action.
            self.send_header("Set-Cookie", f"{cookie}; Path=/; HttpOnly; SameSite=Strict")
        self.send_header("Content-Length", "0")
        self.end_headers()

    def _json(self, status: HTTPStatus, data: Any) -> None:
        self._send(status, "application/json", json.dumps(data, default=str))

    def _send(self, status: HTTPStatus, content_type: str, body: str) -> None:
        raw = body.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(raw)))
        self.send_header("Cache-Control", "no-store")
        self.end_headers()
        self.wfile.write(raw)


def serve(
    source: Source,
    schedules: Schedules,
    *,
    host: str = "127.0.0.1",
    port: int = 8765,
    token: str | None = None,
    refresh: float = 5.0,
    ready: Callable[[WebServer], None] | None = None,
    cancel: CancelAction | None = None,
) -> None:
    """Serve the page until interrupted (``ready`` is called once it listens)."""
    if token is not None and not TOKEN_CHARS.fullmatch(token):
        # It travels in a cookie, which cannot carry spaces, quotes or semicolons.
        raise ValueError("the token may use letters, digits and . _ ~ + / = - only")
    server = WebServer((host, port), source, schedules, token=token, refresh=refresh, cancel=cancel)
    try:
        if ready is not None:
            ready(server)
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
