"""conductor.simulation.sim and conductor.simulation.colocated: hand-computed timelines on tiny
traces.

The disaggregated timelines are hand-computed without the layer-wise KV overlap
(``kv_stream_layers=1``: the KV moves after the prefill); one test checks the overlap.

Cost model (``COST``): prefill 1 ms per new token; KV moves at 10,000 B/s with 1 byte
per token (a 1,000-token prompt takes 0.1 s); a decode step takes 10 ms plus 5 ms per
sequence (15 ms alone, 20 ms for two).
"""

from __future__ import annotations

import random

import pytest

from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PoolIndex, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo
from conductor.simulation.colocated import ColocatedEngine, max_token_gaps, simulate_colocated
from conductor.simulation.metrics import MEAN, summarize
from conductor.simulation.sim import ClusterSpec, build_conductor, requests_from_trace, simulate
from conductor.simulation.trace import TraceRequest

COST = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=10_000,
                     d_fixed=0.01, d_seq=0.005)
EPS = 1e-9


def one_by_one(*, rejection: str = "none", kv: int = 10**9) -> Conductor:
    pool = PoolIndex()
    return Conductor(prefill=[PrefillInstance(id=InstanceId("p0"),
                                              cache=LocalPrefixCache(100, pool))],
                     decode=[DecodeInstance(id=InstanceId("d0"), kv_capacity_tokens=kv)],
                     cost=COST, rejection=rejection, slo=Slo(ttft_s=30.0, tbt_s=1.0), pool=pool)


def r(i: int, at: float, prompt: int, output: int, keys: tuple[str, ...] = ()) -> Request:
    return Request(id=RequestId(i), arrival_s=at, prompt_tokens=prompt, output_tokens=output,
                   block_keys=keys)


def test_disaggregated_timeline_is_exact() -> None:
    # r0: prefill 0 -> 1.0 (first token), KV lands at 1.1, decodes alone: steps end at
    #     1.115, 1.130, 1.145, 1.160, then with r1 1.180, 1.200, then alone 1.215 ...
    #     1.260: 10 tokens after the first -> TBT 0.26 / 10.
    # r1: arrives at 0.2, queues behind r0, reuses r0's block (512 tokens): prefill of
    #     88 tokens 1.0 -> 1.088; KV (600 B) lands at 1.148, mid-step: joins at 1.160;
    #     tokens at 1.180 and 1.200 -> TBT (1.200 - 1.088) / 2.
    c = one_by_one()
    run = simulate([r(0, 0.0, 1_000, 11, ("k0",)), r(1, 0.2, 600, 3, ("k0",))], conductor=c,
                   kv_stream_layers=1)
    r0, r1 = run.records
    assert r0.first_token_s == pytest.approx(1.0, abs=EPS)
    assert r0.finish_s == pytest.approx(1.26, abs=EPS)
    assert r0.ttft_s == pytest.approx(1.0, abs=EPS)
    assert r0.tbt_s == pytest.approx(0.026, abs=EPS)
    assert r1.cached_tokens == 512
    assert r1.ttft_s == pytest.approx(0.888, abs=EPS)
    assert r1.finish_s == pytest.approx(1.2, abs=EPS)
    assert r1.tbt_s == pytest.approx(0.056, abs=EPS)
    assert r1.est_ttft_s == pytest.approx(r1.ttft_s, abs=EPS)
    assert (r0.prefill, r0.decode) == ("p0", "d0")
    d = c.decode[0]
    assert (d.steps, d.context_tokens, d.reserved_tokens, d.active, d.incoming) == (
        10, 0, 0, {}, {})
    # Token intervals: r0 0.115 (KV transfer + first step), 0.015 x 3, 0.02 x 2, 0.015 x 4;
    # r1 0.092 (1.088 -> 1.180), 0.02. Ten and two intervals: the tail mean is the longest.
    assert (r0.tail_tbt_s, r0.max_tbt_s) == (pytest.approx(0.115, abs=EPS),) * 2
    assert (r1.tail_tbt_s, r1.max_tbt_s) == (pytest.approx(0.092, abs=EPS),) * 2
    s = summarize(run.records, Slo(ttft_s=1.0, tbt_s=0.05), tbt_statistic=MEAN)
    assert s["avg_ttft_s"] == pytest.approx(0.944, abs=EPS)
    assert s["slo_attainment"] == 0.5 and s["effective_requests"] == 1  # r1's TBT misses
    assert s["tbt_slo_statistic"] == "mean"
    s = summarize(run.records, Slo(ttft_s=1.0, tbt_s=0.05))  # tail mean: both miss
    assert (s["slo_attainment"], s["tbt_slo_statistic"]) == (0.0, "tail-mean")
    assert s["tail_tbt_s"] == pytest.approx((0.115 + 0.092) / 2, abs=EPS)
    assert s["avg_tbt_s"] == pytest.approx((0.026 + 0.056) / 2, abs=EPS)
    s = summarize(run.records, Slo(ttft_s=1.0, tbt_s=0.1))
    assert s["effective_requests"] == 1  # r1 (0.092) meets 100 ms, r0 (0.115) does not
    assert s["cache_hit_ratio"] == pytest.approx(512 / 1_600)


