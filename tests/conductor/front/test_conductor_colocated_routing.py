"""``conductor.front.colocated_routing``: a prefix another instance is computing is worth
waiting for in the store instead of computing it again or queueing behind it."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from conductor.front.colocated_routing import (
    ColocatedChoice,
    ColocatedRouter,
    ComputingPrefixes,
)
from conductor.front.kv_room import KvRoom
from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.state import LocalPrefixCache
from conductor.scheduling.types import InstanceId
from kvstore import block_keys

BT = 32
A, B = InstanceId("a"), InstanceId("b")
COST = PolyCostModel(kv_bytes_per_token=1, p_token=0.001, net_bytes_per_s=1.0, d_fixed=0.01)
"""1 ms per computed token, nothing else."""


class Instance:
    def __init__(self, queue_s: float = 0.0, in_flight: int = 0,
                 room: KvRoom | None = None) -> None:
        self.queue = queue_s
        self.in_flight = in_flight
        self.room = room

    def queue_s(self, *, mean_prompt_tokens: float, now: float) -> float:
        return self.queue

    def kv_wait_s(self, keys: Sequence[bytes], *, prompt_tokens: int, out_tokens: int,
                  now: float) -> float:
        if self.room is None:
            return 0.0
        return self.room.wait_s(keys, prompt_tokens=prompt_tokens, out_tokens=out_tokens,
                                now=now)

    def cost(self) -> PolyCostModel:
        return COST


def keys(n_tokens: int, seed: int = 0) -> list[bytes]:
    return block_keys([(seed + i) % 500 for i in range(n_tokens)], BT, "ns")


def router(queues: dict[InstanceId, float]) -> tuple[ColocatedRouter, ComputingPrefixes]:
    computing = ComputingPrefixes()
    return ColocatedRouter(instances={i: Instance(q) for i, q in queues.items()},
                           local={i: LocalPrefixCache(4096) for i in queues},
                           computing=computing, block_tokens=BT), computing


def test_longest_is_the_common_chain_and_the_earliest_among_equals() -> None:
    doc = keys(1216)  # 38 blocks
    other = keys(1216, seed=7)
    c = ComputingPrefixes()
    assert c.longest(doc) is None
    first = c.add(A, doc[:20], ready_at=5.0)
    c.add(B, other, ready_at=1.0)  # shares no block with doc
    got = c.longest(doc)
    assert got is not None and (got.instance, got.blocks, got.ready_at) == (A, 20, 5.0)
    c.add(B, doc[:20] + keys(64, seed=9)[:2], ready_at=3.0)  # same 20 blocks, then others
    got = c.longest(doc)
    assert got is not None and (got.instance, got.blocks) == (B, 20)  # ready sooner
    c.started(first, now=2.0)  # A's first token came: its blocks are being saved
    got = c.longest(doc)
    assert got is not None and (got.instance, got.ready_at) == (A, 2.0)
    c.started(first, now=4.0)  # later news does not push it back
    assert c.longest(doc) == got
    c.discard(first)
    c.discard(first)  # twice: nothing
    got = c.longest(doc)
    assert got is not None and got.instance == B and len(c) == 2


def test_a_request_waits_for_the_save_of_a_prefix_computing_elsewhere() -> None:
    """A is computing the document (first token in 0.5 s) and has another cold prefill
    queued after it; B is idle. The question waits for A's save and loads it on B: 0.5 s +
    its 24 tokens, against 1.24 s computing it all on B or 1.7 s queued on A."""
    r, computing = router({A: 1.7, B: 0.0})
    doc = keys(1216)
    r.local[A].use(doc)
    computing.add(A, doc, ready_at=10.5)
    got = r.choose(doc, stored=0, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert got == ColocatedChoice(est_s=pytest.approx(0.524), instance=B,
                                  cached_tokens=1216, await_blocks=38)


def test_a_busy_instance_waits_for_its_queue_not_the_save_and_its_own_computation_is_local(
        ) -> None:
    r, computing = router({A: 0.0, B: 2.0})
    doc = keys(1216)
    r.local[A].use(doc)
    computing.add(A, doc, ready_at=10.5)
    # A holds the document once computed (its own cache): A's estimate is its 24 tokens.
    got = r.choose(doc, stored=0, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.await_blocks, got.est_s) == (A, 0, pytest.approx(0.024))
    # Only B can take it (A gone from the candidates): its queue outlasts the save.
    only_b = ColocatedRouter(instances={B: Instance(2.0)}, local=r.local,
                             computing=computing, block_tokens=BT)
    got = only_b.choose(doc, stored=0, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.await_blocks, got.est_s) == (B, 38, pytest.approx(2.024))


def test_no_wait_when_the_store_or_the_cache_already_holds_as_much() -> None:
    r, computing = router({A: 1.0, B: 0.0})
    doc = keys(1216)
    computing.add(A, doc[:10], ready_at=10.5)  # A computes the first 10 blocks only
    got = r.choose(doc, stored=10, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.await_blocks, got.cached_tokens) == (B, 0, 320)
    # A computation that ends later than computing here is not waited for either.
    computing.add(A, doc, ready_at=12.0)
    got = r.choose(doc, stored=10, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.await_blocks, got.est_s) == (B, 0, pytest.approx(0.92))


def test_a_session_s_instance_wins_within_the_slo_with_its_best_option() -> None:
    r, computing = router({A: 0.0, B: 0.3})
    doc = keys(1216)
    r.local[A].use(doc)
    computing.add(A, doc, ready_at=10.5)
    got = r.choose(doc, stored=0, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0,
                   prefer=B, prefer_within_s=1.0)
    assert (got.instance, got.await_blocks, got.est_s) == (B, 38, pytest.approx(0.524))
    got = r.choose(doc, stored=0, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0,
                   prefer=B, prefer_within_s=0.5)  # over its SLO: the best estimate
    assert (got.instance, got.await_blocks, got.est_s) == (A, 0, pytest.approx(0.024))


def test_the_front_holds_a_request_until_the_prefix_is_saved_then_says_it_is_stored(
        node) -> None:
    """``VllmFront._await_saved`` against a real node: the request waits while the blocks
    are missing, goes on once they are stored (telling the instance how many), and past
    its bound goes on with what the store held on arrival."""
    import asyncio
    import time

    from conductor.front.openai_api import STORED_PARAM
    from conductor.front.store_view import StoreView
    from conductor.front.vllm_front import FrontConfig, VllmFront, _Job
    from conductor.scheduling.types import Slo
    from kvstore import Client

    doc = keys(320, seed=11)  # 10 blocks
    with Client(node.addr) as client:
        cfg = FrontConfig(namespace="ns", block_tokens=BT, slo=Slo(ttft_s=5, tbt_s=1))
        f = VllmFront(config=cfg, store=StoreView(client), colocated=["http://a:1"])

        def job() -> _Job:
            return _Job(body={"prompt": [1]}, route="completions", path="/v1/completions",
                        tokens=[1] * 330, keys=doc, stored=2, out_tokens=1,
                        t0=time.monotonic(), session=None)

        async def saved_while_waiting() -> _Job:
            j = job()
            wait = asyncio.ensure_future(f._await_saved(j, 8, est_s=5.0))
            await asyncio.sleep(0.05)
            assert not wait.done()  # 0 of 8 blocks stored
            await asyncio.to_thread(client.put_batch, doc[:8], [b"kv"] * 8)
            await asyncio.wait_for(wait, 10)
            return j

        got = asyncio.run(saved_while_waiting())
        assert got.body["kv_transfer_params"] == {STORED_PARAM: 8}
        late = job()
        late.keys = keys(320, seed=12)  # never stored
        t0 = time.monotonic()
        asyncio.run(f._await_saved(late, 8, est_s=0.1))
        assert 1.0 <= time.monotonic() - t0 < 5.0  # at least a second
        assert late.body["kv_transfer_params"] == {STORED_PARAM: 2}  # as on arrival
        text = f.metrics.render().decode()
        assert 'conductor_save_waits_total{outcome="loaded"} 1.0' in text
        assert 'conductor_save_waits_total{outcome="timed_out"} 1.0' in text
        asyncio.run(f.close())


def test_a_tie_goes_to_the_instance_with_fewer_requests_in_flight_then_the_first() -> None:
    """Nothing queued anywhere and the document in the store: both estimate the same. The
    request goes where fewer of the front's requests are decoding, not always to A."""
    doc = keys(1216)
    r, _ = router({A: 0.0, B: 0.0})
    got = r.choose(doc, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.cached_tokens) == (A, 1216)  # equal in flight: the first
    busy_a = ColocatedRouter(instances={A: Instance(0.0, in_flight=3),
                                        B: Instance(0.0, in_flight=1)},
                             local=r.local, computing=ComputingPrefixes(), block_tokens=BT)
    got = busy_a.choose(doc, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0)
    assert (got.instance, got.est_s) == (B, pytest.approx(0.024))
    # Within TIE_S (0.5 ms more queued on B) still a tie; 2 ms more is not.
    close = ColocatedRouter(instances={A: Instance(0.0, in_flight=3),
                                       B: Instance(0.0005, in_flight=1)},
                            local=r.local, computing=ComputingPrefixes(), block_tokens=BT)
    assert close.choose(doc, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000,
                        now=10.0).instance == B
    apart = ColocatedRouter(instances={A: Instance(0.0, in_flight=3),
                                       B: Instance(0.002, in_flight=1)},
                            local=r.local, computing=ComputingPrefixes(), block_tokens=BT)
    assert apart.choose(doc, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000,
                        now=10.0).instance == A


