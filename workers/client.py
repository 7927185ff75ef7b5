"""A small client for the workers' HTTP/JSON API (see ``workers.server``).

Standard library only (no torch), so a scheduler can import it cheaply.
"""

from __future__ import annotations

import http.client
import json
import time
import uuid
from collections.abc import Sequence
from typing import Any


class WorkerError(Exception):
    """A worker answered with an error status (``status``: the HTTP code), or could not
    be reached (``status`` 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status}: {message}" if status else message)
        self.status = status
        self.message = message


class WorkerClient:
    """Calls one worker. Thread-safe: every call uses its own connection."""

    def __init__(self, addr: str, *, timeout: float = 300.0) -> None:
        host, sep, port = addr.rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"worker address must be HOST:PORT, got {addr!r}")
        self.addr = addr
        self.host = host.strip("[]")
        self.port = int(port)
        self.timeout = timeout

    def _call(self, method: str, path: str, body: dict[str, Any] | None = None
              ) -> dict[str, Any]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            data = json.dumps(body).encode() if body is not None else None
            headers = {"Content-Type": "application/json"} if data is not None else {}
            conn.request(method, path, body=data, headers=headers)
            resp = conn.getresponse()
            raw = resp.read()
        except OSError as exc:
            raise WorkerError(0, f"{self.addr}{path}: {exc}") from exc
        finally:
            conn.close()
        try:
            payload = json.loads(raw)
        except json.JSONDecodeError:
            payload = {"error": raw.decode(errors="replace")}
        if resp.status != 200:
            raise WorkerError(resp.status, str(payload.get("error", payload)))
        return payload

    def health(self) -> dict[str, Any]:
        """The worker's load: ``queued``, ``active``, ``tokens_per_s``, ... (see status())."""
        return self._call("GET", "/health")

    def prefill(self, token_ids: Sequence[int], *, request_id: str | None = None,
                use_cache: bool = True, retain_s: float | None = None) -> dict[str, Any]:
        """``retain_s``: the blocks this prefill writes are put with that retention
        (seconds); None sends no such field (the worker's old behaviour)."""
        body: dict[str, Any] = {"token_ids": list(token_ids), "use_cache": use_cache}
        if request_id is not None:
            body["request_id"] = request_id
        if retain_s is not None:
            body["retain_s"] = retain_s
        return self._call("POST", "/prefill", body)

    def decode(self, token_ids: Sequence[int], first_token: int, max_new_tokens: int, *,
               request_id: str | None = None, stop_token_ids: Sequence[int] = ()
               ) -> dict[str, Any]:
        body: dict[str, Any] = {"token_ids": list(token_ids), "first_token": first_token,
                                "max_new_tokens": max_new_tokens}
        if request_id is not None:
            body["request_id"] = request_id
        if stop_token_ids:
            body["stop_token_ids"] = list(stop_token_ids)
        return self._call("POST", "/decode", body)


def generate(prefill: WorkerClient, decode: WorkerClient, token_ids: Sequence[int],
             max_new_tokens: int, *, request_id: str | None = None,
             stop_token_ids: Sequence[int] = ()) -> dict[str, Any]:
    """One disaggregated request: prefill, then decode with the same request id (which
    names the prompt's tail in the store). ``ttft_s`` is measured here, from the
    prefill call to its reply; ``tbt_s`` comes from the decode worker."""
    rid = request_id or uuid.uuid4().hex
    t0 = time.perf_counter()
    p = prefill.prefill(token_ids, request_id=rid)
    ttft = time.perf_counter() - t0
    d = decode.decode(token_ids, p["first_token"], max_new_tokens, request_id=rid,
                      stop_token_ids=stop_token_ids)
    return {"request_id": rid, "tokens": d["tokens"], "ttft_s": ttft, "tbt_s": d["tbt_s"],
            "total_s": time.perf_counter() - t0, "prefill": p, "decode": d}
