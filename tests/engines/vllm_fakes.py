"""What the vLLM scheduler-side tests stand in for, shared: vLLM's KVCacheManager as the
connector uses it, request ids and token sequences."""

from __future__ import annotations

import itertools


class FakeManager:
    """What the connector uses of vLLM's KVCacheManager: a request's block ids."""

    block_pool = None

    def __init__(self) -> None:
        self.blocks: dict[str, list[int]] = {}

    def get_block_ids(self, req_id: str) -> tuple[list[int], ...]:
        return (self.blocks[req_id],)


_request_numbers = itertools.count()


def request_id() -> str:
    """A request id no other request of this process has."""
    return f"req-{next(_request_numbers)}"


def tokens(n: int, seed: int) -> list[int]:
    """``n`` token ids, the same for the same seed."""
    return [(seed * 1_000_003 + i * 7919) % 500 + 3 for i in range(n)]