def test_a_request_goes_where_the_kv_cache_has_room_for_it_not_only_an_empty_queue() -> None:
    """Each instance's cache holds 2,200 tokens; neither has a prefill queued. A is decoding
    a question of document X (expected over at 10.6), B one of Y (over at 10.3). A question
    of a third document, stored, fits on neither: it goes to B, whose request ends first,
    and is estimated from then. A question of X fits on A beside X's blocks: A, at once."""
    x, y, z = keys(1216, seed=1), keys(1216, seed=2), keys(1216, seed=3)
    rooms = {A: KvRoom(capacity_tokens=2200, block_tokens=BT),
             B: KvRoom(capacity_tokens=2200, block_tokens=BT)}
    rooms[A].add(x, prompt_tokens=1240, out_tokens=16, ends_at=10.6)
    rooms[B].add(y, prompt_tokens=1240, out_tokens=16, ends_at=10.3)
    r = ColocatedRouter(instances={A: Instance(room=rooms[A]), B: Instance(room=rooms[B])},
                        local={i: LocalPrefixCache(4096) for i in (A, B)},
                        computing=ComputingPrefixes(), block_tokens=BT)
    got = r.choose(z, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0,
                   out_tokens=16)
    assert (got.instance, got.est_s) == (B, pytest.approx(0.3 + 0.024))
    got = r.choose(x, stored=38, prompt_tokens=1240, mean_prompt_tokens=1000, now=10.0,
                   out_tokens=16)
    assert (got.instance, got.est_s) == (A, pytest.approx(0.024))
    # Sent to B, it holds its blocks there until 10.9: the next document's question now
    # has room soonest on A (X's question over at 10.6).
    rooms[B].add(z, prompt_tokens=1240, out_tokens=16, ends_at=10.9)
    got = r.choose(keys(1216, seed=4), stored=38, prompt_tokens=1240,
                   mean_prompt_tokens=1000, now=10.0, out_tokens=16)
    assert (got.instance, got.est_s) == (A, pytest.approx(0.6 + 0.024))


def test_a_router_needs_a_block_size() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        ColocatedRouter(instances={}, local={}, computing=ComputingPrefixes(), block_tokens=0)
