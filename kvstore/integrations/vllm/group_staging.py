"""The worker side of ``KVStoreConnector`` per KV cache group: each group's cache tensors
and block layout, and one step's save staging, gathered layer by layer.

A group's value holds one block of each of the group's layers, in the group's layer
order (``blocks.BlockLayout``); a one-group model has one group holding every layer, so
its values are what they were before groups. Block ids are per group (vLLM's block
table of that group), and a layer's cache tensor is indexed by its own group's ids.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import torch

from kvstore.integrations.vllm.blocks import BlockLayout
from kvstore.integrations.vllm.groups import GroupPlan
from kvstore.integrations.vllm.ranks import ShardPlan

__all__ = ["GroupCaches", "GroupedSpec", "SealedRows", "StepStaging", "sealed_rows"]


class GroupedSpec(Protocol):
    """A save of the connector's metadata: the block ids of one group."""

    @property
    def group(self) -> int: ...
    @property
    def block_ids(self) -> list[int]: ...


class SaveRows(GroupedSpec, Protocol):
    """A save with its keys, the key before them and its retention."""

    @property
    def keys(self) -> list[bytes]: ...
    @property
    def parent(self) -> bytes | None: ...
    @property
    def retain_s(self) -> float: ...


@dataclass(frozen=True, slots=True, kw_only=True)
class SealedRows:
    """One group's values of a step, ready to put: row ``i`` is ``keys[i]``'s value."""

    keys: list[bytes]
    rows: list[torch.Tensor]
    parents: list[bytes | None]
    retain_s: list[float]


def sealed_rows(saves: Sequence[SaveRows], staging: torch.Tensor, layout: BlockLayout,
                shards: ShardPlan | None = None) -> SealedRows:
    """``saves`` of one group (their rows of ``staging`` in order) as sealed values; a
    block two requests completed in the same step once, with the longest retention.
    With ``shards``, under this rank's shard keys and parents (``ranks.ShardPlan``; a
    one-rank engine: the block keys themselves)."""
    keys = [k for s in saves for k in s.keys]
    parents: list[bytes | None] = []
    keep: list[float] = []
    for s in saves:
        parents += [s.parent, *s.keys[:-1]]
        keep += [s.retain_s] * len(s.keys)
    if len(set(keys)) < len(keys):  # two requests completed the same block this step
        first = {k: i for i, k in reversed(list(enumerate(keys)))}
        longest: dict[bytes, float] = {}
        for k, r in zip(keys, keep, strict=True):  # the longest retention asked wins
            longest[k] = max(longest.get(k, 0.0), r)
        order = sorted(first.values())
        keys, parents = [keys[i] for i in order], [parents[i] for i in order]
        keep = [longest[k] for k in keys]
        staging = staging[torch.tensor(order, dtype=torch.long)]
    if shards is not None:
        keys, parents = shards.own_keys(keys), shards.own_parents(parents)
    layout.seal(staging, keys)
    return SealedRows(keys=keys, rows=list(staging.unbind(0)), parents=parents,
                      retain_s=keep)


@dataclass(slots=True)
class StepStaging:
    """One step's saves: per group, the block ids and their staging rows, in the order of
    the step's saves of that group; ``done`` the (group, layer) pairs already copied."""

    ids: dict[int, torch.Tensor] = field(default_factory=dict)
    rows: dict[int, torch.Tensor] = field(default_factory=dict)
    done: set[tuple[int, int]] = field(default_factory=set)


@dataclass(frozen=True, slots=True)
class GroupCaches:
    """The engine's cache tensors by group (positions of the connector's ``GroupPlan``)."""

    layouts: tuple[BlockLayout, ...]
    caches: tuple[tuple[torch.Tensor, ...], ...]
    where: dict[str, tuple[int, int]]
    """Layer name -> (group position, layer index in the group)."""

    @classmethod
    def register(cls, plan: GroupPlan, kv_caches: dict[str, torch.Tensor], *,
                 identity: int) -> GroupCaches:
        """The groups of ``plan`` over vLLM's ``register_kv_caches`` tensors (ValueError
        when a layer has none, or a group's layers differ in dtype or block size)."""
        missing = [n for g in plan.groups for n in g.layer_names if n not in kv_caches]
        if missing:
            raise ValueError(f"no KV cache tensors for layers {missing}")
        caches = tuple(tuple(kv_caches[n] for n in g.layer_names) for g in plan.groups)
        layouts = tuple(BlockLayout.from_caches(c, identity=identity) for c in caches)
        where = {n: (p, i) for p, g in enumerate(plan.groups)
                 for i, n in enumerate(g.layer_names)}
        return cls(layouts, caches, where)

    @property
    def flat(self) -> list[torch.Tensor]:
        """Every layer's cache, group by group."""
        return [kv for group in self.caches for kv in group]

    def new_step(self, saves: Sequence[GroupedSpec]) -> StepStaging:
        """Staging rows for every block of ``saves``, per group."""
        step = StepStaging()
        for p, layout in enumerate(self.layouts):
            ids = [b for s in saves if s.group == p for b in s.block_ids]
            if ids:
                step.ids[p] = torch.tensor(ids, dtype=torch.long)
                step.rows[p] = layout.new_staging(len(ids))
        return step

    def gather(self, step: StepStaging, layer_name: str) -> bool:
        """Copies layer ``layer_name``'s to-save blocks into ``step``; False when the
        layer is not stored or its group saves nothing this step."""
        at = self.where.get(layer_name)
        if at is None or at[0] not in step.ids:
            return False
        p, layer = at
        self.layouts[p].gather_layer(step.rows[p], layer, self.caches[p][layer], step.ids[p])
        step.done.add(at)
        return True

    def gather_rest(self, step: StepStaging) -> int:
        """Copies every layer whose save hook did not run this step; how many."""
        copied = 0
        for p, ids in step.ids.items():
            for layer, kv in enumerate(self.caches[p]):
                if (p, layer) not in step.done:
                    self.layouts[p].gather_layer(step.rows[p], layer, kv, ids)
                    copied += 1
        return copied

    def seal_step(self, step: StepStaging, saves: Sequence[SaveRows],
                  shards: ShardPlan | None = None) -> SealedRows:
        """Every group's rows of ``step`` sealed (``sealed_rows``, under this rank's shard
        keys with ``shards``), group after group, as one list of values to put."""
        keys: list[bytes] = []
        rows: list[torch.Tensor] = []
        parents: list[bytes | None] = []
        keep: list[float] = []
        for p, staging in step.rows.items():
            sealed = sealed_rows([s for s in saves if s.group == p], staging,
                                 self.layouts[p], shards)
            keys += sealed.keys
            rows += sealed.rows
            parents += sealed.parents
            keep += sealed.retain_s
        return SealedRows(keys=keys, rows=rows, parents=parents, retain_s=keep)

    def scatter(self, group: int, rows: torch.Tensor, block_ids: Sequence[int]) -> None:
        """Writes staging ``rows`` into blocks ``block_ids`` of every layer of ``group``."""
        ids = torch.tensor(list(block_ids), dtype=torch.long)
        for layer, kv in enumerate(self.caches[group]):
            self.layouts[group].scatter_layer(rows, layer, kv, ids)
