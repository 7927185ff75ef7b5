"""The OpenAI completions wire format as the front needs it: request checks, error
bodies, and the two ways of asking an instance (one JSON answer, or a server-sent-event
stream passed through chunk by chunk).

Errors follow OpenAI's (and vLLM's) shape: ``{"error": {"message", "type", "param",
"code"}}``; a rejection also carries ``"reason"`` (the Conductor's sentence). An instance
that refuses the client's request (its own 4xx) is answered verbatim (``InstanceAnswer``):
a client gets what vLLM's server would have told it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx

from conductor.front.vllm_instances import UpstreamError, VllmInstance
from kvstore.integrations.vllm.describe import RETAIN_PARAM, STORED_PARAM

DEFAULT_MAX_TOKENS = 16
"""OpenAI's default for ``/v1/completions``."""


class BadRequest(Exception):
    """The client's request is malformed (HTTP 400)."""


class InstanceAnswer(Exception):
    """An instance refused the client's request (its 4xx): ``status`` and ``body`` are
    its answer, passed to the client unchanged."""

    def __init__(self, status: int, body: dict[str, Any]) -> None:
        super().__init__(f"HTTP {status}: {body}")
        self.status = status
        self.body = body


PREFILL_DROPS = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "prompt_logprobs",
                 "echo", "best_of", "n", "max_completion_tokens")
"""Fields of a client's request the prefill's one-token copy leaves out: they shape the
answer, which the decode instance gives, not the prompt's KV cache."""


def error_body(status: int, message: str, *, kind: str | None = None,
               reason: str | None = None) -> dict[str, Any]:
    kinds = {400: "invalid_request_error", 404: "not_found_error", 429: "rate_limit_exceeded",
             502: "upstream_error", 503: "service_unavailable", 504: "timeout"}
    err: dict[str, Any] = {"message": message, "type": kind or kinds.get(status, "error"),
                           "param": None, "code": status}
    if reason is not None:
        err["reason"] = reason
    return {"error": err}


def prompt_token_ids(body: dict[str, Any], *, vocab_check: int | None = None) -> list[int]:
    """The request's prompt as token ids (text must have been tokenized before)."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], list):
        prompt = prompt[0]  # a batch of one token-id prompt
    if not isinstance(prompt, list) or not prompt:
        raise BadRequest("prompt must be a non-empty list of token ids (or text with "
                         "--tokenizer); batches of several prompts are not supported")
    if not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in prompt):
        raise BadRequest("prompt token ids must be non-negative integers")
    if vocab_check is not None and max(prompt) >= vocab_check:
        raise BadRequest(f"token id {max(prompt)} >= vocabulary size {vocab_check}")
    return [int(t) for t in prompt]


def max_tokens(body: dict[str, Any]) -> int:
    v = body.get("max_tokens", DEFAULT_MAX_TOKENS)
    if v is None:
        return DEFAULT_MAX_TOKENS
    if not isinstance(v, int) or isinstance(v, bool) or v < 1:
        raise BadRequest(f"max_tokens must be an integer >= 1, got {v!r}")
    return v


def output_tokens(body: dict[str, Any], *, chat: bool) -> int | None:
    """The output budget the client asked for (chat: ``max_completion_tokens``, else
    ``max_tokens``), None when it left it to the server (chat's default)."""
    if chat:
        for name in ("max_completion_tokens", "max_tokens"):
            v = body.get(name)
            if v is not None:
                return max_tokens({"max_tokens": v})
        return None
    return max_tokens(body)


def choices(body: dict[str, Any]) -> int:
    """``n``: how many answers the request asks for (1 when absent)."""
    n = body.get("n", 1)
    if n is None:
        return 1
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        raise BadRequest(f"n must be an integer >= 1, got {n!r}")
    return n


def check_sampling(body: dict[str, Any]) -> None:
    choices(body)
    if "stream" in body and not isinstance(body["stream"], bool):
        raise BadRequest("stream must be true or false")


def with_retention(body: dict[str, Any], retain_s: float) -> tuple[dict[str, Any], bool]:
    """``body`` asking the instances' connector to save its blocks with ``retain_s``
    (``kv_transfer_params[RETAIN_PARAM]``), and whether it now does. A client's own
    ``RETAIN_PARAM`` is kept (its choice), and ``kv_transfer_params`` that are not an
    object are left for the instance to refuse: then False."""
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict) or RETAIN_PARAM in params:
        return body, False
    return {**body, "kv_transfer_params": {**params, RETAIN_PARAM: retain_s}}, True


