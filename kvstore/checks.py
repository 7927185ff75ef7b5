"""Checks every side applies to what names a block: key and parent sizes, batch bounds.

Shared by the node, its servers and the clients, so a client rejects a bad key
before sending it and the node rejects the same keys with the same message; it
imports nothing but ``kvstore.keys`` and ``kvstore.errors``, so the client library
does not load the node or its tiers.
"""

from __future__ import annotations

from collections.abc import Sequence

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey, ensure_key

MAX_BATCH = 65536
"""Most keys one request may name; larger batches are split by the client."""


def check_key(key: object, what: str = "key") -> BlockKey:
    """``keys.ensure_key``'s rule, refused as InvalidArgument (a status on the wire)."""
    return ensure_key(key, what, InvalidArgument)


def check_keys(keys: Sequence[object]) -> list[BlockKey]:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} keys per request, got {len(keys)}")
    return [check_key(k) for k in keys]


def check_parent(parent: object) -> BlockKey | None:
    if parent is None or (isinstance(parent, bytes | bytearray | memoryview) and len(parent) == 0):
        return None
    return check_key(parent, "parent key")
