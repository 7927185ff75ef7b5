"""What the TierManager tells an observer about its index (for KV events).

The manager calls these under its owner's lock, in the order the index changes, so an
observer sees one consistent history. An observer must only record or enqueue: no I/O,
no locks beyond a leaf (a queue's), never blocking (tiers do no network I/O).
"""

from __future__ import annotations

from typing import Protocol

from kvstore.core.keys import BlockKey


class TierObserver(Protocol):
    def stored(self, key: BlockKey, parent: BlockKey | None, level: int) -> None:
        """A put of ``key`` committed into ``level``."""

    def removed(self, key: BlockKey, level: int) -> None:
        """``key`` left the index from ``level`` (removed, evicted or found corrupt)."""

    def moved(self, key: BlockKey, parent: BlockKey | None, src: int, dst: int) -> None:
        """``key`` now lives in ``dst`` instead of ``src`` (a demotion or a promotion)."""
