"""``kvstore.integrations.vllm.ranks``: which rank stores and reads which shard of a block
(the engine tests run it in vLLM's engine at TP=2)."""

from __future__ import annotations

from collections.abc import Sequence
from functools import partial

import pytest

from kvstore.core.keys import block_keys, shard_key
from kvstore.integrations.vllm.groups import GroupPlan, StoredGroup
from kvstore.integrations.vllm.ranks import ShardPlan, shard_chains, stored_flags, stored_prefix

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


def test_stored_flags_hold_a_block_only_when_every_shard_is() -> None:
    plan = ShardPlan(tp=2)
    chains = plan.shard_chains(KEYS)
    held = {chains[0][0], chains[0][2], chains[1][1], chains[1][2]}
    asked: list[int] = []

    def exists(keys: list[bytes]) -> list[bool]:
        asked.append(len(keys))
        return [k in held for k in keys]

    assert plan.stored_flags(exists, KEYS) == [False, False, True]
    assert asked == [3, 3]
    asked.clear()
    assert stored_flags(exists, KEYS, ()) == [False, False, False]  # the keys themselves
    assert asked == [3]
    # Once no block is held in every shard so far, the other shards are not asked.
    asked.clear()
    assert stored_flags(exists, KEYS, ("tp9of10.pp0of1", *plan.shards)) == [False] * 3
    assert asked == [3]


def test_a_hybrid_model_at_tp2_shards_every_groups_keys() -> None:
    # A full-attention group and a 64-token sliding-window group (2 blocks of 32), TP=2.
    groups = GroupPlan((
        StoredGroup(index=0, kind="full", layer_names=("f0",), block_size=32),
        StoredGroup(index=1, kind="window", layer_names=("w0",), block_size=32, span=64),
    ))
    tokens = list(range(32 * 6))
    group_keys = [[bytes(k) for k in block_keys(tokens, 32, groups.group_namespace("ns", p))]
                  for p in range(2)]
    assert group_keys[0] == [bytes(k) for k in block_keys(tokens, 32, "ns")]
    ranks = [ShardPlan(tp=2, tp_rank=r) for r in range(2)]
    # Each rank's shard of each group's block: shard_key of that group's block key.
    for plan in ranks:
        for keys in group_keys:
            assert plan.own_keys(keys) == [bytes(shard_key(k, plan.own_shard)) for k in keys]
    stored = [plan.own_keys(keys) for plan in ranks for keys in group_keys]
    assert len({k for chain in stored for k in chain}) == 4 * 6  # no two alike
    assert not ({k for chain in stored for k in chain} & {*group_keys[0], *group_keys[1]})
    assert ranks[1].own_parents([None, *group_keys[1][:1]]) == [None, stored[3][0]]

    # The store: rank 0 saved everything; rank 1 its full group, and its window group's
    # blocks 0..3 only (the window of a 6-block prefix is blocks 4 and 5).
    held = {*stored[0], *stored[1], *stored[2], *stored[3][:4]}

    def prefix_match(keys: Sequence[bytes]) -> int:
        n = 0
        while n < len(keys) and keys[n] in held:
            n += 1
        return n

    def exists(keys: Sequence[bytes]) -> list[bool]:
        return [k in held for k in keys]

    def present() -> list[list[bool]]:
        # As the scheduler (rank 0's plan, every shard asked) looks a prefix up.
        return groups.present(group_keys,
                              prefix_match=partial(ranks[0].stored_prefix, prefix_match),
                              exists=partial(ranks[0].stored_flags, exists))

    assert present() == [[True] * 6, [True] * 4 + [False] * 2]
    # The window of 6 blocks is missing on rank 1: only 4 blocks (window 2..3) loadable.
    assert groups.loadable_blocks(present(), local_blocks=0, limit=6) == 4
    held |= set(stored[3][4:])
    assert groups.loadable_blocks(present(), local_blocks=0, limit=6) == 6
    # A window block outside the window is not needed: rank 1's block 0 gone changes nothing.
    held.discard(stored[3][0])
    assert groups.loadable_blocks(present(), local_blocks=0, limit=6) == 6
    # But the 2-block prefix's window (tokens 1..63) starts in block 0: it cannot be served.
    held.discard(stored[2][2])  # rank 1's full-attention shard of block 2 gone
    assert present()[0] == [True, True]
    assert groups.loadable_blocks(present(), local_blocks=0, limit=6) == 0
    held.add(stored[3][0])
    assert groups.loadable_blocks(present(), local_blocks=0, limit=6) == 2