def test_kv_streams_during_prefill_layer_by_layer() -> None:
    # r0 alone: prefill 0 -> 1.0, whole KV transfer 0.1 s. Streamed over 80 layers it
    # lands at max(1.0 + 0.1/80, 1.0/80 + 0.1) = 1.00125, then 10 steps of 15 ms: the
    # first interval is 16.25 ms (not 115 ms as without overlap), the tail TBT too.
    run = simulate([r(0, 0.0, 1_000, 11)], conductor=one_by_one())
    (r0,) = run.records
    assert r0.first_token_s == pytest.approx(1.0, abs=EPS)
    assert r0.finish_s == pytest.approx(1.00125 + 10 * 0.015, abs=EPS)
    assert r0.tail_tbt_s == pytest.approx(0.01625, abs=EPS)
    assert r0.max_tbt_s == pytest.approx(0.01625, abs=EPS)
    # 4 layers: max(1.0 + 0.025, 0.25 + 0.1) = 1.025.
    (r0,) = simulate([r(0, 0.0, 1_000, 11)], conductor=one_by_one(), kv_stream_layers=4).records
    assert r0.max_tbt_s == pytest.approx(0.025 + 0.015, abs=EPS)
    with pytest.raises(ValueError, match="kv_stream_layers"):
        simulate([r(0, 0.0, 1_000, 11)], conductor=one_by_one(), kv_stream_layers=0)


def test_one_token_outputs_finish_at_prefill() -> None:
    run = simulate([r(0, 0.0, 300, 1)], conductor=one_by_one())
    (rec,) = run.records
    assert rec.first_token_s == rec.finish_s == pytest.approx(0.3)
    assert rec.tbt_s == 0.0


def test_baseline_rejects_late_and_wastes_the_prefill() -> None:
    # d0 holds 1,500 tokens; r0 reserves 1,101 and decodes 1.1 -> 2.6. r1 (reserving 400)
    # prefills 1.0 -> 1.3 and lands at 1.33, while r0 is there.
    reqs = [r(0, 0.0, 1_000, 101), r(1, 0.0, 300, 100)]
    run = simulate(reqs, conductor=one_by_one(rejection="baseline", kv=1_500),
                   kv_stream_layers=1)
    assert run.records[0].served and not run.records[1].served
    assert run.records[1].rejected == "decode KV cache full" and run.records[1].rejected_late
    assert run.wasted_prefill_s == pytest.approx(0.3)
    s = summarize(run.records, Slo())
    assert (s["rejected"], s["rejected_early"], s["rejected_late"]) == (1, 0, 1)


