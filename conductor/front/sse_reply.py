"""The streamed (SSE) answer both HTTP routes give, apart from the app so that the text
routes (``conductor.front.text_prompts``) and the app (``conductor.front.http_front``) share it
without importing each other."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import anyio
from fastapi.responses import StreamingResponse

from conductor.front.replies import StreamReply


class StreamedReply(StreamingResponse):
    """An SSE answer that always closes its ``StreamReply`` (see there), even when the
    client left before the first chunk and the body was never iterated."""

    def __init__(self, reply: StreamReply, chunks: AsyncIterator[bytes] | None = None
                 ) -> None:
        super().__init__(chunks if chunks is not None else reply.chunks,
                         media_type="text/event-stream")
        self._reply = reply

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            with anyio.CancelScope(shield=True):
                await self._reply.close()
