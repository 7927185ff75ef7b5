"""Effective request capacity: the disaggregated, cache-aware cluster against the colocated
baseline at equal instance count (FAST'25 section 5.2's experiment, simulated).

A system's capacity at a TBT SLO is the highest replay speed of the trace at which at
least ``attainment`` (0.9) of all requests meet TTFT <= ``ttft_slo_s`` and TBT <= the SLO
(TBT under ``tbt_statistic``, the tail mean by default; ``conductor.simulation.metrics``), found by
bisection on the speed (attainment is assumed to fall as speed rises), and reported in
requests/s: speed x the trace's mean arrival rate (requests / last arrival time).

Systems, ``instances`` either way: colocated (whole-prompt prefill stalls the batch),
colocated with chunked prefill (``chunk_tokens``), and the Conductor's disaggregated
cluster at each prefill/decode split (``splits``; by default every second split from
even to ``instances - 2`` prefill, e.g. 8P+8D, 10P+6D, 12P+4D, 14P+2D for 16). ``gain`` =
the best split over the better colocated variant, minus 1.

Each system is run once per speed and every threshold is judged from the same run.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from conductor.scheduling.costs import LLAMA2_70B_LAYERS, CostModel, a800_kv_capacity_tokens
from conductor.scheduling.types import Slo
from conductor.simulation.colocated import simulate_colocated
from conductor.simulation.metrics import TAIL_MEAN, TBT_DEFINITIONS, summarize
from conductor.simulation.sim import (
    DEFAULT_CACHE_BLOCKS,
    ClusterSpec,
    SimResult,
    requests_from_trace,
)
from conductor.simulation.sim import simulate as simulate_disaggregated
from conductor.simulation.trace import TraceRequest

COLOCATED = "colocated"
COLOCATED_CHUNKED = "colocated_chunked"
_SPLIT = re.compile(r"^\s*(\d+)\s*P\s*\+\s*(\d+)\s*D\s*$", re.IGNORECASE)


def split_name(prefill: int, instances: int) -> str:
    return f"{prefill}P+{instances - prefill}D"


def parse_split(text: str) -> tuple[int, int]:
    """``"12P+4D"`` -> ``(12, 4)``."""
    m = _SPLIT.match(text)
    if m is None:
        raise ValueError(f"invalid split {text!r} (use e.g. 12P+4D)")
    p, d = int(m.group(1)), int(m.group(2))
    if p < 1 or d < 1:
        raise ValueError(f"split {text!r} needs at least one prefill and one decode instance")
    return p, d


def default_splits(instances: int) -> list[int]:
    """Prefill counts tried: from ``instances // 2`` up in steps of ``instances // 8``."""
    if instances < 2:
        raise ValueError("a disaggregated cluster needs at least 2 instances")
    return list(range(instances // 2, instances, max(1, instances // 8)))


def threshold_key(tbt_s: float) -> str:
    """The JSON key of a TBT SLO: 0.1 -> ``"100ms"``."""
    return f"{round(tbt_s * 1000, 6):g}ms"


def bisect_speed(attain: Callable[[float], float], target: float, lo: float, hi: float,
                 tol: float) -> float:
    """Highest speed up to ``hi`` with ``attain(speed) >= target``, to within ``tol``,
    assuming attainment falls with speed; ``hi`` if ``hi`` meets. If even ``lo`` misses,
    the search halves ``lo`` until a speed meets (then bisects between it and its double)
    and returns 0.0 if none does down to ``tol``: a capacity below the range is measured,
    not reported as ``lo``. Deterministic: the midpoints depend only on ``lo``, ``hi``
    and the answers."""
    if not 0 < lo < hi or tol <= 0:
        raise ValueError("need 0 < lo < hi and tol > 0")
    if attain(lo) < target:
        hi = lo
        while True:
            lo = hi / 2
            if lo < tol:
                return 0.0
            if attain(lo) >= target:
                break
            hi = lo
    elif attain(hi) >= target:
        return hi
    while hi - lo > tol:
        mid = (lo + hi) / 2
        if attain(mid) >= target:
            lo = mid
        else:
            hi = mid
    return lo


@dataclass(slots=True, kw_only=True, frozen=True)
class CapacitySettings:
    instances: int = 16
    tbt_slos_s: tuple[float, ...] = (0.1, 0.2, 0.3)
    ttft_slo_s: float = 30.0
    attainment: float = 0.9
    tol: float = 0.05
    speed_lo: float = 0.5
    speed_hi: float = 8.0
    chunk_tokens: int = 2048
    splits: tuple[int, ...] | None = None
    """Prefill instance counts of the disaggregated splits (default ``default_splits``)."""
    cache_blocks: int = DEFAULT_CACHE_BLOCKS
    colocated_cache_blocks: int = DEFAULT_CACHE_BLOCKS
    kv_capacity_tokens: int = field(default_factory=a800_kv_capacity_tokens)
    kv_stream_layers: int = LLAMA2_70B_LAYERS
    tbt_statistic: str = TAIL_MEAN


@dataclass(slots=True, kw_only=True)
class CapacityResult:
    settings: CapacitySettings
    base_rps: float
    speeds: dict[str, dict[str, float]]
    """System name -> threshold key -> capacity as a replay speed."""

    def req_s(self, system: str, key: str) -> float:
        return self.speeds[system][key] * self.base_rps

    def contract(self) -> dict[str, Any]:
        """The ``conductor capacity --json`` object."""
        out: dict[str, Any] = {}
        disagg = [s for s in self.speeds if s not in (COLOCATED, COLOCATED_CHUNKED)]
        for tbt in self.settings.tbt_slos_s:
            key = threshold_key(tbt)
            best = max(disagg, key=lambda s: self.speeds[s][key])  # ties: fewer prefill
            colo = max(self.req_s(COLOCATED, key), self.req_s(COLOCATED_CHUNKED, key))
            dis = self.req_s(best, key)
            out[key] = {"colocated_req_s": self.req_s(COLOCATED, key),
                        "colocated_chunked_req_s": self.req_s(COLOCATED_CHUNKED, key),
                        "disaggregated_req_s": dis, "best_split": best,
                        "gain": dis / colo - 1 if colo > 0 else None}
        return {"tbt_definition": TBT_DEFINITIONS[self.settings.tbt_statistic],
                "thresholds": out}


def base_rate(trace: Sequence[TraceRequest]) -> float:
    """The trace's mean arrival rate at 1x: requests / last arrival (s)."""
    if len(trace) < 2 or trace[-1].timestamp_ms <= 0:
        raise ValueError("capacity needs a trace of at least 2 requests spread over time")
    return len(trace) / (trace[-1].timestamp_ms / 1000.0)


def measure_capacity(trace: Sequence[TraceRequest], cost: CostModel,
                     settings: CapacitySettings | None = None,
                     progress: Callable[[str, dict[str, float]], None] | None = None
                     ) -> CapacityResult:
    """Every system's capacity at every TBT SLO; ``progress(system, speeds)`` after each."""
    st = settings if settings is not None else CapacitySettings()
    if not 0 < st.attainment <= 1:
        raise ValueError("attainment must be in (0, 1]")
    if not st.tbt_slos_s:
        raise ValueError("need at least one TBT SLO")
    rate = base_rate(trace)
    splits = list(st.splits) if st.splits is not None else default_splits(st.instances)
    for p in splits:
        if not 1 <= p < st.instances:
            raise ValueError(f"split with {p} prefill instances does not fit {st.instances}")
    colo_kw: dict[str, Any] = {"instances": st.instances, "cost": cost,
                               "cache_blocks": st.colocated_cache_blocks,
                               "kv_capacity_tokens": st.kv_capacity_tokens}
    systems: dict[str, Callable[[float], SimResult]] = {
        COLOCATED: lambda s: simulate_colocated(requests_from_trace(trace, speed=s),
                                                **colo_kw),
        COLOCATED_CHUNKED: lambda s: simulate_colocated(
            requests_from_trace(trace, speed=s), chunk_tokens=st.chunk_tokens, **colo_kw),
    }

    def disaggregated(speed: float, spec: ClusterSpec) -> SimResult:
        return simulate_disaggregated(requests_from_trace(trace, speed=speed), spec=spec,
                                      cost=cost, kv_stream_layers=st.kv_stream_layers)

    for p in splits:
        spec = ClusterSpec(prefill=p, decode=st.instances - p, cache_blocks=st.cache_blocks,
                           kv_capacity_tokens=st.kv_capacity_tokens)
        systems[split_name(p, st.instances)] = partial(disaggregated, spec=spec)
    speeds: dict[str, dict[str, float]] = {}
    for name, run in systems.items():
        attained: dict[float, dict[float, float]] = {}  # speed -> TBT SLO -> attainment

        def attain(speed: float, tbt: float, run: Callable[[float], SimResult] = run,
                   attained: dict[float, dict[float, float]] = attained) -> float:
            if speed not in attained:
                records = run(speed).records
                attained[speed] = {
                    t: summarize(records, Slo(ttft_s=st.ttft_slo_s, tbt_s=t),
                                 tbt_statistic=st.tbt_statistic)["slo_attainment"]
                    for t in st.tbt_slos_s}
            return attained[speed][tbt]

        speeds[name] = {threshold_key(t): bisect_speed(
            partial(attain, tbt=t), st.attainment, st.speed_lo, st.speed_hi, st.tol)
            for t in st.tbt_slos_s}
        if progress is not None:
            progress(name, speeds[name])
    return CapacityResult(settings=st, base_rps=rate, speeds=speeds)
