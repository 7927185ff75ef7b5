"""The colocated baseline: every instance does prefill and decode (vLLM-style).

For the effective-capacity comparison at equal instance count. Each instance has
its own local prefix cache (no global pool, no fetching), one FIFO prefill queue
and one continuous batch, and runs one iteration at a time:

* whole-prompt mode (``chunk_tokens=None``, vLLM with prefix caching): if a
  prefill is waiting and its KV reservation fits, the iteration is that whole
  prefill (``prefill_s(new, cached)``) and every decoding request stalls
  meanwhile, which is what inflates TBT; otherwise a decode step;
* chunked mode (vLLM chunked prefill): every iteration is a decode step of the
  batch plus a prefill chunk of up to ``chunk_tokens`` prompt tokens, costed as
  ``prefill_s(chunk, prefix so far) + decode_step_s(batch, context)``.

A request joins the batch when its prefill ends (its first token) and leaves
after ``output_tokens - 1`` decode steps; each step's end is one of its tokens (kept in
``step_ends``), so a whole-prompt prefill between two steps is one long interval,
which the tail-mean TBT (``conductor.simulation.metrics``) sees and the mean TBT dilutes. KV
reservations (prompt + output) are taken when its prefill starts; a prefill waits
until its reservation fits (or the instance is empty).

Routing: the instance with the smallest estimated TTFT, i.e. queued prefill
seconds plus this request's prefill given the instance's local prefix
(local-cache-aware), ties to the lowest index. Decode work interleaved with
prefills is not in the estimate. There is no rejection: vLLM serves everything.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from conductor.scheduling.costs import CostModel, PolyCostModel
from conductor.scheduling.state import LocalPrefixCache
from conductor.scheduling.types import InstanceId, Request, RequestId
from conductor.simulation.metrics import RequestRecord, token_interval_stats
from conductor.simulation.sim import SimResult


@dataclass(slots=True, kw_only=True)
class _Prefill:
    rid: RequestId
    prompt: int
    output: int
    cached: int
    estimate_s: float
    done: int = 0
    """Prompt tokens prefilled so far (chunked mode), beyond ``cached``."""
    started: bool = False
    """Whether its KV reservation is taken (at its first iteration)."""


class ColocatedEngine:
    """One colocated instance; ``advance_to`` runs every iteration ending by ``t``."""

    __slots__ = ("_heap", "_iter", "active", "cache", "chunk_tokens", "context", "cost", "id",
                 "iter_end", "iterations", "kv_capacity_tokens", "queue", "queued_s", "records",
                 "reserved", "step_ends", "steps")

    def __init__(self, iid: InstanceId, *, cost: CostModel, cache_blocks: int,
                 kv_capacity_tokens: int, chunk_tokens: int | None,
                 records: dict[RequestId, RequestRecord], log_iterations: bool = False) -> None:
        if chunk_tokens is not None and chunk_tokens < 1:
            raise ValueError("chunk_tokens must be >= 1")
        self.id = iid
        self.cost = cost
        self.cache = LocalPrefixCache(cache_blocks)
        self.kv_capacity_tokens = kv_capacity_tokens
        self.chunk_tokens = chunk_tokens
        self.records = records
        self.queue: deque[_Prefill] = deque()
        self.queued_s = 0.0
        """Estimated prefill seconds of every unfinished prefill (the routing estimate)."""
        self.active: dict[RequestId, int] = {}  # rid -> prompt tokens
        self._heap: list[tuple[int, RequestId]] = []
        self.steps = 0
        self.step_ends: list[float] = []
        """End time of every decode step (invariant: ``len == steps``)."""
        self.context = 0
        self.reserved = 0
        self.iter_end = 0.0
        self._iter: tuple[_Prefill | None, int, bool] | None = None
        """The running iteration: (prefill job, its tokens, whether the batch steps)."""
        self.iterations: list[tuple[float, float]] | None = [] if log_iterations else None
        """With ``log_iterations``: (start, end) of every iteration, for gap analysis."""

    def estimate_ttft_s(self, req: Request, now: float) -> tuple[float, int]:
        local = self.cache.prefix_len(req.block_keys)
        cached = min(local * req.block_tokens, req.prompt_tokens - 1)
        own = self.cost.prefill_s(req.prompt_tokens - cached, cached)
        return self.queued_s + own, cached

    def add(self, now: float, req: Request, cached: int) -> None:
        """Queue the request's prefill (call ``advance_to(now)`` first)."""
        self.cache.use(req.block_keys)
        est = self.cost.prefill_s(req.prompt_tokens - cached, cached)
        self.queue.append(_Prefill(rid=req.id, prompt=req.prompt_tokens,
                                   output=req.output_tokens, cached=cached, estimate_s=est))
        self.queued_s += est
        if self._iter is None:
            self._start(now)

    def advance_to(self, t: float) -> None:
        while self._iter is not None and self.iter_end <= t:
            end = self.iter_end
            job, tokens, stepped = self._iter
            if stepped:
                self.steps += 1
                self.step_ends.append(end)
                self.context += len(self.active)
                heap = self._heap
                while heap and heap[0][0] <= self.steps:
                    _, rid = heapq.heappop(heap)
                    self._finish(rid, end)
            if job is not None:
                job.done += tokens
                if job.cached + job.done >= job.prompt:
                    self.queue.popleft()
                    self.queued_s = self.queued_s - job.estimate_s if self.queue else 0.0
                    self._first_token(job, end)
            self._start(end)

    def _first_token(self, job: _Prefill, t: float) -> None:
        rec = self.records[job.rid]
        rec.first_token_s = t
        if job.output <= 1:
            rec.finish_s = t
            rec.tail_tbt_s = rec.max_tbt_s = 0.0
            self.reserved -= job.prompt + job.output
            return
        self.active[job.rid] = job.prompt
        self.context += job.prompt
        heapq.heappush(self._heap, (self.steps + job.output - 1, job.rid))

    def _finish(self, rid: RequestId, t: float) -> None:
        prompt = self.active.pop(rid)
        rec = self.records[rid]
        rec.finish_s = t
        assert rec.first_token_s is not None
        d = rec.output_tokens - 1
        rec.tail_tbt_s, rec.max_tbt_s = token_interval_stats(
            rec.first_token_s, self.step_ends[len(self.step_ends) - d:])
        self.context -= prompt + rec.output_tokens - 1
        self.reserved -= prompt + rec.output_tokens

    def _start(self, now: float) -> None:
        cost = self.cost
        job = self.queue[0] if self.queue else None
        if job is not None and not job.started:
            if self.active and (self.reserved + job.prompt + job.output
                                > self.kv_capacity_tokens):
                job = None  # waits for KV space; the batch keeps decoding
            else:
                job.started = True
                self.reserved += job.prompt + job.output
        n = len(self.active)
        if self.chunk_tokens is None:
            if job is not None:
                tokens = job.prompt - job.cached
                self._iter = (job, tokens, False)
                self.iter_end = now + cost.prefill_s(tokens, job.cached)
            elif n:
                self._iter = (None, 0, True)
                self.iter_end = now + cost.decode_step_s(n, self.context)
            else:
                self._iter = None
            if self._iter is not None and self.iterations is not None:
                self.iterations.append((now, self.iter_end))
            return
        if job is None and not n:
            self._iter = None
            return
        duration = cost.decode_step_s(n, self.context) if n else 0.0
        tokens = 0
        if job is not None:
            tokens = min(self.chunk_tokens, job.prompt - job.cached - job.done)
            duration += cost.prefill_s(tokens, job.cached + job.done)
        self._iter = (job, tokens, n > 0)
        self.iter_end = now + duration
        if self.iterations is not None:
            self.iterations.append((now, self.iter_end))


