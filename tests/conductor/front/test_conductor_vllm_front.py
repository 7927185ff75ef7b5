"""``conductor.front.vllm_front``: the routing decisions, without instances (the engine tests run
the whole flow against real vLLM servers)."""

from __future__ import annotations

import asyncio

import pytest

from conductor.front.store_view import StoreView
from conductor.front.vllm_front import FrontConfig, VllmConductor, VllmFront
from conductor.front.vllm_instances import Calibration, InstanceLoad
from conductor.scheduling.state import LocalPrefixCache, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo
from kvstore import block_keys

BT = 32
A, B = "http://a:1", "http://b:2"


def front(*colocated: str) -> VllmFront:
    cfg = FrontConfig(namespace="ns", block_tokens=BT, slo=Slo(ttft_s=5, tbt_s=1))
    return VllmFront(config=cfg, store=StoreView(None), colocated=colocated)


def keys(n_tokens: int, seed: int = 0) -> list[bytes]:
    return block_keys([(seed + i) % 500 for i in range(n_tokens)], BT, "ns")


def calibrated(s_per_token: float) -> Calibration:
    c = Calibration()
    c.observe_prefill(computed_tokens=1000, seconds=1000 * s_per_token)
    return c


def test_colocated_prefers_the_instance_holding_the_prefix() -> None:
    f = front(A, B)
    ks = keys(320)  # 10 blocks
    f._local[InstanceId(B)].use(ks[:8])
    c = f.choose_colocated(ks, stored=0, prompt_tokens=330)
    est, iid = c.est_s, c.instance
    assert iid == B
    # B computes 330 - 256 tokens at the default 1 ms/token
    assert est == pytest.approx(0.074)


def test_the_store_prefix_counts_for_every_instance_and_ties_go_first() -> None:
    f = front(A, B)
    ks = keys(320)
    f._local[InstanceId(B)].use(ks[:4])
    c = f.choose_colocated(ks, stored=8, prompt_tokens=330)
    est, iid = c.est_s, c.instance
    assert (iid, est) == (A, pytest.approx(0.074))


def test_the_queue_outweighs_a_cached_prefix() -> None:
    f = front(A, B)
    ks = keys(320)
    f._local[InstanceId(B)].use(ks)
    inst_b = f.colocated[InstanceId(B)]
    inst_b.load = InstanceLoad(running=4, waiting=3, kv_usage=0.5, external_hits=0)
    f._prompt_tokens_seen, f._requests_seen = 1000, 1  # mean prompt 1000 tokens
    c = f.choose_colocated(ks, stored=0, prompt_tokens=330)
    est, iid = c.est_s, c.instance
    # B: 3 waiting x 1000 tokens x 1 ms + 10 tokens = 3.01 s; A: 330 tokens = 0.33 s
    assert (iid, est) == (A, pytest.approx(0.33))


def test_colocated_instances_learn_one_speed() -> None:
    """What one instance's prefills teach holds for all: the instances serve one model,
    and an instance is never left with a stale estimate nothing corrects."""
    f = front(A, B)
    a, b = f.colocated[InstanceId(A)], f.colocated[InstanceId(B)]
    assert a.calibration is b.calibration
    a.start_prefill(1000).release(seconds=2.0)  # 2 ms/token observed on A
    assert b.calibration.cost().prefill_s(100, 0) == pytest.approx(0.2)
    ks = keys(320)
    b.start_prefill(200)  # B is busy: A gets the next, at the speed both share
    c = f.choose_colocated(ks, stored=0, prompt_tokens=330)
    assert (c.est_s, c.instance) == (pytest.approx(0.66), A)


def test_the_disaggregated_scheduler_uses_each_instances_own_speed() -> None:
    from conductor.scheduling.state import DecodeInstance

    fast, slow = InstanceId("p-fast"), InstanceId("p-slow")
    c = VllmConductor(
        costs={fast: calibrated(0.001).cost(), slow: calibrated(0.01).cost()},
        prefill=[PrefillInstance(id=i, cache=LocalPrefixCache(64)) for i in (slow, fast)],
        decode=[DecodeInstance(id=InstanceId("d"), kv_capacity_tokens=1 << 20)],
        cost=Calibration().cost(), policy="global-cache-aware", rejection="none",
        slo=Slo(ttft_s=10, tbt_s=1))
    ks = tuple(keys(640))
    d = c.schedule(Request(id=RequestId(1), arrival_s=0, prompt_tokens=650, output_tokens=4,
                           block_keys=ks, block_tokens=BT), 0.0)
    assert d.prefill == fast
    assert d.est_ttft_s == pytest.approx(0.65)


