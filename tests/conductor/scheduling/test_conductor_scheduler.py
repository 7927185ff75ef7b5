"""The Conductor's decisions: policies, decode choice and rejection modes, exactly.

Cost model of these tests (``COST``): prefill 1 ms per new token, KV 1 byte per
token moved at 51,200 B/s (10 ms per 512-token block, 19.53 ms per 1,000 tokens),
decode step 10 ms whatever the batch.
"""

from __future__ import annotations

import random

import pytest

from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.policies import POLICIES, make_policy
from conductor.scheduling.rejection import REJECTION_MODES, make_rejection
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PoolIndex, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo

COST = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=51_200, d_fixed=0.01)


def cluster(*, prefill: int = 2, decode: int = 1, policy: str = "global-cache-aware",
            rejection: str = "none", slo: Slo | None = None, cost: PolyCostModel = COST,
            kv: int = 10**9, seed: int = 0, mean_output: float | None = None) -> Conductor:
    pool = PoolIndex()
    return Conductor(
        prefill=[PrefillInstance(id=InstanceId(f"p{i}"), cache=LocalPrefixCache(100, pool))
                 for i in range(prefill)],
        decode=[DecodeInstance(id=InstanceId(f"d{i}"), kv_capacity_tokens=kv)
                for i in range(decode)],
        cost=cost, policy=policy, rejection=rejection, slo=slo, pool=pool, seed=seed,
        mean_output_tokens=mean_output)


def req(i: int, prompt: int, keys: tuple[str, ...] = (), output: int = 10) -> Request:
    return Request(id=RequestId(i), arrival_s=0.0, prompt_tokens=prompt, output_tokens=output,
                   block_keys=keys)


# ---- prefill policies ----------------------------------------------------------------------

def test_local_cache_aware_picks_the_instance_holding_the_prefix() -> None:
    c = cluster(policy="local-cache-aware")
    c.prefill[1].cache.use(["a", "b"])
    d = c.schedule(req(1, 1_100, ("a", "b")), now=0.0)
    assert d.accepted and d.prefill == "p1" and d.decode == "d0"
    assert d.plan is not None
    assert (d.plan.local_blocks, d.plan.fetch_blocks, d.cached_tokens) == (2, 0, 1_024)
    assert d.est_ttft_s == pytest.approx(0.076)  # 76 new tokens


def test_global_cache_aware_fetches_to_a_less_loaded_instance() -> None:
    c = cluster(policy="global-cache-aware")
    c.prefill[0].cache.use(["a", "b"])
    c.prefill[0].busy_until_s = 5.0
    d = c.schedule(req(1, 1_100, ("a", "b")), now=0.0)
    # p0: 5 s queue + 0.076 s; p1: fetch 2 blocks (0.02 s) + 0.076 s beats computing 1.1 s.
    assert d.prefill == "p1"
    assert d.plan is not None
    assert (d.plan.local_blocks, d.plan.fetch_blocks) == (0, 2)
    assert d.plan.transfer_s == pytest.approx(0.02)
    assert d.est_ttft_s == pytest.approx(0.096)
    # Committed: p1 queued the work and now holds the hot prefix too (replicated).
    assert c.prefill[1].busy_until_s == pytest.approx(0.096)
    assert c.pool.prefix_len(["a", "b"]) == 2
    assert c.prefill[1].cache.prefix_len(["a", "b"]) == 2
    assert c.decode[0].incoming[RequestId(1)].ready_s == pytest.approx(0.096 + 1_100 / 51_200)


def test_global_cache_aware_stays_when_the_holder_is_nearly_free() -> None:
    c = cluster(policy="global-cache-aware")
    c.prefill[0].cache.use(["a", "b"])
    c.prefill[0].busy_until_s = 0.01
    d = c.schedule(req(1, 1_100, ("a", "b")), now=0.0)
    assert d.prefill == "p0" and d.plan is not None and d.plan.fetch_blocks == 0
    assert d.est_ttft_s == pytest.approx(0.086)


def test_global_cache_aware_computes_when_transfer_is_dearer_than_compute() -> None:
    slow_net = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=256,
                             d_fixed=0.01)  # 2 s per block
    c = cluster(policy="global-cache-aware", cost=slow_net)
    c.prefill[0].cache.use(["a", "b"])
    c.prefill[0].busy_until_s = 5.0
    d = c.schedule(req(1, 1_100, ("a", "b")), now=0.0)
    assert d.prefill == "p1" and d.plan is not None and d.plan.fetch_blocks == 0
    assert d.est_ttft_s == pytest.approx(1.1)