def test_predictive_rejects_the_same_request_before_its_prefill() -> None:
    # At r1's arrival the expected output is the mean so far, round(201 / 2) = 100: r0
    # is predicted in decode at 1.33 s (reserving 1,000 + 100), r1 needs 300 + 100.
    reqs = [r(0, 0.0, 1_000, 101), r(1, 0.0, 300, 100)]
    run = simulate(reqs, conductor=one_by_one(rejection="predictive", kv=1_450),
                   kv_stream_layers=1)
    assert run.records[1].rejected == "decode KV cache full"
    assert not run.records[1].rejected_late and run.wasted_prefill_s == 0.0
    assert run.records[0].finish_s == pytest.approx(2.6, abs=EPS)


def test_without_rejection_a_request_waits_for_kv_space() -> None:
    # r1 lands at 1.33 but fits only once r0 leaves at 2.6; then 99 steps of 15 ms.
    reqs = [r(0, 0.0, 1_000, 101), r(1, 0.0, 300, 100)]
    run = simulate(reqs, conductor=one_by_one(rejection="none", kv=1_500),
                   kv_stream_layers=1)
    r1 = run.records[1]
    assert r1.finish_s == pytest.approx(2.6 + 99 * 0.015, abs=EPS)
    assert r1.tbt_s == pytest.approx((2.6 + 99 * 0.015 - 1.3) / 99, abs=EPS)


def test_colocated_whole_prefill_stalls_decoding() -> None:
    # r0 prefills 0 -> 1.0; r1's prefill 1.0 -> 1.5 stalls r0; then a step of two
    # (20 ms) ends r1, and a step alone (15 ms) ends r0 at 1.535.
    reqs = [r(0, 0.0, 1_000, 3), r(1, 0.5, 500, 2)]
    run = simulate_colocated(reqs, instances=1, cost=COST, cache_blocks=10,
                             kv_capacity_tokens=10**6)
    r0, r1 = run.records
    assert r0.ttft_s == pytest.approx(1.0, abs=EPS)
    assert r0.tbt_s == pytest.approx((1.535 - 1.0) / 2, abs=EPS)
    assert r1.ttft_s == pytest.approx(1.0, abs=EPS)
    assert r1.tbt_s == pytest.approx(0.02, abs=EPS)
    # Token intervals: r0 0.52 (r1's 0.5 s prefill stalls it, then a 20 ms step) and 0.015;
    # two intervals, so the tail TBT is the longest; r1 has one interval of 0.02.
    assert r0.tail_tbt_s == pytest.approx(0.52, abs=EPS)
    assert r0.max_tbt_s == pytest.approx(0.52, abs=EPS)
    assert r1.tail_tbt_s == pytest.approx(0.02, abs=EPS)


def test_colocated_max_token_gap_is_the_longest_stall() -> None:
    reqs = [r(0, 0.0, 1_000, 3), r(1, 0.5, 500, 2)]
    engines: list[ColocatedEngine] = []
    run = simulate_colocated(reqs, instances=1, cost=COST, cache_blocks=10,
                             kv_capacity_tokens=10**6, engines_out=engines)
    log = engines[0].iterations
    assert log is not None
    assert [t for it in log for t in it] == pytest.approx([0.0, 1.0, 1.0, 1.5, 1.5, 1.52,
                                                           1.52, 1.535])
    gaps = max_token_gaps(run.records, engines)
    assert gaps == {0: pytest.approx(0.5), 1: pytest.approx(0.02)}


def test_colocated_chunked_prefill_interleaves() -> None:
    # 400-token chunks: r0 0 -> 0.4 -> 0.8 -> 1.0 (first token). Then r1's chunks ride
    # with r0's steps: 1.0 -> 1.415 (400 + a 15 ms step), 1.415 -> 1.53 (100 + a step;
    # r0's third token ends it), r1's first token at 1.53, its one step ends 1.545.
    reqs = [r(0, 0.0, 1_000, 3), r(1, 0.5, 500, 2)]
    run = simulate_colocated(reqs, instances=1, cost=COST, cache_blocks=10,
                             kv_capacity_tokens=10**6, chunk_tokens=400)
    r0, r1 = run.records
    assert r0.ttft_s == pytest.approx(1.0, abs=EPS)
    assert r0.finish_s == pytest.approx(1.53, abs=EPS)
    assert r1.first_token_s == pytest.approx(1.53, abs=EPS)
    assert r1.finish_s == pytest.approx(1.545, abs=EPS)


