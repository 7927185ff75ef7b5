"""What the front learns from its vLLM instances at start-up, and what must agree.

* the served model and ``max_model_len`` (``/v1/models``), the vLLM block size and KV
  capacity (``/metrics``): every instance must serve the same model;
* each instance's kvstore connector: its namespace, block size, shards and role (the
  ``kvstore_describe`` request, ``kvstore.integrations.vllm.describe``). Every instance
  must use the same namespace and block size, which become the front's (the block keys
  it computes must be the connectors' keys), and the same shards (the ranks an engine
  on several ranks stores each block in: the same parallel shape, so the shard keys the
  front looks up are theirs); ``--kv-namespace`` / ``--block-tokens``,
  when given, must equal them; prefill instances must save and decode instances load;
* whether the instances tokenize text themselves (``/tokenize``): then the front forwards
  text and chat requests unchanged; all must tokenize alike, or none at all.

Every disagreement is a ``StartupMismatch`` naming both sides.
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

from conductor.front.vllm_instances import ConnectorInfo, InstanceShape, VllmInstance

T = TypeVar("T")


class StartupMismatch(ValueError):
    """Instances that disagree with each other or with the front's flags."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Learnt:
    model: str
    max_model_len: int
    namespace: str
    block_tokens: int
    instances_tokenize: bool
    """The instances tokenize text (no ``--skip-tokenizer-init``): text and chat are
    forwarded to them unchanged."""
    shapes: dict[str, InstanceShape]
    shards: tuple[str, ...] = ()
    """The connectors' shards (``ConnectorInfo.shards``); empty: one-rank engines."""


def _agree(what: str, values: Mapping[str, T]) -> T:
    """The one value all instances report; a ``StartupMismatch`` naming two that differ."""
    items = list(values.items())
    first_url, first = items[0]
    for url, v in items[1:]:
        if v != first:
            raise StartupMismatch(f"instances disagree on the {what}: {first_url} has "
                                  f"{first!r}, {url} has {v!r}")
    return first


async def learn(instances: Sequence[VllmInstance], *, namespace: str, block_tokens: int
                ) -> Learnt:
    """Reads every instance (in parallel) and checks them; ``namespace`` / ``block_tokens``
    are the front's flags ("" / 0: not given, learn them)."""
    shapes = dict(zip([i.url for i in instances],
                      await asyncio.gather(*(i.read_shape() for i in instances)),
                      strict=True))
    model = str(_agree("served model", {u: s.model for u, s in shapes.items()}))
    infos = dict(zip([i.url for i in instances],
                     await asyncio.gather(*(i.read_connector(model) for i in instances)),
                     strict=True))
    tokenized = dict(zip([i.url for i in instances],
                         await asyncio.gather(*(i.read_tokenizer(model) for i in instances)),
                         strict=True))
    ns, block = layout_of(infos, shapes, namespace=namespace, block_tokens=block_tokens)
    shards = shards_of(infos)
    check_roles(instances, infos)
    tokens = _agree("tokenizer (the token ids of one probe text; None: no tokenizer, "
                    "--skip-tokenizer-init)", tokenized)
    return Learnt(model=model, max_model_len=min(s.max_model_len for s in shapes.values()),
                  namespace=ns, block_tokens=block, instances_tokenize=tokens is not None,
                  shapes=shapes, shards=shards)


def shards_of(infos: dict[str, ConnectorInfo | None]) -> tuple[str, ...]:
    """The shards every described connector stores blocks in (all must agree: engines of
    other parallel shapes store other keys); () when none describes any."""
    described = {u: info.shards for u, info in infos.items() if info is not None}
    if not described:
        return ()
    return _agree("kvstore shards (the engines' tensor / pipeline parallel shape)", described)


def layout_of(infos: dict[str, ConnectorInfo | None], shapes: dict[str, InstanceShape], *,
              namespace: str, block_tokens: int) -> tuple[str, int]:
    """The namespace and block size every instance uses (``infos``: what each connector
    said, None for silence; ``shapes``: vLLM's block sizes), checked against the flags
    ("" / 0: not given)."""
    silent = [u for u, info in infos.items() if info is None]
    if silent and not (namespace and block_tokens):
        raise StartupMismatch(
            f"{silent[0]} does not describe its kvstore connector (no KVStoreConnector, or "
            f"one older than this Conductor): give --kv-namespace and --block-tokens")
    described = {u: info for u, info in infos.items() if info is not None}
    ns = namespace
    if described:
        ns = str(_agree("kvstore namespace", {u: i.namespace for u, i in described.items()}))
        if namespace and namespace != ns:
            url = next(iter(described))
            raise StartupMismatch(f"--kv-namespace is {namespace!r} but {url}'s connector "
                                  f"uses namespace {ns!r}")
    blocks: dict[str, int] = {u: i.block_tokens for u, i in described.items()}
    blocks.update({f"{u} (vLLM --block-size)": s.block_size for u, s in shapes.items()
                   if s.block_size is not None})
    block = block_tokens
    if blocks:
        block = _agree("block size in tokens", blocks)
        if block_tokens and block_tokens != block:
            url = next(iter(blocks))
            raise StartupMismatch(f"--block-tokens is {block_tokens} but {url} uses "
                                  f"{block}-token blocks: they must be equal (the store's "
                                  f"keys are per block)")
    if not block:
        raise StartupMismatch("no instance reports its block size: give --block-tokens")
    return ns, block


def check_roles(instances: Sequence[VllmInstance], infos: dict[str, ConnectorInfo | None]
           ) -> None:
    """Prefill and colocated instances must save, decode (and colocated) ones load."""
    for inst in instances:
        info = infos[inst.url]
        if info is None:
            continue
        if inst.role in ("prefill", "colocated") and not info.saves:
            raise StartupMismatch(f"{inst.role} instance {inst.url} runs its connector with "
                                  f"kv_role {info.kv_role!r}, which saves nothing: a "
                                  f"{inst.role} instance needs kv_both"
                                  f"{' or kv_producer' if inst.role == 'prefill' else ''}")
        if inst.role in ("decode", "colocated") and not info.loads:
            raise StartupMismatch(f"{inst.role} instance {inst.url} runs its connector with "
                                  f"kv_role {info.kv_role!r}, which loads nothing: a "
                                  f"{inst.role} instance needs kv_both"
                                  f"{' or kv_consumer' if inst.role == 'decode' else ''}")
