"""What the vLLM scheduler-side tests stand in for, shared: vLLM's KVCacheManager as the
connector uses it, request ids and token sequences, vLLM's own Request, KVCacheBlocks and
SchedulerOutput as the scheduler makes them."""

from __future__ import annotations

import itertools
from typing import Any


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


def request(tokens: list[int], **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id(), tokens, SamplingParams(max_tokens=64), None, **kw)


def blocks_of(ids: list[int]) -> Any:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock

    return KVCacheBlocks(([KVCacheBlock(block_id=i) for i in ids],))


def sched_output(new: list[tuple[Any, list[int]]] = (), cached: list[tuple[Any, int]] = (),
                 scheduled: dict[str, int] | None = None) -> Any:
    """A SchedulerOutput: ``new`` (request, block ids) scheduled for the first time,
    ``cached`` (request, num_computed_tokens) scheduled before."""
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    c = CachedRequestData.make_empty()
    c.req_ids = [r.request_id for r, _ in cached]
    c.num_computed_tokens = [n for _, n in cached]
    c.new_block_ids = [None for _ in cached]
    c.new_token_ids = [[] for _ in cached]
    c.num_output_tokens = [r.num_output_tokens for r, _ in cached]
    scheduled = scheduled or {}
    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(r, (ids,)) for r, ids in new],
        scheduled_cached_reqs=c, num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])
