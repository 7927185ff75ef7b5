"""The group rules of the vLLM connector without vLLM: which blocks each kind of KV cache
group needs for a prefix, and the longest prefix every group can serve."""

from __future__ import annotations

import pytest

from kvstore.integrations.vllm.groups import GroupPlan, StoredGroup, UnsupportedGroup

B = 32


def full(index: int = 0) -> StoredGroup:
    return StoredGroup(index=index, kind="full", layer_names=("f0", "f1"), block_size=B)


def window(index: int = 1, span: int = 64, retained: int = 0) -> StoredGroup:
    return StoredGroup(index=index, kind="window", layer_names=("w0",), block_size=B,
                       span=span, retained=retained)


def chunked(index: int = 1, span: int = 128) -> StoredGroup:
    return StoredGroup(index=index, kind="chunked", layer_names=("c0",), block_size=B,
                       span=span)


def test_skipped_tokens_follow_vllms_managers() -> None:
    # SlidingWindowManager: max(0, n - window + 1 - extra_retained_tokens)
    assert [window(span=4).skipped_tokens(n) for n in (0, 3, 4, 7, 8)] == [0, 0, 1, 4, 5]
    assert window(span=4, retained=2).skipped_tokens(7) == 2
    # ChunkedLocalAttentionManager: whole chunks before the current one
    assert [chunked(span=8).skipped_tokens(n) for n in (0, 7, 8, 13, 16)] == [0, 0, 8, 8, 16]
    assert full().skipped_tokens(10_000) == 0


def test_first_needed_block_per_kind() -> None:
    # window 64 = 2 blocks: the next token after 6 blocks (192 tokens) reads tokens
    # 129..191, blocks 4 and 5 (block 4 holds 128..159).
    assert window(span=64).first_needed_block(6) == 4
    assert window(span=65).first_needed_block(6) == 4
    assert window(span=66).first_needed_block(6) == 3
    assert chunked(span=128).first_needed_block(6) == 4  # chunk 128..255
    assert chunked(span=128).first_needed_block(4) == 4  # a new chunk starts: none
    assert full().first_needed_block(6) == 0


def test_one_full_group_is_not_hybrid_and_keeps_the_namespace() -> None:
    plan = GroupPlan((full(),))
    assert not plan.hybrid
    assert plan.namespace_part() == ""
    assert plan.group_namespace("ns", 0) == "ns"


def test_hybrid_namespaces_name_each_group_and_keep_the_primarys() -> None:
    plan = GroupPlan((window(index=0), full(index=1)), primary=1)
    assert plan.hybrid
    assert plan.namespace_part() == "groups=window64x1,fullx2"
    assert plan.group_namespace("ns", 1) == "ns"
    assert plan.group_namespace("ns", 0) == "ns/kv-group=0:window"
    # One sliding-window group alone is hybrid too: it does not hold every block.
    assert GroupPlan((window(index=0),)).hybrid


def test_needed_ranges_start_at_the_local_hit_or_the_window() -> None:
    plan = GroupPlan((full(), window(span=64)))
    assert plan.needed(0, 6, 0) == range(0, 6)
    assert plan.needed(1, 6, 0) == range(4, 6)
    assert plan.needed(0, 6, 2) == range(2, 6)
    assert plan.needed(1, 6, 5) == range(5, 6)


def test_loadable_needs_every_group() -> None:
    plan = GroupPlan((full(), window(span=64)))
    t, f = True, False
    # Full group holds 6 blocks; the window group only blocks 4, 5: 6 blocks load.
    assert plan.loadable_blocks([[t] * 6, [f, f, f, f, t, t]], local_blocks=0, limit=6) == 6
    # The window group misses block 5: the prefix of 5 blocks needs blocks 3, 4: missing 3.
    # Of 4 blocks it needs 2, 3: missing 2 ... down to 0.
    assert plan.loadable_blocks([[t] * 6, [f, f, f, f, t, f]], local_blocks=0, limit=6) == 0
    # ... unless blocks 2 and 3 are there: a prefix of 4 blocks.
    assert plan.loadable_blocks([[t] * 6, [f, f, t, t, f, f]], local_blocks=0, limit=6) == 4
    # The full group bounds it: 3 blocks, needing window blocks 1, 2.
    assert plan.loadable_blocks([[t] * 3, [t] * 6], local_blocks=0, limit=6) == 3
    # The limit (the prompt's last token is computed by vLLM) bounds it.
    assert plan.loadable_blocks([[t] * 6, [t] * 6], local_blocks=0, limit=5) == 5


def test_loadable_counts_vllms_local_hit() -> None:
    plan = GroupPlan((full(), window(span=64)))
    t, f = True, False
    # vLLM holds 5 blocks itself; the store must add block 5 in both groups.
    present = [[f, f, f, f, f, t], [f, f, f, f, f, t]]
    assert plan.loadable_blocks(present, local_blocks=5, limit=6) == 6
    # Nothing to add beyond the local hit: the local hit comes back.
    assert plan.loadable_blocks([[f] * 6, [f] * 6], local_blocks=5, limit=6) == 5
    assert plan.loadable_blocks([[], []], local_blocks=0, limit=6) == 0


def test_chunked_group_needs_its_current_chunk() -> None:
    plan = GroupPlan((full(), chunked(span=128)))
    t, f = True, False
    # 6 blocks: chunk 128..255 = blocks 4, 5; blocks 0..3 of the chunked group not needed.
    assert plan.loadable_blocks([[t] * 6, [f, f, f, f, t, t]], local_blocks=0, limit=6) == 6
    # 4 blocks end a chunk: nothing of the chunked group is needed.
    assert plan.loadable_blocks([[t] * 4, [f] * 6], local_blocks=0, limit=6) == 4


def test_groups_of_different_block_sizes_are_refused() -> None:
    other = StoredGroup(index=1, kind="full", layer_names=("x",), block_size=64)
    with pytest.raises(UnsupportedGroup, match="block sizes"):
        GroupPlan((full(), other))
    with pytest.raises(UnsupportedGroup):
        GroupPlan(())


def test_saved_runs_skip_vllms_null_blocks_in_windowed_groups_only() -> None:
    ids = [0, 0, 7, 8, 0, 9]  # 0: the null block
    assert window().saved_runs(ids, 0, 6, 0) == [(2, 4), (5, 6)]
    assert window().saved_runs(ids, 3, 6, 0) == [(3, 4), (5, 6)]
    assert window().saved_runs(ids, 6, 6, 0) == []
    # A full group holds no null blocks (id 0 is a block like any other there), nor does
    # a table without a block pool to ask.
    assert full().saved_runs(ids, 0, 6, 0) == [(0, 6)]
    assert window().saved_runs(ids, 1, 6, None) == [(1, 6)]
