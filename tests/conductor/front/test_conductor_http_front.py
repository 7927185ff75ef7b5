"""``conductor.front.http_front``: the uvicorn server under ``serve`` leaves signals to its caller
(the routes run against real vLLM servers in tests/engines/test_vllm_conductor.py)."""

from __future__ import annotations

import asyncio
import signal
from types import FrameType
from typing import Any

import uvicorn

from conductor.front.http_front import CallerSignalsServer

SIGNALS = (signal.SIGTERM, signal.SIGINT)


async def _app(scope: dict[str, Any], receive: Any, send: Any) -> None:  # never called
    raise AssertionError("no request is sent")


class _Probe(CallerSignalsServer):
    """Records, while serving (after start-up, inside uvicorn's signal hook), which handlers
    are installed and who receives a SIGTERM; then stops."""

    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self.handlers: dict[int, object] = {}
        self.exit_after_sigterm: bool | None = None

    async def main_loop(self) -> None:
        self.handlers = {s: signal.getsignal(s) for s in SIGNALS}
        signal.raise_signal(signal.SIGTERM)  # runs the Python handler before it returns
        self.exit_after_sigterm = self.should_exit
        self.should_exit = True
        await super().main_loop()


def test_the_server_leaves_sigterm_and_sigint_to_its_caller() -> None:
    received: list[int] = []

    def caller(sig: int, frame: FrameType | None) -> None:
        received.append(sig)

    before = {s: signal.signal(s, caller) for s in SIGNALS}
    try:
        server = _Probe(uvicorn.Config(_app, host="127.0.0.1", port=0, log_level="warning",
                                       lifespan="off"))
        asyncio.run(server.serve())
        assert server.started
        assert server.handlers == {signal.SIGTERM: caller, signal.SIGINT: caller}
        assert received == [signal.SIGTERM]  # once: uvicorn neither took it nor raised it again
        assert server.exit_after_sigterm is False  # only the caller decides when to stop
        assert {s: signal.getsignal(s) for s in SIGNALS} == {s: caller for s in SIGNALS}
    finally:
        for s, handler in before.items():
            signal.signal(s, handler)


def test_delete_session_answers_200_or_an_openai_shaped_404() -> None:
    import httpx

    from conductor.front.http_front import build_app
    from conductor.front.store_view import StoreView
    from conductor.front.vllm_front import FrontConfig, VllmFront
    from conductor.scheduling.types import InstanceId, Slo

    front = VllmFront(config=FrontConfig(namespace="ns", block_tokens=16, slo=Slo()),
                      store=StoreView(None), colocated=["http://a:1"])
    front.sessions.remember("conv-1", InstanceId("http://a:1"), 0.0)

    async def run() -> list[httpx.Response]:
        transport = httpx.ASGITransport(app=build_app(front))
        async with httpx.AsyncClient(transport=transport, base_url="http://front") as c:
            out = [await c.delete("/v1/sessions/conv-1"), await c.delete("/v1/sessions/conv-1")]
        await front.close()
        return out

    ok, gone = asyncio.run(run())
    assert (ok.status_code, ok.json()) == (200, {"id": "conv-1", "object": "session.deleted",
                                                 "deleted": True})
    assert gone.status_code == 404
    err = gone.json()["error"]
    assert (err["type"], err["code"], err["param"]) == ("not_found_error", 404, None)
    assert "conv-1" in err["message"]
