"""Mooncake 0.3.13's ranged and session transfers, as a mixin of ``MooncakeDistributedStore``.

* ``get_into_ranges``: byte ranges of several objects into registered buffers, buffer-major,
  with Mooncake's nested result shape (``results[buffer][key][fragment]``: bytes read, or a
  negative code per fragment).
* Put sessions (layer-by-layer saves): ``batch_put_session_start`` reserves each object,
  ``batch_put_from_multi_buffer_ranges`` writes byte ranges into it as often as needed,
  ``batch_put_session_end`` publishes it (readable from then on), ``_revoke`` drops it.
* Get sessions (layer-by-layer loads): ``batch_get_session_start`` resolves each object once,
  ``batch_get_into_multi_buffer_ranges`` reads byte ranges of it, ``_end`` forgets it.

How kvstore does it, and where that differs on purpose from Mooncake (which reserves space
in a node's segment at start and transfers every range over its transfer engine):

* A put session's reservation is memory of *this* client, the object's full size, taken at
  start; ranges are copied into it, and ``end`` stores the whole object with one kvstore
  put (zero-filled where no range was written). Nothing is visible or charged on a node
  before ``end``; a full node or a quota answers at ``end`` (-200), not at start. A revoked
  or never-ended session leaves nothing on any node. A key already stored is refused at
  start with ``OBJECT_ALREADY_EXISTS`` (-705), as Mooncake does.
* A get session reads each object once at start (one batch read) and serves ranges from
  that copy: later range reads cost no node trip, as Mooncake's cached replica, but the
  session holds the objects' bytes in this process until ``end``.
* ``get_into_ranges`` reads each object it names once per call and copies the fragments.

Return codes follow the 0.3.13 wheel (checked side by side in tests/engines): a second start
for a key with an open session, a range outside the object or outside registered memory, a
shape mismatch, or a range/end/revoke without a session is ``INVALID_PARAMS`` (-600); a
missing object at get-session start is ``OBJECT_NOT_FOUND`` (-704); an uninitialized store
answers ``[]`` (``-1`` for ``batch_get_session_end``), as the wheel does.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

from kvstore.core.errors import InvalidArgument, KVStoreError
from kvstore.integrations.mooncake.host import StoreHost
from kvstore.integrations.mooncake.types import (
    INVALID_PARAMS,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    ReplicateConfig,
    code_of,
    mooncake_key,
)

log = logging.getLogger(__name__)

Key = str | bytes


class _PutSession:
    """One open put session: the object's bytes being assembled, and the put's config. The
    lock is held while ranges are copied in, so ``end`` / ``revoke`` wait for writes in
    flight; they seal the session under it, so a writer that found the session just
    before it was ended writes nothing and answers -600 (never a count for lost bytes)."""

    __slots__ = ("config", "data", "lock", "sealed")

    def __init__(self, size: int, config: ReplicateConfig | None) -> None:
        self.data = bytearray(size)
        self.config = config
        self.lock = threading.Lock()
        self.sealed = False


def _ranges_ok(ptrs: Sequence[int], sizes: Sequence[int], offsets: Sequence[int],
               object_size: int) -> bool:
    """Parallel lists, and every ``[offset, offset + size)`` inside the object."""
    if not len(ptrs) == len(sizes) == len(offsets):
        return False
    return all(isinstance(s, int) and isinstance(o, int) and s >= 0 and o >= 0
               and o + s <= object_size for s, o in zip(sizes, offsets, strict=True))


class RangedTransfers(StoreHost):
    """The ranged and session methods; the store class provides the attributes below."""

    _lock: threading.Lock
    _regions: tuple[Any, ...]
    _put_sessions: dict[bytes, _PutSession]
    _get_sessions: dict[bytes, bytes]

    def _views(self, ptrs: Sequence[int], sizes: Sequence[int]) -> list[memoryview] | None:
        """A view of registered memory per ``(ptr, size)``, or None if any lies outside it."""
        found = (self._view(p, s) for p, s in zip(ptrs, sizes, strict=True))
        views = [v for v in found if v is not None]
        return views if len(views) == len(ptrs) else None

    def _tail(self, ptr: int) -> memoryview | None:
        """Registered memory from ``ptr`` to the end of its range (Mooncake checks a
        destination against that), or None."""
        for r in self._regions:
            if r.start <= ptr < r.end:
                return r.view[ptr - r.start :]
        return None

    # ---- get_into_ranges ----------------------------------------------------------------

    def get_into_ranges(self, buffer_ptrs: Sequence[int], all_keys: Sequence[Sequence[Key]],
                        all_dst_offsets: Sequence[Sequence[Sequence[int]]],
                        all_src_offsets: Sequence[Sequence[Sequence[int]]],
                        all_sizes: Sequence[Sequence[Sequence[int]]]
                        ) -> list[list[list[int]]]:
        """Per buffer, per key, per fragment: bytes read into
        ``buffer_ptrs[i] + all_dst_offsets[i][j][k]`` from
        ``all_keys[i][j][all_src_offsets[i][j][k]:][:all_sizes[i][j][k]]``, or a code."""
        n = len(buffer_ptrs)
        results = [[[INVALID_PARAMS] * (len(all_dst_offsets[i][j])
                                        if i < len(all_dst_offsets)
                                        and j < len(all_dst_offsets[i]) else 1)
                    for j in range(len(all_keys[i]) if i < len(all_keys) else 1)]
                   for i in range(n)]
        client = self._reader()
        if client is None or not n == len(all_keys) == len(all_dst_offsets) \
                == len(all_src_offsets) == len(all_sizes):
            log.error("get_into_ranges: store not set up, or top-level size mismatch")
            return results
        plans: list[tuple[int, int, memoryview]] = []  # (buffer, key index) and its tail
        wanted: dict[bytes, Key] = {}
        for i, ptr in enumerate(buffer_ptrs):
            tail = self._tail(ptr)
            keys = all_keys[i]
            if tail is None or not (len(keys) == len(all_dst_offsets[i])
                                    == len(all_src_offsets[i]) == len(all_sizes[i])):
                continue
            for j, key in enumerate(keys):
                if not isinstance(key, (str, bytes)) or not (
                        len(all_dst_offsets[i][j]) == len(all_src_offsets[i][j])
                        == len(all_sizes[i][j])):
                    continue
                plans.append((i, j, tail))
                wanted[mooncake_key(key)] = key
        hks = list(wanted)
        try:
            values = dict(zip(hks, client.get_batch(hks), strict=True))
        except KVStoreError as exc:
            code = code_of(exc)
            for i, j, _ in plans:
                results[i][j] = [code] * len(results[i][j])
            return results
        for i, j, tail in plans:
            value = values[mooncake_key(all_keys[i][j])]
            row = results[i][j]
            for k, (dst, src, size) in enumerate(zip(all_dst_offsets[i][j],
                                                     all_src_offsets[i][j],
                                                     all_sizes[i][j], strict=True)):
                if value is None:
                    row[k] = OBJECT_NOT_FOUND
                elif min(dst, src, size) >= 0 and dst + size <= len(tail) \
                        and src + size <= len(value):
                    tail[dst : dst + size] = value[src : src + size]
                    row[k] = size
        return results

    # ---- put sessions -------------------------------------------------------------------

    def batch_put_session_start(self, keys: Sequence[Key], sizes: Sequence[int],
                                config: ReplicateConfig | None = None) -> list[int]:
        """Reserves each object (its full size) for ranged writes: per key 0, -705 if the
        key is stored already (or named earlier in this call), or -600 (a session already
        open, a bad size or config; -1601 for a DFS replica)."""
        client = self._reader()
        if client is None:
            log.error("batch_put_session_start: the store is not set up")
            return []
        if len(keys) != len(sizes):
            return [INVALID_PARAMS] * len(keys)
        try:
            self._writer(config)  # refuses a config kvstore cannot honour, before reserving
        except InvalidArgument as exc:
            log.error("batch_put_session_start: %s", exc)
            return [code_of(exc)] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        valid = [i for i, (k, s) in enumerate(zip(keys, sizes, strict=True))
                 if isinstance(k, (str, bytes)) and isinstance(s, int) and s > 0]
        hks = [mooncake_key(keys[i]) for i in valid]
        try:
            stored = client.exists(hks)
        except KVStoreError as exc:
            for i in valid:
                codes[i] = code_of(exc)
            return codes
        opened: set[bytes] = set()
        with self._lock:
            for i, hk, there in zip(valid, hks, stored, strict=True):
                if hk in opened:  # twice in one call: the first reserved it (as the wheel)
                    codes[i] = OBJECT_ALREADY_EXISTS
                elif hk in self._put_sessions:
                    log.error("batch_put_session_start: a put session is open for %r", keys[i])
                elif there:
                    codes[i] = OBJECT_ALREADY_EXISTS
                else:
                    self._put_sessions[hk] = _PutSession(sizes[i], config)
                    opened.add(hk)
                    codes[i] = OK
        return codes

    def batch_put_from_multi_buffer_ranges(self, keys: Sequence[Key],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_dst_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Copies, per key, each registered ``(ptr, size)`` into its object at
        ``dst_offset``: bytes written per key, or -600 (no session, a range outside the
        object or registered memory, mismatched lists); nothing of that key is written then."""
        if self._reader() is None:
            return []
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_dst_offsets):
            return [INVALID_PARAMS] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        for i, key in enumerate(keys):
            ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_dst_offsets[i]
            with self._lock:
                session = (self._put_sessions.get(mooncake_key(key))
                           if isinstance(key, (str, bytes)) else None)
            if session is None or not _ranges_ok(ptrs, sizes, offs, len(session.data)):
                continue
            views = self._views(ptrs, sizes)
            if views is None:
                continue
            with session.lock:
                if session.sealed:
                    continue
                for view, off in zip(views, offs, strict=True):
                    session.data[off : off + len(view)] = view
            codes[i] = sum(sizes)
        return codes

    def _pop_put_sessions(self, keys: Sequence[Key]) -> list[_PutSession | None]:
        """Removes and seals the keys' sessions (waiting for ranged writes in flight)."""
        with self._lock:
            sessions = [self._put_sessions.pop(mooncake_key(k), None)
                        if isinstance(k, (str, bytes)) else None for k in keys]
        for s in sessions:
            if s is not None:
                with s.lock:
                    s.sealed = True
        return sessions

    def batch_put_session_end(self, keys: Sequence[Key]) -> list[int]:
        """Publishes each session's object (one kvstore put per config): per key 0, -600
        without a session, or the put's code (-200 no room, -900 unreachable)."""
        if self._reader() is None:
            return []
        sessions = self._pop_put_sessions(keys)
        codes = [INVALID_PARAMS] * len(keys)
        # id(config) -> (position, session) of each key with a session: one put per config
        groups: dict[int, list[tuple[int, _PutSession]]] = {}
        for i, s in enumerate(sessions):
            if s is not None:
                groups.setdefault(id(s.config), []).append((i, s))
        for group in groups.values():
            values: list[object | None] = [memoryview(s.data)  # sealed: no writer left
                                           for _, s in group]
            got = self._put([keys[i] for i, _ in group], values, group[0][1].config)
            for (i, _), code in zip(group, got, strict=True):
                codes[i] = code
        return codes

    def batch_put_session_revoke(self, keys: Sequence[Key]) -> list[int]:
        """Drops each open session (nothing was stored): per key 0, or -600 without one."""
        if self._reader() is None:
            return []
        return [INVALID_PARAMS if s is None else OK for s in self._pop_put_sessions(keys)]

    # ---- get sessions -------------------------------------------------------------------

    def batch_get_session_start(self, keys: Sequence[Key]) -> list[int]:
        """Resolves each object once for ranged reads: per key 0, -704 if not stored, or
        a code."""
        client = self._reader()
        if client is None:
            log.error("batch_get_session_start: the store is not set up")
            return []
        codes = [INVALID_PARAMS] * len(keys)
        valid = [i for i, k in enumerate(keys) if isinstance(k, (str, bytes))]
        hks = [mooncake_key(keys[i]) for i in valid]
        try:
            values = client.get_batch(hks)
        except KVStoreError as exc:
            for i in valid:
                codes[i] = code_of(exc)
            return codes
        with self._lock:
            for i, hk, value in zip(valid, hks, values, strict=True):
                if value is None:
                    codes[i] = OBJECT_NOT_FOUND
                else:
                    self._get_sessions[hk] = value
                    codes[i] = OK
        return codes

    def batch_get_into_multi_buffer_ranges(self, keys: Sequence[Key],
                                           all_buffer_ptrs: Sequence[Sequence[int]],
                                           all_sizes: Sequence[Sequence[int]],
                                           all_src_offsets: Sequence[Sequence[int]]
                                           ) -> list[int]:
        """Copies, per key, ``size`` bytes of its object from each ``src_offset`` into each
        registered ``ptr``: bytes read per key, or -600 (no session, a range outside the
        object or registered memory, mismatched lists); nothing of that key is copied then."""
        if self._reader() is None:
            return []
        if not len(keys) == len(all_buffer_ptrs) == len(all_sizes) == len(all_src_offsets):
            return [INVALID_PARAMS] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        for i, key in enumerate(keys):
            ptrs, sizes, offs = all_buffer_ptrs[i], all_sizes[i], all_src_offsets[i]
            with self._lock:
                value = (self._get_sessions.get(mooncake_key(key))
                         if isinstance(key, (str, bytes)) else None)
            if value is None or not _ranges_ok(ptrs, sizes, offs, len(value)):
                continue
            views = self._views(ptrs, sizes)
            if views is None:
                continue
            for view, off in zip(views, offs, strict=True):
                view[:] = value[off : off + len(view)]
            codes[i] = sum(sizes)
        return codes

    def batch_get_session_end(self, keys: Sequence[Key]) -> int:
        """Forgets the keys' get sessions (a key without one is fine): 0, or -1 when the
        store is not set up."""
        if self._reader() is None:
            return -1
        with self._lock:
            for k in keys:
                if isinstance(k, (str, bytes)):
                    self._get_sessions.pop(mooncake_key(k), None)
        return OK