def test_mode_arguments_are_checked() -> None:
    cfg = FrontConfig(namespace="ns", block_tokens=BT, slo=Slo())
    with pytest.raises(ValueError, match="cannot be combined"):
        VllmFront(config=cfg, store=StoreView(None), colocated=[A], prefill=[B])
    with pytest.raises(ValueError, match="need --vllm-prefill and --vllm-decode"):
        VllmFront(config=cfg, store=StoreView(None), prefill=[A])


def test_an_empty_prompt_is_a_400_before_any_instance_is_asked() -> None:
    f = front(A)
    reply = asyncio.run(f.complete({"prompt": [], "max_tokens": 3}, route="completions"))
    assert reply.status == 400
    assert "non-empty list of token ids" in reply.body["error"]["message"]
    asyncio.run(f.close())


def test_a_session_keeps_its_colocated_instance_while_it_meets_the_slo() -> None:
    f = front(A, B)  # TTFT SLO 5 s
    ks = keys(320)
    f._local[InstanceId(A)].use(ks)  # A holds the prefix: the better estimate
    c = f.choose_colocated(ks, stored=0, prompt_tokens=330, prefer=InstanceId(B))
    est, iid = c.est_s, c.instance
    assert (iid, est) == (B, pytest.approx(0.33))  # B's 330 tokens meet the SLO
    f.colocated[InstanceId(B)].calibration = calibrated(0.02)  # B: 6.6 s, over the SLO
    c = f.choose_colocated(ks, stored=0, prompt_tokens=330, prefer=InstanceId(B))
    est, iid = c.est_s, c.instance
    assert iid == A


