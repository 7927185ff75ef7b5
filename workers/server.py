"""Worker processes: a prefill or decode worker behind a small HTTP/JSON API.

Why plain HTTP/JSON (``http.server.ThreadingHTTPServer``): the bodies are small
(token ids, timings; KV moves through the store, never through this API), it
needs no generated code, and curl can talk to it. One request per connection
(HTTP/1.0), so shutdown never waits on an idle keep-alive connection.

Endpoints (all bodies JSON objects; errors are ``{"error": "..."}``):

* ``GET /health``: ``{"ok": true, "role", "queued", "active", "tokens_per_s", ...}``
  (the worker's ``status()``), for a scheduler to poll.
* ``POST /prefill`` (prefill role): ``{"token_ids": [int], "request_id"?: str,
  "use_cache"?: bool, "retain_s"?: number}`` -> ``PrefillResult.to_json()``. ``retain_s``:
  the prompt's blocks this request writes are put with that retention (seconds; a
  Conductor passes a session's TTL: docs/conductor.md, "Sessions"); absent or 0: none.
* ``POST /decode`` (decode role): ``{"token_ids": [int], "first_token": int,
  "max_new_tokens": int, "request_id"?: str, "stop_token_ids"?: [int]}`` ->
  ``DecodeResult.to_json()``.

Status codes: 400 bad input (with what is wrong), 404 unknown path (or the other
role's endpoint), 405 wrong method, 413 body over 16 MiB, 503 the store is
unreachable or the worker is stopping, 500 anything else.

SIGTERM or SIGINT: stop accepting, let in-flight requests finish, exit 0.
"""

from __future__ import annotations

import json
import logging
import signal
import sys
import threading
from dataclasses import dataclass
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from kvstore import KVStoreError, Unavailable
from kvstore.core.retention import check_retain_s

log = logging.getLogger("workers.server")

MAX_BODY_BYTES = 16 << 20
MAX_REQUEST_ID = 256


class BadRequest(ValueError):
    """The request body is not what the endpoint takes (HTTP 400)."""


def _int_list(body: dict[str, Any], name: str, *, required: bool = True) -> list[int]:
    value = body.get(name)
    if value is None and not required:
        return []
    if not isinstance(value, list) or (required and not value):
        raise BadRequest(f"{name} must be a non-empty list of integers")
    for v in value:
        if not isinstance(v, int) or isinstance(v, bool):
            raise BadRequest(f"{name} must hold integers, got {v!r}")
    return value


def _positive_int(body: dict[str, Any], name: str) -> int:
    value = body.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise BadRequest(f"{name} must be a positive integer, got {value!r}")
    return value


def _request_id(body: dict[str, Any]) -> str | None:
    rid = body.get("request_id")
    if rid is None:
        return None
    if not isinstance(rid, str) or not 0 < len(rid) <= MAX_REQUEST_ID:
        raise BadRequest(f"request_id must be a string of 1..{MAX_REQUEST_ID} characters")
    return rid


def _retain_s(body: dict[str, Any]) -> float | None:
    """The body's ``retain_s`` checked (None: absent or 0, no retention)."""
    try:
        return check_retain_s(body.get("retain_s")) or None
    except ValueError as exc:
        raise BadRequest(str(exc)) from None


def _check_fields(body: dict[str, Any], allowed: set[str]) -> None:
    unknown = set(body) - allowed
    if unknown:
        raise BadRequest(f"unknown fields: {', '.join(sorted(unknown))}")


