"""The Conductor against live workers: the same scheduler the simulator drives.

``LiveConductor.submit`` computes the request's block keys (the workers' namespace
and block size, read from their ``/health``), asks the ``Conductor`` for a
(prefill, decode) pair at the wall-clock ``now``, and either answers at once with
the rejection reason or runs prefill then decode on the chosen workers and
reports tokens and timings.

What the scheduler sees of the world:

* the global cache is the store itself (``StorePool``): a block counts as cached
  when its last layer is stored (the workers' completeness rule), asked with one
  ``prefix_match``;
* each prefill instance's local cache is what that worker computed (its
  ``LocalPrefixCache``), its queue the scheduler's own estimate corrected by the
  observed prefill time;
* the cost model is calibrated from the workers: prefill tokens/s and decode step
  time measured on the requests run so far (a conservative default before the
  first), KV bytes per token from the model's shape.

Sessions (``session``, from ``X-Session-Affinity`` or a ``session_id`` field): a turn
prefers its session's previous prefill worker while that meets the TTFT SLO
(``conductor.front.sessions``), and with ``session_ttl_s`` the session's blocks (every
layer's object of each full block of its prompt) stay retained in the store between turns,
the shared prefix is prefetched to DRAM when the next turn arrives
(``conductor.front.session_cache``). The retention starts when the blocks are written: the
prefill worker puts a session turn's new blocks with ``retain_s`` = the TTL, so none is
evicted between its write and the turn's end (where the Conductor retains the whole prompt
again, refreshing it). The prefetch (and the idle sweep) run on a thread of their own,
off the request's path; the turn's end waits for them.

Threads: one lock guards the Conductor and its instance states (they are
single-owner); worker calls run outside it, so requests proceed in parallel. The session
cache has its own lock and calls the store outside it.
"""

from __future__ import annotations

import itertools
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, cast

from conductor.front.session_cache import SessionCache
from conductor.front.sessions import PreferSession, SessionAffinity
from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.policies import make_policy
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PrefillInstance
from conductor.scheduling.types import CacheKey, InstanceId, Request, RequestId, Slo
from kvstore.core.keys import BlockKey, block_keys, layer_key
from workers.client import WorkerClient

DEFAULT_PREFILL_TOKENS_PER_S = 1000.0  # until a worker has measured itself
DEFAULT_DECODE_STEP_S = 0.05
NET_BYTES_PER_S = 2e9  # loopback store reads (see benchmarks/RESULTS.md)
LOCAL_CACHE_BLOCKS = 4096
DECODE_KV_TOKENS = 1 << 20


class StorePool:
    """The Conductor's global cache: the store, asked whether each block's last layer is
    there (``GlobalCache`` protocol)."""

    def __init__(self, store: Any, n_layers: int) -> None:
        self.store = store
        self.last = n_layers - 1

    def prefix_len(self, keys: Sequence[CacheKey]) -> int:
        if not keys:
            return 0
        # The protocol speaks of any hashable key; a live request carries the store's block
        # keys (``submit``).
        blocks = cast("Sequence[BlockKey]", keys)
        return self.store.prefix_match([layer_key(k, self.last) for k in blocks])


@dataclass(slots=True, kw_only=True)
class _Speed:
    """Exponential moving average of a measured rate (None until the first sample)."""

    value: float | None = None
    alpha: float = 0.3

    def add(self, x: float) -> None:
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


