"""The early-rejection benchmark's yardsticks, exactly: the trace's KV demand at the TBT
SLO's pace (``decode_demand``) and the clairvoyant arrival check (``ClairvoyantConductor``).

Cost model of the simulated cases (``COST``): prefill 1 ms per new token, KV 1 byte per
token moved at 10,000 B/s after the prefill (no layer-wise overlap), decode step 10 ms +
5 ms per sequence.
"""

from __future__ import annotations

import pytest

from benchmarks.conductor_bench import ClairvoyantConductor, decode_demand
from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PoolIndex, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo
from conductor.simulation.sim import simulate
from conductor.simulation.trace import TraceRequest

COST = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=10_000,
                     d_fixed=0.01, d_seq=0.005)


def t(ms: int, prompt: int, output: int) -> TraceRequest:
    return TraceRequest(timestamp_ms=ms, input_length=prompt, output_length=output,
                        hash_ids=())


def test_decode_demand_holds_each_reservation_for_its_slo_paced_decode() -> None:
    # a: 111 tokens held 0 -> 1 s (10 gaps of 0.1 s); b: one output token, never held;
    # c: 100 tokens held 2 -> 3 s. Span 2 s: mean (111 + 100) / 2 = 105.5 tokens.
    trace = [t(0, 100, 11), t(500, 200, 1), t(2_000, 89, 11)]
    mean, peak = decode_demand(trace, speed=1.0, tbt_s=0.1, kv_capacity_tokens=100)
    assert mean == pytest.approx(1.055)
    assert peak == pytest.approx(1.11)


def test_decode_demand_releases_before_admitting_at_the_same_instant() -> None:
    # At 2x, c arrives at 1.0 s, the instant a leaves: the peak stays a's 111 tokens;
    # the span halves (1 s), so the mean doubles.
    trace = [t(0, 100, 11), t(500, 200, 1), t(2_000, 89, 11)]
    mean, peak = decode_demand(trace, speed=2.0, tbt_s=0.1, kv_capacity_tokens=100)
    assert mean == pytest.approx(2.11)
    assert peak == pytest.approx(1.11)
    assert decode_demand([], speed=1.0, tbt_s=0.1, kv_capacity_tokens=100) == (0.0, 0.0)


def clairvoyant(doomed: set[RequestId], kv: int) -> ClairvoyantConductor:
    pool = PoolIndex()
    return ClairvoyantConductor(
        doomed=doomed,
        prefill=[PrefillInstance(id=InstanceId("p0"), cache=LocalPrefixCache(100, pool))],
        decode=[DecodeInstance(id=InstanceId("d0"), kv_capacity_tokens=kv)],
        cost=COST, rejection="baseline", slo=Slo(ttft_s=30.0, tbt_s=1.0), pool=pool)


def r(i: int, prompt: int, output: int) -> Request:
    return Request(id=RequestId(i), arrival_s=0.0, prompt_tokens=prompt, output_tokens=output,
                   block_keys=())


def test_clairvoyant_rejects_the_doomed_at_arrival_without_prefill() -> None:
    # Under baseline (tests/test_sim.py) r1 prefills 1.0 -> 1.3 s and is rejected at decode;
    # told it is doomed, the clairvoyant Conductor rejects it before any prefill, and r0's
    # timeline is unchanged (prefill 0 -> 1.0, KV at 1.1, 100 steps of 15 ms).
    c = clairvoyant({RequestId(1)}, kv=1_500)
    run = simulate([r(0, 1_000, 101), r(1, 300, 100)], conductor=c, kv_stream_layers=1)
    r0, r1 = run.records
    assert r1.rejected == "decode overloaded (clairvoyant)"
    assert not r1.rejected_late and r1.prefill is None and r1.first_token_s is None
    assert run.wasted_prefill_s == 0.0
    assert r0.served and r0.finish_s == pytest.approx(2.6, abs=1e-9)
    assert c.prefill[0].cache.prefix_len(()) == 0 and c.decode[0].incoming == {}
    # The rejected request still counts in the running mean output: round(201 / 2).
    assert c.expected_output_tokens() == 100


def test_clairvoyant_with_nothing_doomed_is_baseline() -> None:
    c = clairvoyant(set(), kv=1_500)
    run = simulate([r(0, 1_000, 101), r(1, 300, 100)], conductor=c)
    assert run.records[1].rejected == "decode KV cache full" and run.records[1].rejected_late
    assert run.wasted_prefill_s == pytest.approx(0.3)
