"""Discrete-event simulation of a disaggregated cluster driven by the Conductor.

Time is a simulated clock (a heap of events); nothing reads the wall clock. The
Conductor is the real one, handed the simulated ``now``. The cluster model:

* Arrivals at the trace's ``timestamp_ms / 1000 / speed`` seconds.
* A prefill instance runs its requests one at a time, in the order the Conductor
  queued them, each for ``transfer_s(fetched blocks) + prefill_s(new, cached)``
  with the plan the Conductor chose (the plan is binding: blocks it counted as
  cached are used even if evicted meanwhile). Its end is the first token.
* The prompt's KV cache streams to the decode instance layer by layer while the
  prefill computes (Mooncake's layer-wise transfer), so it lands at
  ``streamed_kv_ready_s`` after the compute starts: ``max(P + T/L, P/L + T)`` for a
  prefill of ``P`` s, a whole-prompt transfer of
  ``T = transfer_s(prompt_tokens * kv_bytes_per_token)`` and ``L = kv_stream_layers``
  (80 for LLaMA2-70B; ``1`` = no overlap, the transfer after the prefill). There the
  decode-side check of the rejection mode runs. An admitted request waits for KV space (FIFO; a
  request larger than an instance's whole capacity is admitted into an empty
  batch), joins the batch at the next step boundary and produces one token per
  step until its ``output_tokens - 1`` remaining tokens are out.
* A decode step of ``b`` requests holding ``ctx`` tokens lasts
  ``decode_step_s(b, ctx)``; steps run back to back while the batch is non-empty.
  Decode instances are advanced lazily (``advance_to``) to each event's time,
  which processes every step boundary up to it: the simulation does work per
  step but keeps only per-request events in the heap.
* Requests with at most one output token finish at their first token.
* Every decode step's end time is kept (``DecodeEngine.step_ends``): a request's
  decoded tokens are the last ``output_tokens - 1`` steps when it finishes, from which
  its tail-mean and longest token interval are recorded (``conductor.simulation.metrics``).
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from conductor.scheduling.costs import (
    LLAMA2_70B_LAYERS,
    CostModel,
    PolyCostModel,
    a800_kv_capacity_tokens,
    streamed_kv_ready_s,
)
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PoolIndex, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo
from conductor.simulation.metrics import RequestRecord, token_interval_stats
from conductor.simulation.trace import BLOCK_TOKENS, TraceRequest

DEFAULT_CACHE_BLOCKS = 6_000
"""Prefill instance's local cache (DRAM), in 512-token blocks of LLaMA2-70B (160 MiB each):
~0.94 TiB, what a 1-2 TiB A800 server keeps for the KV-cache pool next to everything else."""


def requests_from_trace(trace: Sequence[TraceRequest], *, speed: float = 1.0,
                        limit: int | None = None) -> list[Request]:
    """Trace records as Conductor requests: arrivals scaled by ``1 / speed``, one key per
    full 512-token block (the trace's hash ids; a partial last block has no key)."""
    if speed <= 0:
        raise ValueError("speed must be > 0")
    rows = trace if limit is None else trace[:limit]
    return [Request(id=RequestId(i), arrival_s=t.timestamp_ms / 1000.0 / speed,
                    prompt_tokens=max(1, t.input_length), output_tokens=t.output_length,
                    block_keys=t.hash_ids[:t.full_blocks], block_tokens=BLOCK_TOKENS)
            for i, t in enumerate(rows)]


@dataclass(slots=True, kw_only=True, frozen=True)
class ClusterSpec:
    """Instance counts and capacities of a simulated cluster."""

    prefill: int = 8
    decode: int = 8
    cache_blocks: int = DEFAULT_CACHE_BLOCKS
    kv_capacity_tokens: int = field(default_factory=a800_kv_capacity_tokens)


@dataclass(slots=True, kw_only=True)
class SimResult:
    records: list[RequestRecord]
    duration_s: float
    wasted_prefill_s: float
    conductor: Conductor | None = None


class DecodeEngine:
    """Continuous batching on one decode instance; its batch lives in the shared
    ``DecodeInstance`` the Conductor reads."""

    __slots__ = ("_heap", "busy", "cost", "on_finish", "state", "step_end", "step_ends",
                 "waiting")

    def __init__(self, state: DecodeInstance, cost: CostModel,
                 on_finish: Callable[[RequestId, float, list[float]], None]) -> None:
        self.state = state
        self.cost = cost
        self.on_finish = on_finish
        """Called with (request, finish time, ``step_ends``) when a request's last token
        is out; its tokens are the last ``output_tokens - 1`` entries of ``step_ends``."""
        self.busy = False
        self.step_end = 0.0
        self.step_ends: list[float] = []
        """End time of every step, in order (invariant: ``len == state.steps``)."""
        self.waiting: deque[tuple[RequestId, int, int, int]] = deque()
        self._heap: list[tuple[int, RequestId]] = []

    def add(self, now: float, rid: RequestId, prompt_tokens: int, output_tokens: int) -> None:
        """The request's KV cache arrived at ``now`` (call ``advance_to(now)`` first)."""
        self.waiting.append((rid, prompt_tokens, output_tokens - 1, output_tokens))
        if not self.busy:
            self._admit()
            self._start_step(now)

    def advance_to(self, t: float) -> None:
        """Run every step that ends at or before ``t``."""
        st = self.state
        heap = self._heap
        step = self.cost.decode_step_s
        while self.busy and self.step_end <= t:
            end = self.step_end
            st.steps += 1
            self.step_ends.append(end)
            st.context_tokens += len(st.active)
            while heap and heap[0][0] <= st.steps:
                _, rid = heapq.heappop(heap)
                st.finish(rid)
                self.on_finish(rid, end, self.step_ends)
            if self.waiting:
                self._admit()
            n = len(st.active)
            if n:
                self.step_end = end + step(n, st.context_tokens)
            else:
                self.busy = False

    def _admit(self) -> None:
        st = self.state
        while self.waiting:
            rid, prompt, decode_tokens, output = self.waiting[0]
            if st.active and not st.fits(prompt, output):
                return
            self.waiting.popleft()
            st.start(rid, prompt, decode_tokens, output)
            heapq.heappush(self._heap, (st.steps + decode_tokens, rid))

    def _start_step(self, now: float) -> None:
        n = len(self.state.active)
        if n:
            self.busy = True
            self.step_end = now + self.cost.decode_step_s(n, self.state.context_tokens)


_PREFILL_DONE = 0
_KV_READY = 1


def build_conductor(spec: ClusterSpec, cost: CostModel, *, policy: str, rejection: str,
                    slo: Slo, seed: int = 0) -> Conductor:
    pool = PoolIndex()
    prefill = [PrefillInstance(id=InstanceId(f"p{i}"),
                               cache=LocalPrefixCache(spec.cache_blocks, pool))
               for i in range(spec.prefill)]
    decode = [DecodeInstance(id=InstanceId(f"d{i}"), kv_capacity_tokens=spec.kv_capacity_tokens)
              for i in range(spec.decode)]
    return Conductor(prefill=prefill, decode=decode, cost=cost, policy=policy,
                     rejection=rejection, slo=slo, pool=pool, seed=seed)


def simulate(requests: Sequence[Request], *, spec: ClusterSpec | None = None,
             cost: CostModel | None = None, policy: str = "global-cache-aware",
             rejection: str = "none", slo: Slo | None = None, seed: int = 0,
             conductor: Conductor | None = None,
             kv_stream_layers: int = LLAMA2_70B_LAYERS) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through a disaggregated cluster.

    Pass a prebuilt ``conductor`` to control its instances exactly (tests); else one
    is built from ``spec``, ``cost``, ``policy``, ``rejection`` and ``slo``.
    ``kv_stream_layers``: layers the prompt's KV streams in during prefill (1: none).
    """
    if kv_stream_layers < 1:
        raise ValueError("kv_stream_layers must be >= 1")
    slo = slo if slo is not None else Slo()
    if conductor is None:
        cost = cost if cost is not None else PolyCostModel.a800_llama2_70b()
        conductor = build_conductor(spec or ClusterSpec(), cost, policy=policy,
                                    rejection=rejection, slo=slo, seed=seed)
    cost = conductor.cost
    kv_bytes = cost.kv_bytes_per_token
    records: dict[RequestId, RequestRecord] = {}
    by_id = {r.id: r for r in requests}

    def on_finish(rid: RequestId, t: float, step_ends: list[float]) -> None:
        rec = records[rid]
        rec.finish_s = t
        assert rec.first_token_s is not None
        d = rec.output_tokens - 1
        rec.tail_tbt_s, rec.max_tbt_s = token_interval_stats(rec.first_token_s,
                                                             step_ends[len(step_ends) - d:])
        conductor.forget(rid)

    engines = {d.id: DecodeEngine(d, cost, on_finish) for d in conductor.decode}
    engine_list = list(engines.values())
    free_at = {p.id: 0.0 for p in conductor.prefill}
    events: list[tuple[float, int, int, RequestId]] = []
    seq = 0
    wasted = 0.0
    work: dict[RequestId, float] = {}
    kv_ready: dict[RequestId, float] = {}

    def handle(t: float, kind: int, rid: RequestId) -> None:
        nonlocal seq, wasted
        rec = records[rid]
        req = by_id[rid]
        if kind == _PREFILL_DONE:
            rec.first_token_s = t
            conductor.prefill_done(rid, t)
            ready = kv_ready.pop(rid)
            if req.output_tokens <= 1:
                rec.finish_s = t
                rec.tail_tbt_s = rec.max_tbt_s = 0.0
                conductor.forget(rid)
                return
            seq += 1
            # Never before the first token, whatever the float rounding of the sums.
            heapq.heappush(events, (max(ready, t), seq, _KV_READY, rid))
        else:
            engine = engines[conductor.decode_of(rid).id]
            engine.advance_to(t)
            reason = conductor.decode_arrival(rid, t, prompt_tokens=req.prompt_tokens,
                                              output_tokens=req.output_tokens)
            if reason is not None:
                rec.rejected = reason
                rec.rejected_late = True
                rec.first_token_s = None
                wasted += work[rid]
                return
            engine.add(t, rid, req.prompt_tokens, req.output_tokens)

    for req in requests:
        now = req.arrival_s
        while events and events[0][0] <= now:
            t, _, kind, rid = heapq.heappop(events)
            handle(t, kind, rid)
        for e in engine_list:
            e.advance_to(now)
        dec = conductor.schedule(req, now)
        rec = RequestRecord(id=req.id, arrival_s=now, prompt_tokens=req.prompt_tokens,
                            output_tokens=req.output_tokens, cached_tokens=dec.cached_tokens,
                            prefill=dec.prefill, decode=dec.decode, est_ttft_s=dec.est_ttft_s)
        records[req.id] = rec
        if not dec.accepted:
            rec.rejected = dec.reason
            rec.prefill = None
            continue
        plan = dec.plan
        assert plan is not None
        start = max(now, free_at[plan.instance])
        fetch = cost.transfer_s(plan.fetch_blocks * req.block_tokens * kv_bytes)
        compute = cost.prefill_s(req.prompt_tokens - plan.cached_tokens, plan.cached_tokens)
        w = fetch + compute
        free_at[plan.instance] = start + w
        work[req.id] = w
        kv_ready[req.id] = start + fetch + streamed_kv_ready_s(
            compute, cost.transfer_s(req.prompt_tokens * kv_bytes), kv_stream_layers)
        seq += 1
        heapq.heappush(events, (start + w, seq, _PREFILL_DONE, req.id))
    while events:
        t, _, kind, rid = heapq.heappop(events)
        handle(t, kind, rid)
    for e in engine_list:
        e.advance_to(math.inf)
    out = [records[r.id] for r in requests]
    end = max((r.finish_s for r in out if r.finish_s is not None), default=0.0)
    start_s = requests[0].arrival_s if requests else 0.0
    return SimResult(records=out, duration_s=max(0.0, end - start_s), wasted_prefill_s=wasted,
                     conductor=conductor)