def test_a_session_keeps_its_prefill_instance_while_it_meets_the_slo() -> None:
    from conductor.front.vllm_front import PreferSession
    from conductor.scheduling.policies import make_policy
    from conductor.scheduling.state import DecodeInstance

    fast, slow = InstanceId("p-fast"), InstanceId("p-slow")
    prefer = PreferSession(make_policy("global-cache-aware"), ttft_slo_s=1.0)
    c = VllmConductor(
        costs={fast: calibrated(0.001).cost(), slow: calibrated(0.0015).cost()},
        prefill=[PrefillInstance(id=i, cache=LocalPrefixCache(64)) for i in (fast, slow)],
        decode=[DecodeInstance(id=InstanceId("d"), kv_capacity_tokens=1 << 20)],
        cost=Calibration().cost(), policy=prefer, rejection="none",
        slo=Slo(ttft_s=1.0, tbt_s=1))

    def schedule(rid: int, n_tokens: int) -> InstanceId:
        ks = tuple(keys(n_tokens // BT * BT, seed=rid))
        d = c.schedule(Request(id=RequestId(rid), arrival_s=0, prompt_tokens=n_tokens,
                               output_tokens=4, block_keys=ks, block_tokens=BT), 0.0)
        c.prefill_done(RequestId(rid), 0.0)  # each starts on empty queues
        c.forget(RequestId(rid))
        assert d.prefill is not None
        return d.prefill

    assert schedule(1, 650) == fast  # no session: the best estimate
    prefer.preferred = slow
    assert schedule(2, 650) == slow  # 0.98 s on slow: within the 1 s SLO
    assert schedule(3, 700) == fast  # 1.05 s on slow would miss it


def test_a_sessions_turn_is_retained_prefetched_and_released_through_the_front() -> None:
    from conductor.front.vllm_front import _Job
    from kvstore.core.keys import BlockKey
    from kvstore.node.semantics import Node, NodeSettings

    node = Node(NodeSettings(dram_bytes=64 << 10, prefault=False))  # a real store, in process
    cfg = FrontConfig(namespace="ns", block_tokens=BT, slo=Slo(ttft_s=5, tbt_s=1),
                      session_retain_s=60)
    f = VllmFront(config=cfg, store=StoreView(node), colocated=[A])
    turn1, turn2 = keys(100), keys(170)  # 3 full blocks, then 5 (the same first 3)
    for k in turn2:
        assert node.put(BlockKey(k), memoryview(b"x" * 64))

    def retained() -> int:
        return int(node.stats()["node"]["retained_blocks"])

    def job(ks: list[bytes], arrival: asyncio.Future[int] | None) -> _Job:
        return _Job(body={}, route="completions", path="/v1/completions", tokens=[], keys=ks,
                    stored=len(ks), out_tokens=1, t0=0.0, session="s", arrival=arrival)

    async def run() -> None:
        assert f._session_arrival(None, turn1) is None  # no session: nothing asked
        first = f._session_arrival("s", turn1)
        assert first is not None
        f._turn_over(job(turn1, first))
        await f.sessions_settled()
        assert await first == 0  # nothing known of the session yet
        assert retained() == 3
        second = f._session_arrival("s", turn2)
        assert second is not None and await second == 3  # its first turn, to DRAM
        f._turn_over(job(turn2, second))
        await f.sessions_settled()
        assert retained() == 5
        assert f.status()["session_cache"]["prefetched_keys"] == 3
        f.sessions.remember("s", InstanceId(A), 0.0)
        assert await f.delete_session("s") is True
        assert retained() == 0 and f.sessions.instance("s", 0.0) is None
        assert await f.delete_session("s") is False
        await f.close()

    try:
        asyncio.run(run())
    finally:
        node.close()


def test_sessions_off_ask_nothing_of_the_store() -> None:
    f = front(A)  # session_retain_s defaults to 0
    assert not f.session_cache.enabled
    assert f._session_arrival("s", keys(100)) is None
    assert asyncio.run(f.sweep_sessions()) == 0


def test_the_stored_keys_are_every_shards_when_the_engines_have_several_ranks() -> None:
    from kvstore.core.keys import shard_key

    f = front(A)
    ks = [bytes(k) for k in keys(64)]
    assert f.stored_keys(ks) == ks  # one-rank engines: the block keys themselves
    f.shards = ("tp0of2.pp0of1", "tp1of2.pp0of1")
    assert f.stored_keys(ks) == [shard_key(k, s) for s in f.shards for k in ks]


def test_a_sessions_keys_keep_a_shared_prefix_block_by_block_across_shards() -> None:
    from kvstore.core.keys import shard_key

    f = front(A)
    short, long = [bytes(k) for k in keys(64)], [bytes(k) for k in keys(64 + 2 * BT)]
    assert f.session_keys(short) == short  # one-rank engines: the block keys themselves
    f.shards = ("tp0of2.pp0of1", "tp1of2.pp0of1")
    assert f.session_keys(short) == [shard_key(k, s) for k in short for s in f.shards]
    # The next turn extends the prompt: the last turn's list is a prefix of this one's.
    assert f.session_keys(long)[: 2 * len(short)] == f.session_keys(short)


def test_a_stored_prefix_goes_around_an_instance_busy_with_a_cold_prefill() -> None:
    """A holds the document in its own cache but is prefilling another, cold one; the
    store holds the document too, so B loads it instead of waiting behind A."""
    f = front(A, B)
    doc = keys(1216)  # 38 blocks
    f._local[InstanceId(A)].use(doc)
    a = f.colocated[InstanceId(A)]
    a.clock = lambda: 50.0  # the prefill begins at t=50; every choice below is at t=50
    a.start_prefill(1200)  # the cold prefill A is busy with (1.2 s at 1 ms/token)
    c = f.choose_colocated(doc, stored=38, prompt_tokens=1240, now=50.0)
    est, iid = c.est_s, c.instance
    assert iid == B and est == pytest.approx(0.024)  # only the question's 24 tokens
    # Without the store, A's cached prefix is worth waiting for while its queue is
    # shorter than B's recompute: 1.2 s + 24 tokens against 1,240 tokens.
    c = f.choose_colocated(doc, stored=0, prompt_tokens=1240, now=50.0)
    est, iid = c.est_s, c.instance
    assert (iid, est) == (A, pytest.approx(1.224))
    a.start_prefill(100)  # now 1.3 s + 24 tokens
    c = f.choose_colocated(doc, stored=0, prompt_tokens=1240, now=50.0)
    assert (c.est_s, c.instance) == (pytest.approx(1.24), B)
    # 0.5 s into A's prefill: 0.8 s + 24 tokens are left there, less than B's recompute.
    c = f.choose_colocated(doc, stored=0, prompt_tokens=1240, now=50.5)
    assert (c.est_s, c.instance) == (pytest.approx(0.824), A)


def test_a_front_that_learns_its_block_size_counts_stored_blocks_by_it() -> None:
    """``--block-tokens`` left to the instances (0): the router is built once the size is
    learnt, so a stored prefix counts its tokens (it counted none, and every hit was
    estimated, and learnt, as a whole prompt of compute)."""
    cfg = FrontConfig(namespace="ns", block_tokens=0, slo=Slo(ttft_s=5, tbt_s=1))
    f = VllmFront(config=cfg, store=StoreView(None), colocated=(A, B))
    ks = keys(320)
    with pytest.raises(RuntimeError, match="block size"):
        f.choose_colocated(ks, stored=8, prompt_tokens=330)
    f.set_block_tokens(BT)  # what start() does with what it learnt
    c = f.choose_colocated(ks, stored=8, prompt_tokens=330)
    assert (c.instance, c.cached_tokens, c.est_s) == (A, 256, pytest.approx(0.074))