def test_colocated_routes_to_the_instance_with_the_prefix() -> None:
    reqs = [r(0, 0.0, 1_100, 2, ("a", "b")), r(1, 5.0, 1_100, 2, ("x",)),
            r(2, 10.0, 1_200, 2, ("a", "b"))]
    run = simulate_colocated(reqs, instances=2, cost=COST, cache_blocks=10,
                             kv_capacity_tokens=10**6)
    assert [x.prefill for x in run.records] == ["c0", "c0", "c0"]
    assert run.records[2].cached_tokens == 1_024
    busy = [r(0, 0.0, 5_000, 2), r(1, 0.0, 1_100, 2, ("a",))]
    run = simulate_colocated(busy, instances=2, cost=COST, cache_blocks=10,
                             kv_capacity_tokens=10**6)
    assert [x.prefill for x in run.records] == ["c0", "c1"]


def random_trace(n: int, seed: int) -> list[TraceRequest]:
    rng = random.Random(seed)
    out, t = [], 0
    for _ in range(n):
        t += rng.randrange(0, 400)
        length = rng.randrange(100, 6_000)
        head = rng.randrange(3)  # three shared conversation heads
        ids = [head * 1_000 + j for j in range(length // 512 + 1)]
        if rng.random() < 0.5:
            ids[1:] = [rng.randrange(10**6, 10**7) for _ in ids[1:]]
        out.append(TraceRequest(timestamp_ms=t, input_length=length,
                                output_length=rng.randrange(1, 60), hash_ids=tuple(ids)))
    return out


def test_requests_from_trace_scales_time_and_keys_full_blocks() -> None:
    trace = [TraceRequest(timestamp_ms=1_000, input_length=1_100, output_length=5,
                          hash_ids=(7, 8, 9)),
             TraceRequest(timestamp_ms=3_000, input_length=100, output_length=0,
                          hash_ids=(1,))]
    reqs = requests_from_trace(trace, speed=2.0)
    assert [q.arrival_s for q in reqs] == [0.5, 1.5]
    assert [q.block_keys for q in reqs] == [(7, 8), ()]
    assert [q.id for q in requests_from_trace(trace, limit=1)] == [0]
    with pytest.raises(ValueError):
        requests_from_trace(trace, speed=0)


@pytest.mark.parametrize("policy", ["random", "load-balancing", "local-cache-aware",
                                    "global-cache-aware"])
def test_estimated_ttft_is_the_simulated_ttft(policy: str) -> None:
    reqs = requests_from_trace(random_trace(300, seed=3))
    c = build_conductor(ClusterSpec(prefill=3, decode=2, cache_blocks=20,
                                    kv_capacity_tokens=200_000), COST, policy=policy,
                        rejection="none", slo=Slo())
    run = simulate(reqs, conductor=c)
    assert all(x.served for x in run.records)
    for x in run.records:
        assert x.ttft_s == pytest.approx(x.est_ttft_s, abs=1e-9)
    assert all(not d.active and not d.incoming for d in c.decode)
    assert all(p.queued == 0 for p in c.prefill)


def test_cache_aware_policies_reuse_more_on_a_shared_prefix_trace() -> None:
    reqs = requests_from_trace(random_trace(300, seed=5))
    hits = {}
    for policy in ("load-balancing", "local-cache-aware", "global-cache-aware"):
        run = simulate(reqs, spec=ClusterSpec(prefill=3, decode=2, cache_blocks=20,
                                              kv_capacity_tokens=200_000), cost=COST,
                       policy=policy)
        hits[policy] = summarize(run.records, Slo())["cache_hit_ratio"]
    assert hits["load-balancing"] < hits["local-cache-aware"] <= hits["global-cache-aware"]