def with_stored(body: dict[str, Any], blocks: int) -> dict[str, Any]:
    """``body`` telling the instance's connector that the store holds the prompt's first
    ``blocks`` blocks (``kv_transfer_params[STORED_PARAM]``: the front's own lookup, so
    the instance does not ask the store again). A client's own ``STORED_PARAM`` is kept,
    and ``kv_transfer_params`` that are not an object are left for the instance to
    refuse."""
    params = body.get("kv_transfer_params")
    if params is None:
        params = {}
    if not isinstance(params, dict) or STORED_PARAM in params:
        return body
    return {**body, "kv_transfer_params": {**params, STORED_PARAM: int(blocks)}}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The prefill instance's copy of a client's request: the same prompt (text, chat or
    token ids, so the instance computes the same tokens as the decode instance will),
    one output token, not streamed."""
    pre = {k: v for k, v in body.items() if k not in PREFILL_DROPS}
    pre.update(max_tokens=1, stream=False)
    return pre


def _upstream_message(inst: VllmInstance, r: httpx.Response) -> str:
    try:
        msg = r.json().get("error", {}).get("message") or r.text
    except Exception:
        msg = r.text
    return f"{inst.role} instance {inst.url} answered HTTP {r.status_code}: {msg[:500]}"


@contextmanager
def upstream_errors(inst: VllmInstance) -> Iterator[None]:
    """An instance that cannot be reached or answers too late: 502, 504 on timeout."""
    try:
        yield
    except httpx.TimeoutException as exc:
        raise UpstreamError(f"{inst.role} instance {inst.url} timed out "
                            f"({type(exc).__name__})", status=504) from exc
    except httpx.HTTPError as exc:
        raise UpstreamError(f"{inst.role} instance {inst.url} failed: "
                            f"{type(exc).__name__}: {exc}") from exc


def _refused(inst: VllmInstance, r: httpx.Response) -> Exception:
    """An instance's non-200 answer: its own 4xx verbatim (``InstanceAnswer``: the
    client's request was refused), anything else a 502 naming it."""
    if 400 <= r.status_code < 500:
        try:
            body = r.json()
        except ValueError:
            body = None
        if isinstance(body, dict):
            return InstanceAnswer(r.status_code, body)
        return InstanceAnswer(r.status_code, error_body(r.status_code,
                                                        _upstream_message(inst, r)))
    return UpstreamError(_upstream_message(inst, r), status=502)


async def post_json(inst: VllmInstance, path: str, body: dict[str, Any],
                    timeout: httpx.Timeout) -> dict[str, Any]:
    """One non-streamed call (see ``_refused`` for a non-200 answer; 504 on timeout)."""
    with upstream_errors(inst):
        r = await inst.http.post(inst.url + path, json=body, timeout=timeout)
    if r.status_code != 200:
        raise _refused(inst, r)
    return r.json()


@dataclass(slots=True, kw_only=True)
class OpenStream:
    """An instance's SSE answer whose headers arrived; ``chunks`` yields its bytes as they
    come (no buffering); the owner closes ``response``."""

    inst: VllmInstance
    response: httpx.Response

    async def chunks(self) -> AsyncIterator[bytes]:
        async for chunk in self.response.aiter_raw():
            yield chunk


async def open_stream(inst: VllmInstance, path: str, body: dict[str, Any],
                      timeout: httpx.Timeout) -> OpenStream:
    req = inst.http.build_request("POST", inst.url + path, json=body, timeout=timeout)
    with upstream_errors(inst):
        r = await inst.http.send(req, stream=True)
    if r.status_code != 200:
        await r.aread()
        await r.aclose()
        raise _refused(inst, r)
    return OpenStream(inst=inst, response=r)


def sse_error(message: str, status: int = 502) -> bytes:
    """An in-stream error event (headers are already sent), then the end marker."""
    import json

    return (b"data: " + json.dumps(error_body(status, message)).encode() + b"\n\n"
            + b"data: [DONE]\n\n")
