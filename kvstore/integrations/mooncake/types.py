"""Mooncake Store's value types, error codes and key mapping, for ``mooncake_compat``.

Kept apart from the store facade: these are the parts of Mooncake's Python API that carry
no connection (codes engines compare against, the key hash, the config and buffer types).
The key mapping is documented in ``kvstore.integrations.mooncake.store``.
"""

from __future__ import annotations

import ctypes
import operator
from collections.abc import Callable
from enum import IntEnum
from typing import SupportsIndex

from kvstore.core.errors import (
    InvalidArgument,
    KVStoreError,
    ResourceExhausted,
    Unavailable,
)

# The key mapping is kvstore.core.keys' (with every other stored-key derivation); the Mooncake
# module and the SGLang / LMCache adapters import it from here, as they always have.
from kvstore.core.keys import MOONCAKE_DOMAIN
from kvstore.core.keys import mooncake_key as mooncake_key

# Mooncake ErrorCode values (mooncake-store/include/types.h); Python sees them as ints.
OK = 0
INTERNAL_ERROR = -1
NO_AVAILABLE_HANDLE = -200  # no space: kvstore ResourceExhausted
INVALID_KEY = -400
INVALID_PARAMS = -600  # bad arguments, unregistered or too-small buffer: InvalidArgument
OBJECT_NOT_FOUND = -704
OBJECT_ALREADY_EXISTS = -705  # a put session for a key already stored
RPC_FAIL = -900  # node(s) unreachable, draining, or a write quorum not met: Unavailable
DFS_SERVICE_UNAVAILABLE = -1601  # a DFS replica asked for: kvstore has none (as a wheel without)
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


class NoDfsReplica(InvalidArgument):
    """``dfs_replica_num`` above 0: kvstore has no shared-filesystem replica kind."""


def code_of(exc: BaseException) -> int:
    """The Mooncake ErrorCode for a kvstore error."""
    if isinstance(exc, NoDfsReplica):
        return DFS_SERVICE_UNAVAILABLE
    if isinstance(exc, InvalidArgument):
        return INVALID_PARAMS
    if isinstance(exc, ResourceExhausted):
        return NO_AVAILABLE_HANDLE
    if isinstance(exc, Unavailable):
        return RPC_FAIL
    return INTERNAL_ERROR


class SoftPinAction(IntEnum):
    """Mooncake 0.3.13's soft-pin transition of a put (``ReplicateConfig.soft_pin_action``)."""

    PRESERVE = 0
    ENABLE = 1
    DISABLE = 2


class ObjectDataType(IntEnum):
    """Mooncake's ``ReplicateConfig.data_type`` tags; kvstore accepts and ignores them."""

    UNKNOWN = 0
    KVCACHE = 1
    TENSOR = 2
    WEIGHT = 3
    SAMPLE = 4
    ACTIVATION = 5
    GRADIENT = 6
    OPTIMIZER_STATE = 7
    METADATA = 8
    GENERAL = 9


# Mooncake master's defaults (mooncake-store/include/types.h): an ENABLE without a TTL
# gets 30 minutes; a TTL above 24 hours is refused.
DEFAULT_SOFT_PIN_TTL_MS = 30 * 60 * 1000
MAX_SOFT_PIN_TTL_MS = 24 * 60 * 60 * 1000
_UINT64_END = 1 << 64


def soft_pin_ttl(value: object) -> int | None:
    """``value`` as the 0.3.13 wheel's ``soft_pin_ttl_ms`` setter takes it (pybind11, a
    ``std::optional<uint64_t>``): None, or an integer (anything with ``__index__``: bool and
    numpy's integers too) from 0 to 2**64 - 1, kept as a Python int. Anything else (a float,
    even a whole one; a string; a negative or too large integer) is a TypeError, as there."""
    if value is None:
        return None
    n = operator.index(value) if isinstance(value, SupportsIndex) else None
    if n is None or not 0 <= n < _UINT64_END:
        raise TypeError(f"soft_pin_ttl_ms must be None or an integer from 0 to 2**64 - 1 "
                        f"(Mooncake's Optional[int]), got {value!r} "
                        f"({type(value).__name__})")
    return int(n)


