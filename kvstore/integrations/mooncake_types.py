"""Mooncake Store's value types, error codes and key mapping, for ``mooncake_compat``.

Kept apart from the store facade: these are the parts of Mooncake's Python API that carry
no connection (codes engines compare against, the key hash, the config and buffer types).
The key mapping is documented in ``kvstore.integrations.mooncake_compat``.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from kvstore.errors import (
    InvalidArgument,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
)

# The key mapping is kvstore.keys' (with every other stored-key derivation); the Mooncake
# module and the SGLang / LMCache adapters import it from here, as they always have.
from kvstore.keys import MOONCAKE_DOMAIN
from kvstore.keys import mooncake_key as mooncake_key

# Mooncake ErrorCode values (mooncake-store/include/types.h); Python sees them as ints.
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no space: kvstore ResourceExhausted
INVALID_KEY = -400
INVALID_PARAMS = -600  # bad arguments, unregistered or too-small buffer: InvalidArgument
OBJECT_NOT_FOUND = -704
RPC_FAIL = -900  # node(s) unreachable, draining, or a write quorum not met: Unavailable
BUFFER_OVERFLOW = INVALID_PARAMS  # kept as an alias: Mooncake reports small buffers as -600

KEY_DOMAIN = MOONCAKE_DOMAIN


def per_key_codes(n: int, call: Callable[[list[int]], None],
                   split_on: tuple[type[KVStoreError], ...], idx: list[int],
                   codes: list[int]) -> None:
    """Runs ``call`` on positions ``0..n-1`` in one batch. An error of a ``split_on`` type
    from a batch of several is retried key by key, so each key gets its own code; any
    other kvstore error (or one key's) sets ``codes[idx[j]]`` for every ``j`` of the batch.
    """
    def run(sel: list[int]) -> None:
        try:
            call(sel)
        except split_on as exc:
            if len(sel) > 1:
                for j in sel:
                    run([j])
                return
            codes[idx[sel[0]]] = code_of(exc)
        except KVStoreError as exc:
            for j in sel:
                codes[idx[j]] = code_of(exc)

    if n:
        run(list(range(n)))


def code_of(exc: BaseException) -> int:
    """The Mooncake ErrorCode for a kvstore error."""
    if isinstance(exc, InvalidArgument):
        return INVALID_PARAMS
    if isinstance(exc, ResourceExhausted):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, Unavailable):
        return RPC_FAIL
    return INTERNAL_ERROR


class ReplicateConfig:
    """Mooncake's ``ReplicateConfig``: the attributes engines set; see the module docstring
    for which of them kvstore honours."""

    def __init__(self) -> None:
        self.replica_num = 1
        self.with_soft_pin = False
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.prefer_alloc_in_same_node = False

    def __repr__(self) -> str:
        return (f"ReplicateConfig(replica_num={self.replica_num}, "
                f"with_soft_pin={self.with_soft_pin}, with_hard_pin={self.with_hard_pin})")


class BufferHandle(bytearray):
    """What ``get_buffer`` / ``batch_get_buffer`` return: the value in memory this object
    owns, with the buffer protocol (``memoryview(h)``, ``np.asarray(h)``) and Mooncake's
    ``ptr()`` (its address) and ``size()``."""

    def ptr(self) -> int:
        if not self:
            return 0
        return ctypes.addressof(ctypes.c_char.from_buffer(self))

    def size(self) -> int:
        return len(self)