def test_local_cache_aware_never_fetches() -> None:
    c = cluster(policy="local-cache-aware")
    c.prefill[0].cache.use(["a", "b"])
    c.prefill[0].busy_until_s = 5.0
    d = c.schedule(req(1, 1_100, ("a", "b")), now=0.0)
    assert d.prefill == "p1" and d.plan is not None and d.plan.fetch_blocks == 0
    assert d.est_ttft_s == pytest.approx(1.1)


def test_load_balancing_picks_the_least_queued_whatever_the_cache() -> None:
    c = cluster(prefill=3, policy="load-balancing")
    for p, busy in zip(c.prefill, (2.0, 1.0, 3.0), strict=True):
        p.busy_until_s = busy
    c.prefill[2].cache.use(["a"])
    d = c.schedule(req(1, 600, ("a",)), now=0.5)
    assert d.prefill == "p1" and d.cached_tokens == 0
    assert d.plan is not None and d.plan.queue_s == pytest.approx(0.5)
    assert d.est_ttft_s == pytest.approx(1.1)


def test_ties_go_to_the_lowest_index() -> None:
    for name in ("load-balancing", "local-cache-aware", "global-cache-aware"):
        c = cluster(prefill=3, policy=name)
        assert c.schedule(req(1, 100), now=0.0).prefill == "p0"


def test_random_is_seeded() -> None:
    c = cluster(prefill=4, policy="random", seed=7)
    rng = random.Random(7)
    chosen = [c.schedule(req(i, 100), now=float(i)).prefill for i in range(20)]
    assert chosen == [f"p{rng.randrange(4)}" for _ in range(20)]
    assert len(set(chosen)) > 1


def test_the_last_prompt_token_is_always_computed() -> None:
    c = cluster(policy="local-cache-aware")
    c.prefill[0].cache.use(["a", "b"])
    d = c.schedule(req(1, 1_024, ("a", "b")), now=0.0)  # fully cached prompt
    assert d.cached_tokens == 1_023 and d.est_ttft_s == pytest.approx(0.001)


def test_registries_and_unknown_names() -> None:
    assert list(POLICIES) == ["random", "load-balancing", "local-cache-aware",
                              "global-cache-aware"]
    assert list(REJECTION_MODES) == ["none", "baseline", "load", "predictive"]
    with pytest.raises(ValueError, match="unknown policy"):
        make_policy("fastest")
    with pytest.raises(ValueError, match="unknown rejection"):
        make_rejection("sometimes")


def test_a_request_is_scheduled_once() -> None:
    c = cluster()
    c.schedule(req(1, 100), now=0.0)
    with pytest.raises(ValueError, match="already scheduled"):
        c.schedule(req(1, 100), now=0.0)


def test_prefill_instance_names_the_instance_scheduled_onto() -> None:
    c = cluster()
    assert [c.prefill_instance(InstanceId(f"p{i}")) for i in range(2)] == c.prefill
    decision = c.schedule(req(1, 100), now=0.0)
    assert decision.plan is not None
    inst = c.prefill_instance(decision.plan.instance)
    assert inst.queue_s(0.0) > 0  # the request is queued there
    with pytest.raises(KeyError):
        c.prefill_instance(InstanceId("d0"))  # a decode instance is not a prefill one


# ---- decode choice -------------------------------------------------------------------------

def test_decode_choice_uses_the_load_predicted_at_arrival() -> None:
    tbt_cost = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=51_200,
                             d_fixed=0.01, d_seq=0.001)
    c = cluster(decode=2, cost=tbt_cost)
    # d0 is busy now but its request ends in 10 steps (~0.1 s); d1 is idle now but a
    # request lands on it at 0.5 s and stays. The new request reaches decode at ~1.02 s.
    c.decode[0].start(RequestId(90), 100, 10, 11)
    c.decode[1].expect(RequestId(91), 0.5, 100, 1_000)
    d = c.schedule(req(1, 1_000), now=0.0)
    assert d.decode == "d0"
    assert d.est_tbt_s == pytest.approx(0.011)  # alone in d0's batch by then


