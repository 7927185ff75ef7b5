"""The Conductor's vocabulary: requests, SLOs and the decision it returns.

These types are shared by the simulator and the live service, so they carry no
clock and no transport: times are seconds on whatever clock the caller injects
(the simulator's event clock, or ``time.monotonic()`` live), and block keys are
any hashable value (``CacheKey``: trace hash ids in the simulator, 16-byte store keys live).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import NewType, TypeAlias

RequestId = NewType("RequestId", int)
"""A request's id, unique for the Conductor's lifetime (the trace index in the simulator)."""

InstanceId = NewType("InstanceId", str)
"""A prefill or decode instance's name (``p0``.., ``d0``.. in the simulator)."""

CacheKey: TypeAlias = Hashable
"""What the Conductor calls a KV-cache block: any hashable value (a trace hash id in the
simulator, a ``kvstore.core.keys.BlockKey`` live); not a store key itself, so it has its own
name. Keys are prefix-closed: equal keys imply equal prefixes."""

BLOCK_TOKENS = 512
"""Tokens per KV-cache block, as in Mooncake and its traces."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Request:
    """One inference request as the Conductor sees it on arrival.

    Invariant: ``block_keys`` are the keys of the prompt's *full* blocks in chain
    order, so ``len(block_keys) * block_tokens <= prompt_tokens``.
    ``output_tokens`` is the expected output length (exact in a trace replay,
    a prediction live); it drives decode-load prediction only.
    """

    id: RequestId
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    block_keys: tuple[CacheKey, ...]
    block_tokens: int = BLOCK_TOKENS

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1:
            raise ValueError(f"request {self.id}: prompt_tokens must be >= 1")
        if self.output_tokens < 0:
            raise ValueError(f"request {self.id}: output_tokens must be >= 0")
        if len(self.block_keys) * self.block_tokens > self.prompt_tokens:
            raise ValueError(f"request {self.id}: {len(self.block_keys)} full blocks do not fit "
                             f"in {self.prompt_tokens} prompt tokens")


@dataclass(slots=True, kw_only=True, frozen=True)
class Slo:
    """Latency objectives: a request meets them if both hold."""

    ttft_s: float = 30.0
    tbt_s: float = 0.1


@dataclass(slots=True, kw_only=True, frozen=True)
class PrefillPlan:
    """How one prefill instance would serve a request, and what that is estimated to cost.

    The instance reuses ``local_blocks`` leading blocks from its own cache, fetches
    the next ``fetch_blocks`` from the global pool, and computes the rest.
    Estimated TTFT = queue + transfer + prefill (Mooncake Algorithm 1).
    """

    instance: InstanceId
    local_blocks: int
    fetch_blocks: int
    cached_tokens: int
    queue_s: float
    transfer_s: float
    prefill_s: float

    @property
    def ttft_s(self) -> float:
        return self.queue_s + self.transfer_s + self.prefill_s

    @property
    def work_s(self) -> float:
        """Seconds the instance is busy with this request (transfer + compute)."""
        return self.transfer_s + self.prefill_s


@dataclass(slots=True, kw_only=True, frozen=True)
class Decision:
    """The Conductor's answer for one request.

    Accepted iff ``reason is None``. A rejected decision may still name the
    instances it considered best (``prefill``/``decode``) and their estimates,
    which explain the rejection.
    """

    request_id: RequestId
    reason: str | None
    plan: PrefillPlan | None
    decode: InstanceId | None
    est_ttft_s: float
    est_tbt_s: float

    @property
    def accepted(self) -> bool:
        return self.reason is None

    @property
    def prefill(self) -> InstanceId | None:
        return self.plan.instance if self.plan is not None else None

    @property
    def cached_tokens(self) -> int:
        """Prompt tokens not recomputed: local hits plus fetched blocks."""
        return self.plan.cached_tokens if self.plan is not None else 0
