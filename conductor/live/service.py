"""``conductor serve``: the live Conductor as an HTTP/JSON service.

Endpoints (one JSON object per request and reply):

* ``POST /generate`` ``{"token_ids": [...], "max_new_tokens": N, "use_cache": true}``:
  200 with ``{"tokens", "ttft_s", "tbt_s", "cached_tokens", "prefill", "decode", ...}``;
  429 with ``{"rejected": true, "reason": ...}`` when no worker pair can meet the SLOs
  (decided before any work is done); 400 for a malformed request; 502 if a worker failed.
  A turn of a session names it by the ``X-Session-Affinity`` header or a ``session_id``
  field (``conductor.live.runner``, "Sessions").
* ``DELETE /v1/sessions/{id}``: ends a session (its blocks released to ordinary
  eviction): 200 ``{"id", "object": "session.deleted", "deleted": true}``, or 404 with an
  OpenAI-shaped error for a session not known here.
* ``GET /health``: every worker's status, the scheduler's queue estimates and the
  sessions' counts.

Sessions idle past the TTL are released by a sweep once a second (``SWEEP_S``).

The same shape of server as the workers' (``ThreadingHTTPServer``): one thread per
request, SIGTERM lets requests in flight finish.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.error import HTTPError, URLError
from urllib.parse import quote, unquote
from urllib.request import Request as UrlRequest
from urllib.request import urlopen

from conductor.front.openai_api import error_body
from conductor.front.session_cache import SESSION_FIELD, SESSION_HEADER, session_of_request
from conductor.live.runner import LiveConductor
from workers.client import WorkerError

log = logging.getLogger("conductor.live.service")
MAX_BODY = 64 << 20
SWEEP_S = 1.0
SESSIONS_PATH = "/v1/sessions/"


class ConductorService:
    def __init__(self, live: LiveConductor, *, listen: str) -> None:
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise ValueError(f"listen address must be HOST:PORT, got {listen!r}")
        self.live = live
        handler = type("Handler", (_Handler,), {"live": live})
        self.httpd = ThreadingHTTPServer((host, int(port)), handler)
        self.httpd.daemon_threads = False  # stop() waits for requests in flight
        self.addr = f"{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True,
                                        name="conductor-http")
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, daemon=True,
                                         name="conductor-sessions")

    def start(self) -> None:
        self._thread.start()
        if self.live.session_cache.enabled:
            self._sweeper.start()

    def stop(self) -> None:
        self._stop.set()
        self.httpd.shutdown()
        self.httpd.server_close()  # joins the request threads
        self._thread.join()
        if self._sweeper.is_alive():
            self._sweeper.join()
        self.live.close()

    def _sweep(self) -> None:
        while not self._stop.wait(SWEEP_S):
            self.live.session_cache.sweep()


class _Handler(BaseHTTPRequestHandler):
    live: LiveConductor
    protocol_version = "HTTP/1.0"

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("%s " + format, self.address_string(), *args)

    def _reply(self, status: int, body: dict[str, Any]) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:
        if self.path != "/health":
            self._reply(404, {"error": f"no such endpoint: GET {self.path}"})
            return
        self._reply(200, {"ok": True, **self.live.status()})

    def do_POST(self) -> None:
        if self.path != "/generate":
            self._reply(404, {"error": f"no such endpoint: POST {self.path}"})
            return
        try:
            body = self._body()
            tokens = body.get("token_ids")
            if (not isinstance(tokens, list) or not tokens
                    or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0
                               for t in tokens)):
                raise ValueError("token_ids must be a non-empty list of non-negative integers")
            n = body.get("max_new_tokens", 16)
            if not isinstance(n, int) or isinstance(n, bool) or n < 1:
                raise ValueError("max_new_tokens must be a positive integer")
            use_cache = body.get("use_cache", True)
            if not isinstance(use_cache, bool):
                raise ValueError("use_cache must be true or false")
            unknown = set(body) - {"token_ids", "max_new_tokens", "use_cache", SESSION_FIELD}
            if unknown:
                raise ValueError(f"unknown fields: {sorted(unknown)}")
            session = session_of_request(self.headers.get(SESSION_HEADER), body)
        except ValueError as exc:
            self._reply(400, {"error": str(exc)})
            return
        try:
            out = self.live.submit(tokens, n, use_cache=use_cache, session=session)
        except WorkerError as exc:
            self._reply(502, {"error": f"worker failed: {exc}"})
            return
        except ValueError as exc:
            self._reply(400, {"error": str(exc)})
            return
        except Exception as exc:  # a failing worker or store must not kill the service
            log.exception("request failed")
            self._reply(502, {"error": f"{type(exc).__name__}: {exc}"})
            return
        self._reply(429 if out.get("rejected") else 200, out)

    def do_DELETE(self) -> None:
        if not self.path.startswith(SESSIONS_PATH) or self.path == SESSIONS_PATH:
            self._reply(404, error_body(404, f"no such endpoint: DELETE {self.path}"))
            return
        session = unquote(self.path[len(SESSIONS_PATH):])
        if not self.live.delete_session(session):
            self._reply(404, error_body(404, f"no session {session!r} is known here (never "
                                        "seen, ended, or idle past its TTL)"))
            return
        self._reply(200, {"id": session, "object": "session.deleted", "deleted": True})

    def _body(self) -> dict[str, Any]:
        length = int(self.headers.get("Content-Length") or 0)
        if length <= 0 or length > MAX_BODY:
            raise ValueError(f"need a JSON body of 1..{MAX_BODY} bytes")
        try:
            body = json.loads(self.rfile.read(length))
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            raise ValueError(f"body is not JSON: {exc}") from None
        if not isinstance(body, dict):
            raise ValueError("body must be a JSON object")
        return body


class ConductorClient:
    """Submits requests to a ``conductor serve`` service."""

    def __init__(self, addr: str, *, timeout: float = 600.0) -> None:
        self.base = f"http://{addr}"
        self.timeout = timeout

    def generate(self, token_ids: Sequence[int], max_new_tokens: int, *,
                 use_cache: bool = True, session: str | None = None) -> dict[str, Any]:
        """The service's answer: tokens and timings, or ``rejected`` with a ``reason``.
        ``session``: the session this request is a turn of (its ``session_id``)."""
        body: dict[str, Any] = {"token_ids": list(token_ids),
                                "max_new_tokens": max_new_tokens, "use_cache": use_cache}
        if session is not None:
            body[SESSION_FIELD] = session
        data = json.dumps(body).encode()
        req = UrlRequest(self.base + "/generate", data=data, method="POST",
                         headers={"Content-Type": "application/json"})
        try:
            with urlopen(req, timeout=self.timeout) as resp:
                return json.loads(resp.read())
        except HTTPError as exc:
            body = json.loads(exc.read() or b"{}")
            if exc.code == 429:
                return body
            raise WorkerError(exc.code, body.get("error", str(exc))) from None
        except URLError as exc:
            raise WorkerError(0, f"{self.base}: {exc.reason}") from exc

    def delete_session(self, session: str) -> bool:
        """Ends ``session`` (``DELETE /v1/sessions/{id}``); False if it was not known."""
        req = UrlRequest(self.base + SESSIONS_PATH + quote(session, safe=""), method="DELETE")
        try:
            with urlopen(req, timeout=self.timeout) as resp:
                return bool(json.loads(resp.read())["deleted"])
        except HTTPError as exc:
            if exc.code == 404:
                return False
            raise WorkerError(exc.code, str(exc)) from None

    def health(self) -> dict[str, Any]:
        with urlopen(self.base + "/health", timeout=self.timeout) as resp:
            return json.loads(resp.read())
