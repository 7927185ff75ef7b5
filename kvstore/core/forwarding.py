"""What a node hands the cluster's forwarding when it takes a replicated put.

The node and its channel server know nothing of membership or peers: they fill
``BlockCopy`` values (frozen; the bytes just received, borrowed until
``forward`` returns) and call a ``Forwarding`` that ``replication`` provides.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from kvstore.core.keys import BlockKey


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockCopy:
    """One block to copy to its other owners.

    ``key`` and ``parent`` are as stored on this node (a tenant's keys salted),
    ``place`` is the key as the writer named it: what placement ranks, so that
    master and writer agree on the owners. ``owner``: the tenant the block is charged
    to (None: nobody), whom every copy is charged to on the node that receives it.
    ``value`` is only valid during the ``forward`` call it is passed to."""

    key: BlockKey
    place: BlockKey
    parent: BlockKey | None
    pin: bool
    value: memoryview
    retain_s: float = 0.0  # the retention the copy asks for (``tiers.retention``)
    owner: str | None = None


@dataclass(frozen=True, slots=True, kw_only=True)
class ForwardOutcome:
    copies: int  # copies holding every block, this node's included
    stored_on: tuple[str, ...] = ()
    failed: tuple[str, ...] = field(default_factory=tuple)  # "ADDR: reason"


class Forwarding(Protocol):
    @property
    def available(self) -> bool:
        """True while this node is a cluster member that can forward."""
        ...

    @property
    def replicas(self) -> int:
        """The copies the cluster keeps of a block (the node's ``--replicas``): the most a
        tenant's replicated put may ask for."""
        ...

    def forward(self, blocks: Sequence[BlockCopy], *, copies: int, write_quorum: int
                ) -> ForwardOutcome:
        """Copies ``blocks`` to ``copies - 1`` other owners each, replacing failed ones
        by the next ranked node; returns once every copy it started has settled, so
        no ``value`` is read after it returns."""
        ...
