"""``kvstore.integrations.vllm.group_staging``: one group's step rows sealed under this
rank's shard keys (the engine tests run the rest of it in vLLM's engine)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvstore.core.keys import block_keys, shard_key
from kvstore.integrations.vllm.blocks import BlockLayout
from kvstore.integrations.vllm.group_staging import sealed_rows
from kvstore.integrations.vllm.ranks import ShardPlan

KEYS = [bytes(k) for k in block_keys(list(range(96)), 32, "ns/kv-group=1:window")]


@dataclass(frozen=True, slots=True)
class Save:
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None
    retain_s: float = 0.0
    group: int = 1


def rows_of(layout: BlockLayout, n: int) -> torch.Tensor:
    staging = layout.new_staging(n)
    for i in range(n):
        layout.layer_view(staging[i : i + 1], 0).fill_(float(i + 1))
    return staging


def test_a_ranks_rows_are_sealed_under_its_shard_keys_and_parents() -> None:
    layout = BlockLayout.from_caches([torch.zeros(4, 2, 8)], identity=7)
    plan = ShardPlan(tp=2, tp_rank=1)
    shard = [bytes(shard_key(k, "tp1of2.pp0of1")) for k in KEYS]
    # Two requests completed block 1 in this step: stored once, the longest retention.
    saves = [Save(KEYS[1:3], [5, 6], KEYS[0], 10.0), Save(KEYS[1:2], [5], KEYS[0], 60.0)]
    sealed = sealed_rows(saves, rows_of(layout, 3), layout, plan)
    assert sealed.keys == shard[1:3]
    assert sealed.parents == [shard[0], shard[1]]
    assert sealed.retain_s == [60.0, 10.0]
    for row, key in zip(sealed.rows, sealed.keys, strict=True):
        assert layout.check(row, key, layout.value_bytes) is None
    # The block key itself (a one-rank engine's) is not what the header names.
    assert layout.check(sealed.rows[0], KEYS[1], layout.value_bytes) is not None
    # Without a plan (or one rank): the block keys themselves.
    one = sealed_rows([Save(KEYS[:2], [1, 2], None)], rows_of(layout, 2), layout, ShardPlan())
    assert (one.keys, one.parents) == (KEYS[:2], [None, KEYS[0]])