class LiveConductor:
    def __init__(self, *, store: Any, prefill: Sequence[str], decode: Sequence[str],
                 slo: Slo, policy: str = "global-cache-aware", rejection: str = "predictive",
                 clock: Callable[[], float] = time.monotonic, seed: int = 0,
                 session_ttl_s: float = 0.0, max_sessions: int = 100_000) -> None:
        """``session_ttl_s``: how long a session's blocks stay retained after its last turn
        (``conductor serve --session-ttl``; 0: sessions keep no cache, only affinity)."""
        self.prefill_workers = {InstanceId(a): WorkerClient(a) for a in prefill}
        self.decode_workers = {InstanceId(a): WorkerClient(a) for a in decode}
        shape = self._agreed_shape()
        self.block_tokens = int(shape["block_tokens"])
        self.namespace = str(shape["namespace"])
        self.kv_bytes_per_token = int(shape["kv_bytes_per_token"])
        self.n_layers = int(shape["n_layers"])
        self.session_cache = SessionCache(store, ttl_s=session_ttl_s,
                                          max_sessions=max_sessions, clock=clock)
        self._session_calls = ThreadPoolExecutor(max_workers=4,
                                                 thread_name_prefix="session-prefetch")
        self._clock = clock
        self._prefill_speed = _Speed()
        self._step_s = _Speed()
        self._lock = threading.Lock()
        # guarded by _lock:
        self.sessions = SessionAffinity(max_sessions=max_sessions)
        self._prefer = PreferSession(make_policy(policy, seed), slo.ttft_s)
        self.conductor = Conductor(
            prefill=[PrefillInstance(id=i, cache=LocalPrefixCache(LOCAL_CACHE_BLOCKS))
                     for i in self.prefill_workers],
            decode=[DecodeInstance(id=i, kv_capacity_tokens=DECODE_KV_TOKENS)
                    for i in self.decode_workers],
            cost=self._cost(), policy=self._prefer, rejection=rejection, slo=slo,
            pool=StorePool(store, int(shape["n_layers"])), seed=seed)
        self._ids = itertools.count(1)

    def _agreed_shape(self) -> dict[str, Any]:
        """Every worker must run the same model, namespace and block size."""
        fields = ("block_tokens", "namespace", "n_layers", "kv_bytes_per_token")
        shapes = {}
        for addr, w in {**self.prefill_workers, **self.decode_workers}.items():
            h = w.health()
            shapes[addr] = tuple(h.get(f) for f in fields)
        distinct = set(shapes.values())
        if len(distinct) != 1:
            raise ValueError(f"workers disagree on {fields}: {shapes}")
        return dict(zip(fields, distinct.pop(), strict=True))

    def _cost(self) -> PolyCostModel:
        return PolyCostModel.calibrated(
            prefill_tokens_per_s=self._prefill_speed.value or DEFAULT_PREFILL_TOKENS_PER_S,
            decode_step_s=self._step_s.value or DEFAULT_DECODE_STEP_S,
            kv_bytes_per_token=self.kv_bytes_per_token, net_bytes_per_s=NET_BYTES_PER_S)

    def submit(self, token_ids: Sequence[int], max_new_tokens: int, *,
               use_cache: bool = True, session: str | None = None) -> dict[str, Any]:
        """Runs one request: generated tokens and timings, or ``{"rejected": True,
        "reason": ...}`` at once when no worker pair meets the SLOs. ``session``: the
        session it is a turn of (see the module docstring)."""
        tokens = [int(t) for t in token_ids]
        if not tokens:
            raise ValueError("token_ids must not be empty")
        if max_new_tokens < 1:
            raise ValueError("max_new_tokens must be >= 1")
        t0 = self._clock()
        keys = block_keys(tokens, self.block_tokens, self.namespace)
        stored = self.store_keys(keys) if session is not None else []
        arrival, prefetched = self._arrive(session, stored)
        with self._lock:
            rid = RequestId(next(self._ids))
            req = Request(id=rid, arrival_s=t0, prompt_tokens=len(tokens),
                          output_tokens=max_new_tokens, block_keys=tuple(keys),
                          block_tokens=self.block_tokens)
            known = self.sessions.instance(session, t0) if session is not None else None
            self._prefer.preferred = known
            decision = self.conductor.schedule(req, t0)
            if session is not None and decision.prefill is not None:
                self.sessions.remember(session, decision.prefill, t0)
        base: dict[str, Any] = {"request_id": int(rid), "est_ttft_s": decision.est_ttft_s,
                                "est_tbt_s": decision.est_tbt_s}
        if session is not None:
            base["session"] = {"id": session, "previous_prefill": known,
                               "prefetched_keys": prefetched}
        if not decision.accepted:
            return {**base, "rejected": True, "reason": decision.reason}
        assert decision.prefill is not None and decision.decode is not None
        retain_s = (self.session_cache.ttl_s
                    if session is not None and self.session_cache.enabled else None)
        try:
            out = self._run(rid, req, tokens, decision.prefill, decision.decode, use_cache,
                            base, t0, retain_s)
        finally:
            with self._lock:
                self.conductor.forget(rid)
        if arrival is not None:
            arrival.result()  # its errors are counted inside; the turn's calls in order
        if not out.get("rejected"):
            self.session_cache.end_turn(session, stored)
        return out

    def _arrive(self, session: str | None, stored: list[bytes]
                ) -> tuple[Future[None] | None, int]:
        """Starts a session turn's arrival calls (``SessionCache.arrive``: the idle sweep,
        the prefetch of the shared prefix) on a thread: (that work, the keys it asks
        for)."""
        if not self.session_cache.enabled:
            return None, 0
        shared = self.session_cache.to_prefetch(session, stored)

        def calls() -> None:
            self.session_cache.sweep()
            self.session_cache.prefetch(shared)

        return self._session_calls.submit(calls), len(shared)

    def close(self) -> None:
        """Waits for the sessions' store calls under way and stops their threads."""
        self._session_calls.shutdown(wait=True)

    def store_keys(self, keys: Sequence[BlockKey]) -> list[bytes]:
        """The store objects of these blocks: every layer's, block by block (the workers
        store one object per block and layer)."""
        return [layer_key(k, layer) for k in keys for layer in range(self.n_layers)]

    def delete_session(self, session: str) -> bool:
        """Forgets ``session``'s worker and releases its blocks; False if neither was
        known."""
        with self._lock:
            routed = self.sessions.forget(session)
        return self.session_cache.delete(session) or routed

    def _run(self, rid: RequestId, req: Request, tokens: list[int], p_id: InstanceId,
             d_id: InstanceId, use_cache: bool, base: dict[str, Any], t0: float,
             retain_s: float | None = None) -> dict[str, Any]:
        pre = self.prefill_workers[p_id].prefill(tokens, request_id=f"c{rid}",
                                                 use_cache=use_cache, retain_s=retain_s)
        t1 = self._clock()
        if pre["computed_tokens"] and pre["compute_s"] > 0:
            self._prefill_speed.add(pre["computed_tokens"] / pre["compute_s"])
        with self._lock:
            self.conductor.prefill_done(rid, t1)
            reason = self.conductor.decode_arrival(rid, t1, prompt_tokens=req.prompt_tokens,
                                                   output_tokens=req.output_tokens)
            if reason is not None:  # a decode-side rejection after prefill (baseline mode)
                return {**base, "rejected": True, "reason": reason, "after_prefill": True}
            d = self.conductor.decode_of(rid)
            d.start(rid, req.prompt_tokens, req.output_tokens, req.output_tokens)
        try:  # the decode worker's tokens start with prefill's first token
            dec = self.decode_workers[d_id].decode(tokens, pre["first_token"],
                                                   req.output_tokens, request_id=f"c{rid}")
        finally:
            with self._lock:
                d.finish(rid)
        if dec.get("mean_tbt_s"):
            self._step_s.add(dec["mean_tbt_s"])
        with self._lock:
            self.conductor.cost = self._cost()
        return {**base, "rejected": False, "prefill": p_id, "decode": d_id,
                "tokens": dec["tokens"],
                "prompt_tokens": len(tokens), "cached_tokens": pre["cached_tokens"],
                "ttft_s": t1 - t0, "tbt_s": dec.get("mean_tbt_s") or 0.0,
                "total_s": self._clock() - t0}

    def status(self) -> dict[str, Any]:
        out: dict[str, Any] = {"prefill": {}, "decode": {}}
        for role, workers in (("prefill", self.prefill_workers),
                              ("decode", self.decode_workers)):
            for addr, w in workers.items():
                try:
                    out[role][addr] = w.health()
                except Exception as exc:  # a status page reports, never fails
                    out[role][addr] = {"error": str(exc)}
        with self._lock:
            out["queue_s"] = {p.id: p.queue_s(self._clock()) for p in self.conductor.prefill}
            out["sessions"] = len(self.sessions)
        out["session_cache"] = self.session_cache.snapshot()
        return out