@dataclass(slots=True, kw_only=True)
class Service:
    """What a worker process serves: its role and its worker object."""

    role: str  # "prefill" or "decode"
    worker: Any  # PrefillWorker or DecodeWorker

    def handle(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        if self.role == "prefill" and path == "/prefill":
            _check_fields(body, {"token_ids", "request_id", "use_cache", "retain_s"})
            tokens = _int_list(body, "token_ids")
            use_cache = body.get("use_cache", True)
            if not isinstance(use_cache, bool):
                raise ValueError("use_cache must be true or false")
            return self.worker.prefill(tokens, request_id=_request_id(body),
                                       use_cache=use_cache,
                                       retain_s=_retain_s(body)).to_json()
        if self.role == "decode" and path == "/decode":
            _check_fields(body, {"token_ids", "first_token", "max_new_tokens", "request_id",
                                 "stop_token_ids"})
            tokens = _int_list(body, "token_ids")
            first = body.get("first_token")
            if not isinstance(first, int) or isinstance(first, bool):
                raise BadRequest(f"first_token must be an integer, got {first!r}")
            return self.worker.decode(
                tokens, first, _positive_int(body, "max_new_tokens"),
                request_id=_request_id(body),
                stop_token_ids=_int_list(body, "stop_token_ids", required=False),
            ).to_json()
        raise LookupError(path)


class WorkerHTTPServer(ThreadingHTTPServer):
    daemon_threads = False  # server_close() joins in-flight requests
    block_on_close = True

    def __init__(self, addr: tuple[str, int], service: Service) -> None:
        super().__init__(addr, _Handler)
        self.service = service
        self.stopping = threading.Event()


class _Handler(BaseHTTPRequestHandler):
    server: WorkerHTTPServer
    server_version = "kvstore-workers/1"

    def log_message(self, format: str, *args: Any) -> None:  # (base signature)
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, payload: dict[str, Any]) -> None:
        data = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _error(self, status: HTTPStatus, message: str) -> None:
        self._reply(status, {"error": message})

    def do_GET(self) -> None:
        if self.path in ("/health", "/status"):
            self._reply(HTTPStatus.OK, {"ok": not self.server.stopping.is_set(),
                                        **self.server.service.worker.status()})
        elif self.path in ("/prefill", "/decode"):
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.path} takes POST")
        else:
            self._error(HTTPStatus.NOT_FOUND, f"no endpoint {self.path}")

    def do_POST(self) -> None:
        if self.path in ("/health", "/status"):
            self._error(HTTPStatus.METHOD_NOT_ALLOWED, f"{self.path} takes GET")
            return
        if self.server.stopping.is_set():
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, "worker is shutting down")
            return
        try:
            length = int(self.headers.get("Content-Length", ""))
        except ValueError:
            self._error(HTTPStatus.LENGTH_REQUIRED, "Content-Length required")
            return
        if length > MAX_BODY_BYTES or length < 0:
            self._error(HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                        f"body of {length} bytes (at most {MAX_BODY_BYTES})")
            return
        try:
            body = json.loads(self.rfile.read(length) or b"null")
        except (json.JSONDecodeError, UnicodeDecodeError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, f"body is not JSON: {exc}")
            return
        if not isinstance(body, dict):
            self._error(HTTPStatus.BAD_REQUEST, "body must be a JSON object")
            return
        try:
            result = self.server.service.handle(self.path, body)
        except LookupError:
            self._error(HTTPStatus.NOT_FOUND,
                        f"no endpoint {self.path} on a {self.server.service.role} worker")
        except (BadRequest, ValueError) as exc:
            self._error(HTTPStatus.BAD_REQUEST, str(exc))
        except Unavailable as exc:
            self._error(HTTPStatus.SERVICE_UNAVAILABLE, f"store unavailable: {exc}")
        except KVStoreError as exc:
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"store error: {exc}")
        except Exception as exc:  # (reported to the caller, logged here)
            log.exception("%s failed", self.path)
            self._error(HTTPStatus.INTERNAL_SERVER_ERROR, f"{type(exc).__name__}: {exc}")
        else:
            self._reply(HTTPStatus.OK, result)


def parse_listen(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"--listen must be HOST:PORT, got {text!r}")
    return host.strip("[]"), int(port)


def serve(service: Service, listen: str, *, on_stop: Any = None) -> int:
    """Serves until SIGTERM/SIGINT; returns the exit code. Prints the ready line."""
    host, port = parse_listen(listen)
    server = WorkerHTTPServer((host, port), service)
    address = server.server_address
    # The host is a str for an IP socket; the stub allows bytes too.
    bound_host, bound_port = str(address[0]), address[1]

    def stop(signum: int, _frame: object) -> None:
        if not server.stopping.is_set():
            log.info("signal %d: stopping", signum)
            server.stopping.set()
            # shutdown() waits for serve_forever, which runs in this (main) thread.
            threading.Thread(target=server.shutdown, daemon=True).start()

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    print(f"workers: {service.role} serving on {bound_host}:{bound_port}", flush=True)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()  # joins in-flight request threads
        if on_stop is not None:
            on_stop()
    print(f"workers: {service.role} stopped", flush=True)
    sys.stdout.flush()
    return 0