def max_token_gaps(records: Sequence[RequestRecord], engines: Sequence[ColocatedEngine]
                   ) -> dict[RequestId, float]:
    """Each decoding request's longest gap between two of its tokens: the longest
    iteration of its instance between its first token and its last (a whole-prompt
    prefill stalls every request in the batch for its full duration)."""
    import numpy as np

    logs = {}
    for e in engines:
        if e.iterations is None:
            raise ValueError("engines were run without iteration logs")
        arr = np.array(e.iterations, dtype=float).reshape(-1, 2)
        logs[e.id] = (arr[:, 0], arr[:, 1] - arr[:, 0])
    out: dict[RequestId, float] = {}
    for rec in records:
        if not rec.served or rec.output_tokens <= 1 or rec.prefill is None:
            continue
        assert rec.first_token_s is not None and rec.finish_s is not None
        starts, durations = logs[rec.prefill]
        i = int(np.searchsorted(starts, rec.first_token_s))
        j = int(np.searchsorted(starts, rec.finish_s))
        out[rec.id] = float(durations[i:j].max()) if j > i else 0.0
    return out


def simulate_colocated(requests: Sequence[Request], *, instances: int,
                       cost: CostModel | None = None, cache_blocks: int, kv_capacity_tokens: int,
                       chunk_tokens: int | None = None,
                       engines_out: list[ColocatedEngine] | None = None) -> SimResult:
    """Replay ``requests`` (sorted by arrival) through ``instances`` colocated instances.

    With ``engines_out`` (a list), the engines are appended to it with their iteration
    logs on, so a caller can measure per-request token gaps."""
    if instances < 1:
        raise ValueError("need at least one instance")
    cost = cost if cost is not None else PolyCostModel.a800_llama2_70b()
    records: dict[RequestId, RequestRecord] = {}
    engines = [ColocatedEngine(InstanceId(f"c{i}"), cost=cost, cache_blocks=cache_blocks,
                               kv_capacity_tokens=kv_capacity_tokens, chunk_tokens=chunk_tokens,
                               records=records, log_iterations=engines_out is not None)
               for i in range(instances)]
    if engines_out is not None:
        engines_out.extend(engines)
    for req in requests:
        now = req.arrival_s
        best: tuple[float, int] | None = None
        chosen = engines[0]
        for e in engines:
            e.advance_to(now)
            est, cached = e.estimate_ttft_s(req, now)
            if best is None or est < best[0]:
                best, chosen = (est, cached), e
        assert best is not None
        records[req.id] = RequestRecord(
            id=req.id, arrival_s=now, prompt_tokens=req.prompt_tokens,
            output_tokens=req.output_tokens, cached_tokens=best[1], prefill=chosen.id,
            decode=chosen.id, est_ttft_s=best[0])
        chosen.add(now, req, best[1])
    for e in engines:
        e.advance_to(math.inf)
    out = [records[r.id] for r in requests]
    end = max((r.finish_s for r in out if r.finish_s is not None), default=0.0)
    start_s = requests[0].arrival_s if requests else 0.0
    return SimResult(records=out, duration_s=max(0.0, end - start_s), wasted_prefill_s=0.0)
