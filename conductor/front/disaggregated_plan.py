"""The disaggregated front's scheduler: Algorithm 1 (``conductor.scheduling.scheduler``)
with each prefill instance's own calibrated cost model, and the store's answer for the one
request being scheduled as its global cache."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import PrefillInstance
from conductor.scheduling.types import InstanceId, PrefillPlan, Request


class KnownPool:
    """The scheduler's global cache: the store's answer, asked once per request before
    scheduling (the scheduler itself is synchronous)."""

    def __init__(self) -> None:
        self.keys: tuple[bytes, ...] = ()
        self.blocks = 0

    def prefix_len(self, keys: Sequence[Any]) -> int:
        return self.blocks if tuple(keys) == self.keys else 0


class VllmConductor(Conductor):
    """Algorithm 1 with each prefill instance's own calibrated cost model."""

    def __init__(self, *, costs: dict[InstanceId, PolyCostModel], **kw: Any) -> None:
        super().__init__(**kw)
        self.costs = costs

    def plan(self, inst: PrefillInstance, req: Request, queue_s: float, local_blocks: int,
             fetch_blocks: int) -> PrefillPlan:
        bt = req.block_tokens
        cost = self.costs.get(inst.id, self.cost)
        cached = min((local_blocks + fetch_blocks) * bt, req.prompt_tokens - 1)
        return PrefillPlan(instance=inst.id, local_blocks=local_blocks,
                           fetch_blocks=fetch_blocks, cached_tokens=cached, queue_s=queue_s,
                           transfer_s=0.0,  # store loads are inside the observed prefill
                           prefill_s=cost.prefill_s(req.prompt_tokens - cached, cached))
