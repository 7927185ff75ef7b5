"""What a prefetch names and answers: a leaf module, so the clients check a call before they
send it and every side reads the same outcomes (semantics: ``tiers.manager``, "Prefetch",
and docs/node.md, "Prefetch").

A prefetch asks a node to bring blocks up to a memory tier (``"dram"`` by default,
``"hbm"`` on a node with one) ahead of their use; it answers one ``PrefetchOutcome`` per
key named. At most ``MAX_PREFETCH_KEYS`` keys per call: more is INVALID_ARGUMENT, from the
client before it sends and from the node, never split into several calls (the bound is
the point: one call asks a bounded amount of work of one node).
"""

from __future__ import annotations

from collections.abc import Sequence
from enum import StrEnum

from kvstore.core.checks import check_key
from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey

MAX_PREFETCH_KEYS = 4096
"""Most keys one prefetch may name: a session's context of 4096 blocks of 256 tokens is a
million tokens, past any model's window."""

DEFAULT_PREFETCH_TIER = "dram"
MAX_TIER_NAME = 32
"""Longest tier name a prefetch may send (tiers are named "hbm", "dram", "ssd")."""

DEFAULT_MAX_PREFETCH_BYTES = 256 << 20
"""Bytes of blocks a node's prefetches may have planned and not yet finished
(``--max-prefetch-bytes``): what a burst of prefetches can ask of the tiers' I/O at once.
Past it a prefetch answers BUSY for the rest of its keys."""


class PrefetchOutcome(StrEnum):
    """What a prefetch did with one key. A ``str``: ``outcome == "promoted"`` holds, and
    JSON writes the value."""

    PRESENT = "present"
    """Already in the tier asked for or a faster one: nothing to move."""
    QUEUED = "queued"
    """(``wait=False``) A move up is planned, and runs in the background."""
    PROMOTED = "promoted"
    """(``wait=True``) Moved up to the tier by this call."""
    MISSING = "missing"
    """Not stored on this node (never put, evicted, or another tenant's)."""
    NO_ROOM = "no_room"
    """Not brought up: the tier has no room, and making it would have meant demoting a
    retained block or a block this call names, or dropping a block off the last tier."""
    BUSY = "busy"
    """Not now: the block is being moved already, or the node's prefetch bytes in flight
    are at their bound. Left where it was; ask again."""
    UNDONE = "undone"
    """(``wait=True``) A move was planned but did not take effect: the block was read or
    removed while it was copied, or its copy failed. Left where it was."""


def check_prefetch(keys: Sequence[object], tier: str | None) -> tuple[list[BlockKey], str]:
    """The checked keys and tier name (None or "": ``"dram"``); InvalidArgument for a
    malformed key, more than ``MAX_PREFETCH_KEYS`` keys, or a tier that is not a string of
    at most ``MAX_TIER_NAME`` characters.
    Whether the node has that tier is the node's to say."""
    if len(keys) > MAX_PREFETCH_KEYS:
        raise InvalidArgument(f"at most {MAX_PREFETCH_KEYS} keys per prefetch, got "
                              f"{len(keys)}")
    if tier is not None and not isinstance(tier, str):
        raise InvalidArgument(f"tier must be a tier name such as 'dram', got {tier!r}")
    if tier is not None and len(tier) > MAX_TIER_NAME:
        # Not echoed: an error's text travels in a header, which gRPC bounds.
        raise InvalidArgument(f"a tier name of {len(tier)} characters: tiers are named "
                              f"'dram' or 'hbm'")
    return [check_key(k) for k in keys], tier or DEFAULT_PREFETCH_TIER


__all__ = ["DEFAULT_MAX_PREFETCH_BYTES", "DEFAULT_PREFETCH_TIER", "MAX_PREFETCH_KEYS",
           "PrefetchOutcome", "check_prefetch"]