# ---- rejection -----------------------------------------------------------------------------

def test_ttft_check_rejects_exactly_the_request_that_would_wait_too_long() -> None:
    c = cluster(prefill=1, rejection="baseline", slo=Slo(ttft_s=1.0, tbt_s=1.0))
    first = c.schedule(req(1, 800), now=0.0)
    second = c.schedule(req(2, 800), now=0.0)
    third = c.schedule(req(3, 150), now=0.0)
    assert first.accepted and third.accepted
    assert not second.accepted and second.reason == "TTFT 1.60 s > SLO 1.00 s"
    assert c.prefill[0].busy_until_s == pytest.approx(0.95)  # the rejected one queued nothing
    assert set(c.decode[0].incoming) == {RequestId(1), RequestId(3)}
    none = cluster(prefill=1, rejection="none", slo=Slo(ttft_s=1.0, tbt_s=1.0))
    none.schedule(req(1, 800), now=0.0)
    assert none.schedule(req(2, 800), now=0.0).accepted


def full_decode(c: Conductor, remaining: int) -> None:
    """d0 (capacity 3,000) holds a request reserving 2,100 tokens for ``remaining`` steps."""
    c.decode[0].start(RequestId(90), 2_000, remaining, 100)


def test_load_rejects_at_arrival_when_decode_is_full_now() -> None:
    c = cluster(rejection="load", kv=3_000)
    full_decode(c, remaining=100)
    d = c.schedule(req(1, 1_000), now=0.0)
    assert not d.accepted and d.reason == "decode KV cache full"
    assert c.prefill[0].busy_until_s == 0.0 and not c.decode[0].incoming


def test_baseline_admits_then_rejects_at_decode_wasting_the_prefill() -> None:
    c = cluster(rejection="baseline", kv=3_000)
    full_decode(c, remaining=1_000)
    d = c.schedule(req(1, 1_000), now=0.0)
    assert d.accepted and c.prefill[0].busy_until_s == pytest.approx(1.0)
    c.prefill_done(RequestId(1), 1.0)
    reason = c.decode_arrival(RequestId(1), 1.02, prompt_tokens=1_000, output_tokens=10)
    assert reason == "decode KV cache full"
    assert not c.decode[0].incoming  # forgotten


def test_baseline_admits_at_decode_when_it_fits() -> None:
    c = cluster(rejection="baseline", kv=3_000)
    c.schedule(req(1, 1_000), now=0.0)
    assert c.decode_arrival(RequestId(1), 1.02, prompt_tokens=1_000, output_tokens=10) is None
    assert c.decode[0].incoming[RequestId(1)].ready_s == 1.02


def test_predictive_admits_what_load_rejects_when_decode_frees_in_time() -> None:
    # Every request is assumed to generate 101 tokens: 100 decode steps of 10 ms = 1.0 s.
    # The resident request has run 0 steps; the new one reaches decode after 1.0 s of
    # prefill + 19.5 ms of transfer = 101.95 steps: the resident is predicted gone.
    # Its real length (1,000 more steps) is not used: the prediction is system-level.
    load = cluster(rejection="load", kv=3_000, mean_output=101)
    full_decode(load, remaining=1_000)
    d = load.schedule(req(1, 1_000), now=0.0)
    assert not d.accepted and d.reason == "decode KV cache full"  # 2,100 + 1,101 > 3,000
    pred = cluster(rejection="predictive", kv=3_000, mean_output=101)
    full_decode(pred, remaining=1_000)
    d = pred.schedule(req(1, 1_000), now=0.0)
    assert d.accepted and d.decode == "d0" and d.est_tbt_s == pytest.approx(0.01)
    # The resident ran 0 steps; with t_d = 103 steps it is predicted to be still there
    # at 101.95 steps, and predictive rejects too, although it really leaves at step 5.
    late = cluster(rejection="predictive", kv=3_000, mean_output=104)
    full_decode(late, remaining=5)
    d = late.schedule(req(1, 1_000), now=0.0)
    assert not d.accepted and d.reason == "decode KV cache full"
    # Steps already run count: after 2 of its 103 steps it is predicted gone by 101.95.
    ran = cluster(rejection="predictive", kv=3_000, mean_output=104)
    full_decode(ran, remaining=5)
    ran.decode[0].step()
    ran.decode[0].step()
    assert ran.schedule(req(1, 1_000), now=0.0).accepted


