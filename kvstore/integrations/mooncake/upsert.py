"""Mooncake 0.3.13's upsert family (``upsert``, ``upsert_batch``, ``upsert_from``,
``batch_upsert_from``, ``upsert_parts``) as a mixin of ``MooncakeDistributedStore``.

kvstore blocks are write-once (a second put of a key keeps the first value), so an upsert
is a removal of the key followed by a put, with these differences from Mooncake's in-place
update, on purpose: it is not atomic (a reader between the two sees a miss, a cache miss;
a put of the same key by another writer in between wins, and the upsert still answers 0),
and a retention or pin of the old value does not carry over (Mooncake's ``PRESERVE`` keeps
a soft-pin deadline; here the new put's config alone decides). Everything that can be
checked before the removal is (the config, the key, a non-empty value in registered
memory), so a refused upsert leaves the old value in place; a put that fails after the
removal (no room: -200) leaves the key absent.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

from kvstore.core.checks import buffer_view, byte_view
from kvstore.core.errors import InvalidArgument, KVStoreError
from kvstore.integrations.mooncake.host import StoreHost
from kvstore.integrations.mooncake.types import (
    INVALID_PARAMS,
    OK,
    ReplicateConfig,
    code_of,
    mooncake_key,
)

Key = str | bytes


def _non_empty(value: object | None) -> bool:
    if value is None:
        return False
    try:
        return buffer_view(value).nbytes > 0
    except TypeError:
        return False


class Upserts(StoreHost):
    """The upsert methods; the store class provides the attributes below."""

    _lock: threading.Lock
    _written: dict[bytes, Key]

    def _upsert(self, keys: Sequence[Key], values: Sequence[object | None],
                config: ReplicateConfig | None) -> list[int]:
        """Per key: 0, or a code (-600 for a bad key, value or config: nothing removed)."""
        client = self._reader()
        if client is None:
            return [INVALID_PARAMS] * len(keys)
        try:
            self._writer(config)
        except InvalidArgument as exc:
            return [code_of(exc)] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        idx = [i for i, (k, v) in enumerate(zip(keys, values, strict=True))
               if isinstance(k, (str, bytes)) and _non_empty(v)]
        ready: list[int] = []
        for i in idx:
            hk = mooncake_key(keys[i])
            try:
                client.remove(hk)
            except KVStoreError as exc:
                codes[i] = code_of(exc)
                continue
            with self._lock:
                self._written.pop(hk, None)
            ready.append(i)
        got = self._put([keys[i] for i in ready], [values[i] for i in ready], config)
        for i, code in zip(ready, got, strict=True):
            codes[i] = code
        return codes

    def upsert(self, key: Key, value: object, config: ReplicateConfig | None = None) -> int:
        """Stores ``value`` under ``key``, replacing a stored one: 0 or a negative code."""
        return self._upsert([key], [value], config)[0]

    def upsert_batch(self, keys: Sequence[Key], values: Sequence[object],
                     config: ReplicateConfig | None = None) -> int:
        """As ``upsert`` per key: 0 if all were stored, else the first error code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._upsert(keys, values, config) if c != OK), OK)

    def upsert_parts(self, key: Key, *parts: object,
                     config: ReplicateConfig | None = None) -> int:
        """Stores the concatenated ``parts`` under ``key``, replacing a stored value."""
        try:
            value = b"".join(byte_view(p) for p in parts)
        except TypeError:
            return INVALID_PARAMS
        return self._upsert([key], [value], config)[0]

    def upsert_from(self, key: Key, buffer_ptr: int, size: int,
                    config: ReplicateConfig | None = None) -> int:
        """As ``upsert``, from registered ``[buffer_ptr, buffer_ptr + size)``."""
        return self.batch_upsert_from([key], [buffer_ptr], [size], config)[0]

    def batch_upsert_from(self, keys: Sequence[Key], buffer_ptrs: Sequence[int],
                          sizes: Sequence[int], config: ReplicateConfig | None = None
                          ) -> list[int]:
        """Per key: 0, or a code (-600 for a range outside registered memory)."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        return self._upsert(keys, views, config)
