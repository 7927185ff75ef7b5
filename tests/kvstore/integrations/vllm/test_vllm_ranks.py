"""``kvstore.integrations.vllm.ranks``: which rank stores and reads which shard of a block
(the engine tests run it in vLLM's engine at TP=2)."""

from __future__ import annotations

import pytest

from kvstore.core.keys import block_keys, shard_key
from kvstore.integrations.vllm.ranks import ShardPlan, shard_chains, stored_prefix

KEYS = [bytes(k) for k in block_keys(list(range(96)), 32, "ns")]


def test_a_one_rank_engine_stores_blocks_under_their_own_keys() -> None:
    plan = ShardPlan()
    assert plan.world == 1 and plan.shards == () and plan.writes
    assert plan.own_shard == "tp0of1.pp0of1"  # the header identity's shard, as before
    assert plan.own_keys(KEYS) == KEYS
    assert plan.own_parents([None, *KEYS[:2]]) == [None, *KEYS[:2]]
    assert plan.shard_chains(KEYS) == [KEYS]
    # MLA on one rank is the same shape.
    assert ShardPlan(mla=True).own_keys(KEYS) == KEYS


def test_every_tensor_rank_names_its_rank_and_the_world_size() -> None:
    plans = [ShardPlan(tp=2, tp_rank=r) for r in range(2)]
    assert [p.own_shard for p in plans] == ["tp0of2.pp0of1", "tp1of2.pp0of1"]
    assert all(p.writes for p in plans)
    assert plans[0].shards == plans[1].shards == ("tp0of2.pp0of1", "tp1of2.pp0of1")
    k0, k1 = plans[0].own_keys(KEYS), plans[1].own_keys(KEYS)
    assert k0 == [bytes(shard_key(k, "tp0of2.pp0of1")) for k in KEYS]
    assert k1 == [bytes(shard_key(k, "tp1of2.pp0of1")) for k in KEYS]
    # No shard of a TP=2 engine is a TP=1 engine's key, nor a TP=4 engine's shard.
    tp4 = ShardPlan(tp=4, tp_rank=0).own_keys(KEYS)
    assert not ({*k0, *k1} & {*KEYS, *tp4})
    assert plans[1].own_parents([None, KEYS[0]]) == [None, k1[0]]


def test_pipeline_stages_and_global_ranks() -> None:
    plan = ShardPlan.from_global_rank(tp=2, pp=2, rank=3)
    assert (plan.tp_rank, plan.pp_rank) == (1, 1)
    assert plan.own_shard == "tp1of2.pp1of2"
    assert plan.shards == ("tp0of2.pp0of2", "tp1of2.pp0of2", "tp0of2.pp1of2",
                           "tp1of2.pp1of2")
    assert ShardPlan.from_global_rank(tp=1, pp=2, rank=1).shards == ("tp0of1.pp0of2",
                                                                     "tp0of1.pp1of2")


def test_mla_is_written_once_per_stage_and_read_by_every_tensor_rank() -> None:
    ranks = [ShardPlan.from_global_rank(tp=2, pp=2, rank=r, mla=True) for r in range(4)]
    assert [p.writes for p in ranks] == [True, False, True, False]
    assert [p.own_shard for p in ranks] == ["tp*of2.pp0of2", "tp*of2.pp0of2",
                                            "tp*of2.pp1of2", "tp*of2.pp1of2"]
    assert ranks[0].own_keys(KEYS) == ranks[1].own_keys(KEYS)  # rank 1 reads rank 0's copy
    assert ranks[0].own_keys(KEYS) != ranks[2].own_keys(KEYS)  # another stage's layers
    assert ranks[3].shards == ("tp*of2.pp0of2", "tp*of2.pp1of2")
    # Not the shard of a non-MLA engine of that shape.
    assert ShardPlan(tp=2, pp=2).own_keys(KEYS) != ranks[0].own_keys(KEYS)


def test_a_block_is_stored_only_when_every_shard_is() -> None:
    plan = ShardPlan(tp=2)
    chains = plan.shard_chains(KEYS)
    assert chains == shard_chains(KEYS, plan.shards)
    held = {*chains[0], *chains[1][:1]}  # rank 0 has 3 blocks, rank 1 one
    asked: list[int] = []

    def prefix_match(keys: list[bytes]) -> int:
        asked.append(len(keys))
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    assert plan.stored_prefix(prefix_match, KEYS) == 1
    assert asked == [3, 3]
    held |= set(chains[1])
    assert plan.stored_prefix(prefix_match, KEYS) == 3
    # Once a shard has none, the others are not asked.
    asked.clear()
    assert stored_prefix(prefix_match, KEYS, ("tp9of10.pp0of1", *plan.shards)) == 0
    assert asked == [3]
    # No shards: the keys themselves.
    assert stored_prefix(prefix_match, KEYS, ()) == 0
    held |= set(KEYS[:2])
    assert stored_prefix(prefix_match, KEYS, ()) == 2


@pytest.mark.parametrize("kw", [{"tp": 0}, {"pp": 0}, {"tp": 2, "tp_rank": 2},
                                {"pp": 2, "pp_rank": -1}])
def test_impossible_shapes_are_refused(kw: dict) -> None:
    with pytest.raises(ValueError):
        ShardPlan(**kw)