def test_predicted_load_uses_the_uniform_output_length_only() -> None:
    # Hand-built decode state at now = 0, steps of 1/64 s, prediction for at_s = 0.5 s
    # (32 steps ahead), t_d = 50 decode steps (51 tokens):
    #   1: ran 45 steps      -> predicted gone after 5 more  (really 500 more)
    #   2: ran 10 steps      -> predicted there until step 40 (really ends in 1 step)
    #   3: KV ready at 0.25 s -> has run 16 steps by 0.5 s, counted with 3,000 + 51
    #   4: KV ready at 0.75 s -> after 0.5 s, not counted
    cost = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=51_200,
                         d_fixed=1 / 64)
    d = DecodeInstance(id=InstanceId("d0"), kv_capacity_tokens=10**6)
    d.start(RequestId(1), 1_000, 545, 546)
    for _ in range(35):
        d.step()
    d.start(RequestId(2), 2_000, 11, 12)
    for _ in range(10):
        d.step()
    d.expect(RequestId(3), 0.25, 3_000, 7)
    d.expect(RequestId(4), 0.75, 4_000, 7)
    view = REJECTION_MODES["predictive"].arrival_view
    assert view is not None
    load = view.load(d, now=0.0, at_s=0.5, cost=cost, output_tokens=51)
    assert (load.batch, load.context_tokens, load.reserved_tokens) == (
        2, 2_000 + 10 + 32 + 3_000 + 16, 2_012 + 3_051)
    # The current view: 1 and 2 as they are, nothing waiting at the instance yet.
    current = REJECTION_MODES["load"].arrival_view
    assert current is not None
    cur = current.load(d, now=0.0, at_s=0.5, cost=cost, output_tokens=51)
    assert (cur.batch, cur.context_tokens, cur.reserved_tokens) == (
        2, 1_045 + 2_010, 1_546 + 2_012)
    with pytest.raises(ValueError, match="expected output"):
        view.load(d, now=0.0, at_s=0.5, cost=cost)


def test_expected_output_is_the_running_mean_of_requests_seen() -> None:
    c = cluster()
    assert c.expected_output_tokens() == 1
    c.schedule(req(1, 100, output=10), now=0.0)
    c.schedule(req(2, 100, output=31), now=0.0)
    assert c.expected_output_tokens() == 20  # 41 / 2 = 20.5, rounded half to even
    assert cluster(mean_output=342.6).expected_output_tokens() == 343
    with pytest.raises(ValueError, match="mean_output_tokens"):
        cluster(mean_output=0.5)


def test_predictive_counts_requests_predicted_to_arrive_first() -> None:
    # Every request is assumed to generate 1,000 tokens. Request 1 (2,000 + 1,000
    # tokens reserved) reaches decode at 2.04 s and decodes for ~10 s. Request 2
    # (1,500 + 1,000) queues behind it on the one prefill instance and would reach
    # decode at 3.53 s, when request 1 is there: 5,500 > 5,000 tokens. Only the
    # predictive mode sees it; the others see an empty decode instance now.
    for mode, accepted in (("none", True), ("baseline", True), ("load", True),
                           ("predictive", False)):
        c = cluster(prefill=1, rejection=mode, kv=5_000, mean_output=1_000)
        assert c.schedule(req(1, 2_000, output=1_000), now=0.0).accepted
        d = c.schedule(req(2, 1_500, output=600), now=0.0)
        assert d.accepted is accepted, mode
        if not accepted:
            assert d.reason == "decode KV cache full"
        else:
            assert d.est_ttft_s == pytest.approx(3.5)


def test_tbt_slo_rejects_a_batch_that_would_step_too_slowly() -> None:
    tbt_cost = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=51_200,
                             d_fixed=0.01, d_seq=0.004)  # 14 ms alone, 18 ms in pairs
    c = cluster(rejection="load", cost=tbt_cost, slo=Slo(ttft_s=30.0, tbt_s=0.015))
    assert c.schedule(req(1, 100), now=0.0).accepted  # alone: 14 ms
    c.decode[0].start(RequestId(1), 100, 9, 10)
    d = c.schedule(req(2, 100), now=0.0)
    assert not d.accepted and d.reason == "decode TBT 18 ms > SLO 15 ms"
    assert d.est_tbt_s == pytest.approx(0.018)
