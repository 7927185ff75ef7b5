"""Checks every side applies to what names a block: key and parent sizes, batch bounds.

Shared by the node, its servers and the clients, so a client rejects a bad key
before sending it and the node rejects the same keys with the same message; it
imports nothing but ``kvstore.core.keys`` and ``kvstore.core.errors``, so the client library
does not load the node or its tiers. Also the one place a value of any type is turned
into a memoryview (``buffer_view``, ``byte_view``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, cast

if TYPE_CHECKING:
    from typing_extensions import Buffer

from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey, ensure_key

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


def buffer_view(value: object) -> memoryview:
    """A memoryview of a buffer-protocol object (bytes, bytearray, mmap, a numpy array...);
    TypeError if ``value`` is not one.

    Why the cast: typeshed types memoryview's argument as a ``Buffer``, which Python 3.11
    cannot test for (no ``__buffer__``, and a numpy array is no ``collections.abc.Buffer``
    before 3.12). So any object is tried, and memoryview itself refuses a non-buffer with
    TypeError: the cast states what that try checks.
    """
    return memoryview(cast("Buffer", value))


def byte_view(value: object) -> memoryview:
    """``buffer_view`` as flat bytes (format ``B``); TypeError if ``value`` is not a
    buffer-protocol object or not C-contiguous."""
    return buffer_view(value).cast("B")
