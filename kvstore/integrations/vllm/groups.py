"""vLLM's KV cache groups as kvstore stores them: one plan for plain and hybrid models.

vLLM's hybrid allocator (HMA) puts the layers of one attention type in one *KV cache
group* with its own block table: a hybrid model such as Gemma 3 or gpt-oss has a
full-attention group and a sliding-window group, and the connector is handed one list
of block ids per group (``KVCacheBlocks.get_block_ids()``, a tuple). The rules here are
vLLM's own (``vllm.v1.core.single_type_kv_cache_manager``):

* a **full** attention group (``FullAttentionSpec``, ``MLAAttentionSpec``; also a
  sliding-window layer when HMA is off, which vLLM turns into a full spec) needs every
  block of a prefix;
* a **window** group (``SlidingWindowSpec``) needs only the blocks that hold the last
  ``sliding_window - 1`` tokens before the next one (plus the spec's
  ``extra_retained_tokens``): vLLM skips the blocks before them, null blocks in the
  block table, so they are neither saved from nor loaded into;
* a **chunked** local attention group (``ChunkedLocalAttentionSpec``) needs the blocks
  of the current attention chunk only.

``first_needed_block`` is vLLM's ``get_num_skipped_tokens`` in blocks, per kind.

*Keys.* Block ``i`` of group ``g`` is stored under ``block_keys(tokens, B, ns_g)[i]``:
the primary group (the first full-attention group, else group 0) uses the connector's
namespace as it is, so a one-group model keeps its keys and a router that computes
keys from the namespace (the Conductor) counts the full-attention prefix; every other
group's namespace is ``ns + "/kv-group=G:KIND"``, so no two groups share a key. One
value holds one block of every layer of its group (``vllm_blocks.BlockLayout``).

*Lookups.* A prefix of ``n`` blocks counts as cached only when every group holds what it
needs for it: blocks ``[max(first_needed_block(n), local), n)`` of each group, where
``local`` is what vLLM's own prefix cache already has (``loadable_blocks``).

*Not supported* (refused at start-up, by the spec's name): Mamba / linear-attention
state, cross-attention, circular-buffer, R-SWA, HiSparse and other group kinds, and
groups whose block sizes differ.

No vLLM import at module level: the rules and lookups are plain Python (tests run them
anywhere); ``plan_from_config`` reads vLLM's spec classes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

__all__ = ["GroupPlan", "StoredGroup", "UnsupportedGroup", "null_block_id", "plan_from_config"]

GroupKind = Literal["full", "window", "chunked"]


class UnsupportedGroup(NotImplementedError):
    """A KV cache group kvstore cannot store (raised at the connector's start-up)."""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoredGroup:
    """One KV cache group as the connector stores it."""

    index: int
    """vLLM's group id (the position in ``KVCacheConfig.kv_cache_groups`` and in the
    per-group tuples of block ids)."""
    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int
    span: int = 0
    """``window``: the sliding window in tokens; ``chunked``: the attention chunk size."""
    retained: int = 0
    """``window``: tokens vLLM keeps below the window (``extra_retained_tokens``)."""

    def skipped_tokens(self, num_tokens: int) -> int:
        """vLLM's ``get_num_skipped_tokens``: leading tokens the next token's attention
        does not read after ``num_tokens`` computed ones."""
        if self.kind == "window":
            return max(0, num_tokens - self.span + 1 - self.retained)
        if self.kind == "chunked":
            return num_tokens // self.span * self.span
        return 0

    def first_needed_block(self, num_blocks: int) -> int:
        """The first block of a ``num_blocks``-block prefix this group needs to go on
        from it (blocks before it are null blocks in vLLM's table)."""
        return self.skipped_tokens(num_blocks * self.block_size) // self.block_size

    def saved_runs(self, block_ids: Sequence[int], lo: int, hi: int, null: int | None
                   ) -> list[tuple[int, int]]:
        """The runs ``[a, b)`` of blocks ``lo..hi`` to save: all of them for a full
        group; for a windowed one, those whose id is not vLLM's null block ``null``
        (blocks vLLM dropped before its window)."""
        if self.kind == "full" or null is None:
            return [(lo, hi)] if hi > lo else []
        runs: list[tuple[int, int]] = []
        start = lo
        for i in range(lo, hi + 1):
            if i < hi and block_ids[i] != null:
                continue
            if i > start:
                runs.append((start, i))
            start = i + 1
        return runs

    def describe(self) -> str:
        span = f"{self.span}" if self.kind != "full" else ""
        return f"{self.kind}{span}x{len(self.layer_names)}"


@dataclass(frozen=True, slots=True)
class GroupPlan:
    """The groups the connector stores, primary first in ``groups``' own order."""

    groups: tuple[StoredGroup, ...]
    primary: int = 0
    """Position in ``groups`` of the group keyed under the namespace itself."""

    def __post_init__(self) -> None:
        if not self.groups:
            raise UnsupportedGroup("no KV cache group to store")
        sizes = {g.block_size for g in self.groups}
        if len(sizes) != 1:
            raise UnsupportedGroup(
                f"KV cache groups with different block sizes {sorted(sizes)}: kvstore "
                f"keys one block size per engine")

    @property
    def block_size(self) -> int:
        return self.groups[0].block_size

    @property
    def hybrid(self) -> bool:
        """More than one group, or one that does not need every block."""
        return len(self.groups) > 1 or self.groups[0].kind != "full"

    def namespace_part(self) -> str:
        """What the default namespace adds for this plan ("" for one full group, so a
        plain model's namespace and keys stay as they were)."""
        if not self.hybrid:
            return ""
        return "groups=" + ",".join(g.describe() for g in self.groups)

    def group_namespace(self, namespace: str, position: int) -> str:
        """The key namespace of ``groups[position]``."""
        if position == self.primary:
            return namespace
        g = self.groups[position]
        return f"{namespace}/kv-group={g.index}:{g.kind}"

    def needed(self, position: int, num_blocks: int, local_blocks: int) -> range:
        """Blocks of ``groups[position]`` the store must supply for a prefix of
        ``num_blocks`` blocks when vLLM's own cache has the first ``local_blocks``."""
        g = self.groups[position]
        return range(max(g.first_needed_block(num_blocks), local_blocks), num_blocks)

    def present(self, keys: Sequence[Sequence[bytes]], *,
                prefix_match: Callable[[Sequence[bytes]], int],
                exists: Callable[[Sequence[bytes]], Sequence[bool]]) -> list[list[bool]]:
        """Per group, which blocks of ``keys[p]`` (group ``p``'s keys of a prefix) the
        store holds: a full-attention group's by ``prefix_match`` (it needs them from
        the first), a windowed one's block by block by ``exists``. Under parallelism
        both ask for every shard (``ranks.ShardPlan.stored_prefix`` / ``stored_flags``)."""
        return [[True] * prefix_match(k) if g.kind == "full" else list(exists(k))
                for g, k in zip(self.groups, keys, strict=True)]

    def loadable_blocks(self, present: Sequence[Sequence[bool]], *, local_blocks: int,
                        limit: int) -> int:
        """The longest prefix (in blocks, at most ``limit``) for which every group's
        needed blocks are present; ``present[p][i]``: block ``i`` of ``groups[p]`` is in
        the store (a shorter list: the blocks past its end are not). ``local_blocks``
        or less when nothing beyond vLLM's own cache can be loaded."""
        runs = [_runs(p, limit) for p in present]
        for n in range(limit, local_blocks, -1):
            if all(len(self.needed(p, n, local_blocks)) <= runs[p][n - 1]
                   for p in range(len(self.groups))):
                return n
        return min(local_blocks, limit)


def _runs(present: Sequence[bool], limit: int) -> list[int]:
    """``out[i]``: how many blocks up to and including ``i`` are present in a row."""
    out: list[int] = []
    run = 0
    for i in range(limit):
        run = run + 1 if i < len(present) and present[i] else 0
        out.append(run)
    return out


def _group_of(index: int, group: Any) -> StoredGroup | None:
    """``group`` (a ``KVCacheGroupSpec``) as a StoredGroup; None for a group vLLM does
    not transfer (rebuilt from another group after a load); UnsupportedGroup else."""
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        MLAAttentionSpec,
        SlidingWindowMLASpec,
        SlidingWindowSpec,
    )

    if not getattr(group, "enable_kv_transfer", True):
        return None
    spec = group.kv_cache_spec
    names, block = tuple(group.layer_names), int(spec.block_size)
    cls = type(spec)
    if cls in (FullAttentionSpec, MLAAttentionSpec):
        return StoredGroup(index=index, kind="full", layer_names=names, block_size=block)
    if cls in (SlidingWindowSpec, SlidingWindowMLASpec) and getattr(
            spec, "prefix_cacheable", True):
        return StoredGroup(index=index, kind="window", layer_names=names, block_size=block,
                           span=int(spec.sliding_window),
                           retained=int(getattr(spec, "extra_retained_tokens", 0) or 0))
    if cls is ChunkedLocalAttentionSpec:
        return StoredGroup(index=index, kind="chunked", layer_names=names, block_size=block,
                           span=int(spec.attention_chunk_size))
    raise UnsupportedGroup(
        f"KVStoreConnector cannot store KV cache group {index} ({cls.__name__}, layers "
        f"{list(group.layer_names)[:3]}...): it stores full-attention, sliding-window "
        f"and chunked-local-attention groups (docs/engines/vllm.md, 'Hybrid models')")


def null_block_id(kv_cache_manager: Any) -> int | None:
    """The id of the null block in vLLM's ``KVCacheManager`` block tables (None when the
    manager has no block pool to ask)."""
    null = getattr(getattr(kv_cache_manager, "block_pool", None), "null_block", None)
    return None if null is None else int(null.block_id)


def plan_from_config(kv_cache_config: Any) -> GroupPlan:
    """The plan of a ``vllm.v1.kv_cache_interface.KVCacheConfig``."""
    groups = [g for i, spec in enumerate(kv_cache_config.kv_cache_groups)
              if (g := _group_of(i, spec)) is not None]
    primary = next((p for p, g in enumerate(groups) if g.kind == "full"), 0)
    return GroupPlan(tuple(groups), primary)


def primary_block_bytes(kv_cache_config: Any, plan: GroupPlan) -> int:
    """Bytes of one block of the plan's primary group on this rank, all its layers (what a
    load moves per block of a one-group model; 0 when nothing is stored)."""
    if not plan.groups:
        return 0
    group = plan.groups[plan.primary]
    spec = kv_cache_config.kv_cache_groups[group.index].kv_cache_spec
    return int(spec.page_size_bytes) * len(group.layer_names)
