"""What the front answers a request with: a JSON body, or a stream of server-sent events
with its close (the HTTP layer, ``conductor.front.http_front``, turns either into a
response)."""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any


@dataclass(slots=True, kw_only=True)
class JsonReply:
    status: int
    body: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class StreamReply:
    """``chunks`` yields the answer; ``close`` ends the request's bookkeeping and its
    upstream response, once, whether ``chunks`` ran to the end, was interrupted, or never
    started (a client gone before the first byte): the HTTP layer always awaits it."""

    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]


Reply = JsonReply | StreamReply