class ReplicateConfig:
    """Mooncake 0.3.13's ``ReplicateConfig``. Slotted like the pybind11 class, so an
    attribute 0.3.13 dropped (``with_soft_pin``) raises AttributeError as it does there.
    ``soft_pin_ttl_ms`` is typed as the wheel's setter types it (``soft_pin_ttl``: a value of
    another type is a TypeError and changes nothing). See the module docstring of
    ``mooncake_compat`` for what kvstore honours."""

    __slots__ = ("_soft_pin_ttl_ms", "data_type", "dfs_replica_num", "group_ids",
                 "nof_replica_num", "prefer_alloc_in_same_node", "preferred_nof_segments",
                 "preferred_segment", "preferred_segments", "replica_num", "soft_pin_action",
                 "with_hard_pin")

    def __init__(self) -> None:
        self.replica_num = 1
        self.nof_replica_num = 0
        self.dfs_replica_num = 0
        self.soft_pin_action = SoftPinAction.PRESERVE
        self._soft_pin_ttl_ms: int | None = None
        self.with_hard_pin = False
        self.preferred_segment = ""
        self.preferred_segments: list[str] = []
        self.preferred_nof_segments: list[str] = []
        self.prefer_alloc_in_same_node = False
        self.data_type = ObjectDataType.UNKNOWN
        self.group_ids: list[str] | None = None

    @property
    def soft_pin_ttl_ms(self) -> int | None:
        return self._soft_pin_ttl_ms

    @soft_pin_ttl_ms.setter
    def soft_pin_ttl_ms(self, value: int | None) -> None:
        self._soft_pin_ttl_ms = soft_pin_ttl(value)

    def __repr__(self) -> str:
        ttl = "default" if self.soft_pin_ttl_ms is None else self.soft_pin_ttl_ms
        return (f"ReplicateConfig(replica_num={self.replica_num}, "
                f"dfs_replica_num={self.dfs_replica_num}, "
                f"soft_pin_action={SoftPinAction(self.soft_pin_action).name}, "
                f"soft_pin_ttl_ms={ttl}, with_hard_pin={self.with_hard_pin})")


def retain_seconds(config: ReplicateConfig | None) -> float | None:
    """kvstore's ``retain_s`` for a put with ``config``: the one place Mooncake's soft pin
    becomes kvstore retention. None: no retention.

    As Mooncake's master (``ResolveSoftPinRequest``): ``ENABLE`` retains for
    ``soft_pin_ttl_ms`` (None: the 30-minute default; 0: ordinary cache, None here);
    ``PRESERVE`` (the default) and ``DISABLE`` ask for none and refuse a TTL; a TTL above
    24 hours or an unknown action is InvalidArgument (the TTL's type was checked when it
    was set: ``soft_pin_ttl``).
    """
    if config is None:
        return None
    action, ttl = config.soft_pin_action, config.soft_pin_ttl_ms
    if action in (SoftPinAction.PRESERVE, SoftPinAction.DISABLE):
        if ttl is not None:
            raise InvalidArgument(f"soft_pin_ttl_ms={ttl} needs soft_pin_action=ENABLE, "
                                  f"not {SoftPinAction(action).name}")
        return None
    if action != SoftPinAction.ENABLE:
        raise InvalidArgument(f"soft_pin_action must be a SoftPinAction, got {action!r}")
    ms = DEFAULT_SOFT_PIN_TTL_MS if ttl is None else ttl
    if ms > MAX_SOFT_PIN_TTL_MS:
        raise InvalidArgument(f"soft_pin_ttl_ms must be an integer from 0 to "
                              f"{MAX_SOFT_PIN_TTL_MS} (24 h), got {ms!r}")
    return ms / 1000 if ms else None


def check_placement(config: ReplicateConfig | None) -> None:
    """Refuses the replica kinds kvstore has no tier for, with the 0.3.13 wheel's codes when
    its master has neither: an NVMe-oF SSD pool (``nof_replica_num``: InvalidArgument, -600)
    or a shared filesystem (``dfs_replica_num``: NoDfsReplica, -1601). A node's SSD tier is
    its own spill space, not a replica kind the writer picks."""
    if config is None:
        return
    if config.nof_replica_num:
        raise InvalidArgument(f"nof_replica_num={config.nof_replica_num}: kvstore has no such "
                              f"replica kind (nodes own their tiers); use 0")
    if config.dfs_replica_num:
        raise NoDfsReplica(f"dfs_replica_num={config.dfs_replica_num}: kvstore has no such "
                           f"replica kind (nodes own their tiers); use 0")


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
