"""The Conductor's OpenAI-compatible HTTP front: FastAPI on uvicorn, as vLLM's own server.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``
(an instance's own answer), ``POST /tokenize`` and ``POST /detokenize`` (forwarded to an
instance), ``GET /health``, ``GET /metrics``.

Text and chat: when the instances tokenize (started without ``--skip-tokenizer-init``)
the client's request goes to them unchanged and their answer comes back unchanged; the
front asks an instance's ``/tokenize`` for the token ids it routes by. Otherwise, with
``--tokenizer DIR``, the front renders and decodes text itself
(``conductor.front.text_prompts``); without either, prompts must be token ids.

``X-Session-Affinity: ID`` on a request (or a ``session_id`` field in its body, which the
instances never see) names its session: the front prefers the instance of the session's
previous request (``conductor.front.sessions``) and, with ``--session-ttl``, keeps the
session's blocks retained in the store between turns (``conductor.front.session_cache``).
``DELETE /v1/sessions/{id}`` ends a session: 200, or 404 for a session the front does not
know.

Everything runs on one event loop; upstream calls use one pooled ``httpx.AsyncClient``,
so hundreds of requests may be in flight without a thread each. Streamed answers are
passed through chunk by chunk. A client that disconnects cancels its upstream request:
for a stream, Starlette stops iterating the pass-through (which closes the upstream
response); for a plain answer, a watcher on the client's connection cancels the task.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from conductor.front.openai_api import InstanceAnswer, error_body, post_json
from conductor.front.replies import JsonReply, Reply
from conductor.front.session_cache import SESSION_FIELD, SESSION_HEADER, session_of_request
from conductor.front.sse_reply import StreamedReply
from conductor.front.text_prompts import TextCodec
from conductor.front.vllm_front import VllmFront
from conductor.front.vllm_instances import UpstreamError

LOAD_POLL_S = 0.5


async def _until_disconnected(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def _cancel_on_disconnect(request: Request, work: Any) -> Reply | None:
    """Runs ``work`` (a coroutine); None if the client went away first (work cancelled)."""
    task = asyncio.ensure_future(work)
    watch = asyncio.ensure_future(_until_disconnected(request))
    try:
        await asyncio.wait({task, watch}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watch.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    return None


def _respond(reply: Reply | None) -> Response:
    if reply is None:  # nobody to answer
        return Response(status_code=499)
    if isinstance(reply, JsonReply):
        return JSONResponse(reply.body, status_code=reply.status)
    return StreamedReply(reply)


def build_app(front: VllmFront, *, codec: TextCodec | None = None) -> FastAPI:
    app = FastAPI(title="conductor", docs_url=None, redoc_url=None)

    async def body_of(request: Request) -> dict[str, Any] | JSONResponse:
        try:
            body = json.loads(await request.body())
        except (ValueError, UnicodeDecodeError) as exc:
            return JSONResponse(error_body(400, f"request body is not JSON: {exc}"), 400)
        if not isinstance(body, dict):
            return JSONResponse(error_body(400, "request body must be a JSON object"), 400)
        return body

    def session_in(request: Request, body: dict[str, Any]) -> tuple[str | None,
                                                                    dict[str, Any]]:
        """The session the request names, and its body without the ``session_id`` field."""
        session = session_of_request(request.headers.get(SESSION_HEADER), body)
        if SESSION_FIELD in body:
            body = {k: v for k, v in body.items() if k != SESSION_FIELD}
        return session, body

    async def forwarded(request: Request, body: dict[str, Any], route: str,
                        session: str | None) -> Response:
        """A text or chat request the instances answer themselves (they tokenize)."""

        async def work() -> Reply:
            try:
                tokens = await front.tokenize(body, chat=route == "chat")
            except InstanceAnswer as exc:
                front.metrics.requests.labels(route, "bad_request").inc()
                return JsonReply(status=exc.status, body=exc.body)
            except UpstreamError as exc:
                front.metrics.requests.labels(route, "upstream_error").inc()
                return JsonReply(status=exc.status, body=error_body(exc.status, str(exc)))
            return await front.complete(body, route=route, tokens=tokens, session=session)

        reply = await _cancel_on_disconnect(request, work())
        if reply is None:
            front.metrics.requests.labels(route, "cancelled").inc()
        return _respond(reply)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            front.metrics.requests.labels("completions", "bad_request").inc()
            return body
        session, body = session_in(request, body)
        prompt = body.get("prompt")
        if isinstance(prompt, str) or (isinstance(prompt, list) and len(prompt) == 1
                                       and isinstance(prompt[0], str)):
            if front.instances_tokenize:
                if not isinstance(prompt, str):
                    body = {**body, "prompt": prompt[0]}  # a batch of one text prompt
                return await forwarded(request, body, "completions", session)
            if codec is None:
                front.metrics.requests.labels("completions", "bad_request").inc()
                return JSONResponse(error_body(400, "a text prompt needs instances that "
                                               "tokenize (vLLM without "
                                               "--skip-tokenizer-init) or the Conductor "
                                               "started with --tokenizer DIR; send token "
                                               "ids otherwise"), 400)
            if not isinstance(prompt, str):
                body = {**body, "prompt": prompt[0]}
            return await codec.completions(front, request, body, _cancel_on_disconnect,
                                           session=session)
        reply = await _cancel_on_disconnect(request, front.complete(
            body, route="completions", session=session))
        if reply is None:
            front.metrics.requests.labels("completions", "cancelled").inc()
        return _respond(reply)

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            front.metrics.requests.labels("chat", "bad_request").inc()
            return body
        session, body = session_in(request, body)
        if front.instances_tokenize:
            return await forwarded(request, body, "chat", session)
        if codec is None or not codec.has_chat_template:
            front.metrics.requests.labels("chat", "bad_request").inc()
            return JSONResponse(error_body(400, "chat completions need instances that "
                                           "tokenize (vLLM without --skip-tokenizer-init) "
                                           "or the Conductor started with --tokenizer DIR "
                                           "whose tokenizer has a chat template"), 400)
        return await codec.chat(front, request, body, _cancel_on_disconnect,
                                session=session)

    @app.delete("/v1/sessions/{session_id}")
    async def delete_session(session_id: str) -> Response:
        if not await front.delete_session(session_id):
            return JSONResponse(error_body(404, f"no session {session_id!r} is known here "
                                           "(never seen, ended, or idle past its TTL)"),
                                status_code=404)
        return JSONResponse({"id": session_id, "object": "session.deleted", "deleted": True})

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        return front.models_body

    async def to_an_instance(request: Request, path: str) -> Response:
        """``/tokenize`` and ``/detokenize``: any instance answers (they share the model
        and tokenizer), verbatim."""
        body = await body_of(request)
        if isinstance(body, JSONResponse):
            return body
        inst = front.instances()[0]
        try:
            answer = await post_json(inst, path, body, front.timeout())
        except InstanceAnswer as exc:
            return JSONResponse(exc.body, status_code=exc.status)
        except UpstreamError as exc:
            return JSONResponse(error_body(exc.status, str(exc)), status_code=exc.status)
        return JSONResponse(answer)

    @app.post("/tokenize")
    async def tokenize(request: Request) -> Response:
        return await to_an_instance(request, "/tokenize")

    @app.post("/detokenize")
    async def detokenize(request: Request) -> Response:
        return await to_an_instance(request, "/detokenize")

    @app.get("/health")
    async def health() -> Response:
        status = front.status()
        down = [u for u, i in status["instances"].items() if i["load"] is None]
        status["status"] = "degraded" if down else "ok"
        status["unreachable"] = down
        return JSONResponse(status, status_code=503 if down else 200)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(front.metrics.render(),
                        media_type="text/plain; version=0.0.4; charset=utf-8")

    return app


class CallerSignalsServer(uvicorn.Server):
    """A uvicorn server that leaves the process's signal handlers to its caller.

    ``serve`` ends when its ``stop`` event is set (``conductor serve`` sets it on SIGTERM /
    SIGINT), and then waits for uvicorn's graceful shutdown. uvicorn (0.29 and later) would
    install its own SIGTERM / SIGINT handlers for as long as it serves, shadowing the
    caller's, and raise the signals it caught again once it returns; overriding its
    ``capture_signals`` hook (the one place it touches signals) keeps them the caller's.
    """

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _poll(front: VllmFront) -> None:
    while True:
        await asyncio.sleep(LOAD_POLL_S)
        await front.poll_loads()
        await front.sweep_sessions()


async def serve(front: VllmFront, *, host: str, port: int, codec: TextCodec | None,
                stop: asyncio.Event, on_ready: Any = None, check_namespace: bool = True
                ) -> None:
    """Starts the front (what the instances say, the probe, whether KV events arrive),
    serves until ``stop`` is set.
    Signals are the caller's to handle (see ``CallerSignalsServer``)."""
    await front.start()
    if check_namespace:
        await front.check_namespace()
        await front.check_events()
    config = uvicorn.Config(build_app(front, codec=codec), host=host, port=port,
                            log_level="warning", lifespan="off", timeout_keep_alive=30)
    server = CallerSignalsServer(config)
    poller = asyncio.ensure_future(_poll(front))
    runner = asyncio.ensure_future(server.serve())
    try:
        while not server.started:
            if runner.done():
                runner.result()
                raise RuntimeError("uvicorn stopped before it started")
            await asyncio.sleep(0.01)
        if on_ready is not None:
            sock = server.servers[0].sockets[0].getsockname()
            on_ready(f"{sock[0]}:{sock[1]}")
        stopper = asyncio.ensure_future(stop.wait())
        await asyncio.wait({runner, stopper}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        await runner
    finally:
        poller.cancel()
        await front.close()
