"""O_DIRECT staging: batched reads and writes of arbitrary caller buffers at aligned offsets.

O_DIRECT needs aligned buffers, offsets and lengths. A page-aligned caller buffer is
transferred in place and only its partial last page goes through a bounce buffer; an
unaligned one is bounced whole. Invariants: a write's padding is zeros, never stale
scratch bytes of another block; a read's bounced bytes reach the caller only after
the block verified against its checksum. A batch is split into chunks so that the
bounce memory of one chunk stays bounded (``_MAX_BOUNCE_PER_CHUNK``).
"""

from __future__ import annotations

import errno
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any

import xxhash

from tiers.ssd.buffers import ArenaPool, address_of, round_up
from tiers.ssd.io import Backend, OnComplete, _Op, inflight_depth
from tiers.ssd.types import ALIGNMENT

# A batch is split into chunks whose bounce buffers stay under this, so a batch
# of large unaligned values cannot make the tier map gigabytes of scratch memory.
_MAX_BOUNCE_PER_CHUNK = 64 << 20
_ZEROS = bytes(ALIGNMENT)
_EMPTY_XXH3 = xxhash.xxh3_64_intdigest(b"")


@dataclass(slots=True, kw_only=True)
class _ReadFixup:
    """How to finish one read after the I/O: verify, then copy bounce bytes to the caller."""

    out: memoryview  # the caller's buffer, first nbytes
    head: int  # bytes read straight into out[:head]
    bounce: memoryview | None  # holds out[head:nbytes] when not None
    checksum: int


@dataclass(slots=True, kw_only=True)
class _Chunk:
    """Items of a batch that share one bounce arena."""

    items: list[int] = field(default_factory=list)
    bounce_bytes: int = 0


def _split(mv: memoryview, direct: bool) -> tuple[int, int]:
    """The one O_DIRECT rule: how a transfer of ``mv`` goes, as (bytes moved in place from
    its start, length of the bounce slot that carries the rest padded to the alignment).

    Without O_DIRECT all of ``mv`` moves in place; an aligned buffer bounces only its
    partial last page; an unaligned one bounces whole.
    """
    n = len(mv)
    if not direct or n == 0:
        return n, 0
    if address_of(mv) % ALIGNMENT == 0:
        return n - n % ALIGNMENT, ALIGNMENT if n % ALIGNMENT else 0
    return 0, round_up(n)


def transfer_bytes(mv: memoryview, direct: bool) -> int:
    """Bytes one transfer of ``mv`` moves: its length, padded to the alignment under
    O_DIRECT."""
    head, slot = _split(mv, direct)
    return head + slot


def bounces(mv: memoryview, direct: bool) -> bool:
    """Whether a transfer of ``mv`` goes (partly) through a bounce buffer."""
    return _split(mv, direct)[1] > 0


def _bounce_need(mv: memoryview, direct: bool) -> int:
    """Scratch bytes one transfer of ``mv`` takes."""
    return _split(mv, direct)[1]


def _stage(mv: memoryview, direct: bool, scratch: memoryview, pos: int
           ) -> tuple[list[memoryview], int, memoryview | None, int]:
    """One transfer of the non-empty ``mv`` by ``_split``: its iovec, the ``head`` bytes
    moved in place, the bounce slot carved from ``scratch`` at ``pos`` (None if nothing
    is bounced), and the next free ``pos``."""
    head, slot = _split(mv, direct)
    bufs = [mv] if head == len(mv) else [mv[:head]] if head else []
    if not slot:
        return bufs, head, None, pos
    bounce = scratch[pos:pos + slot]
    return [*bufs, bounce], head, bounce, pos + slot


def _chunks(needs: Sequence[int]) -> list[_Chunk]:
    chunks = [_Chunk()]
    for i, need in enumerate(needs):
        c = chunks[-1]
        if c.items and c.bounce_bytes + need > _MAX_BOUNCE_PER_CHUNK:
            c = _Chunk()
            chunks.append(c)
        c.items.append(i)
        c.bounce_bytes += need
    return chunks


def _depth(ops: Sequence[_Op]) -> int:
    """In-flight ops for a batch: fewer for big transfers (see ssd_io.inflight_depth)."""
    if not ops:
        return 1
    return inflight_depth(sum(op.nbytes for op in ops) // len(ops), len(ops))


def write_views(backend: Backend, arenas: ArenaPool, direct: bool,
                views: Sequence[memoryview], offsets: Sequence[int],
                on_complete: OnComplete | None = None) -> list[int]:
    """Writes each view at its offset; per-view bytes transferred or -errno.

    Under O_DIRECT each transfer is padded to the alignment; an aligned caller
    buffer is written in place and only its partial last page is bounced.
    ``on_complete(view index, result)`` runs as each write finishes, while later
    ones are still in flight (e.g. to checksum the value meanwhile).
    """
    results = [0] * len(views)
    for chunk in _chunks([_bounce_need(mv, direct) for mv in views]):
        arena = arenas.acquire(chunk.bounce_bytes) if chunk.bounce_bytes else None
        try:
            ops: list[_Op] = []
            op_items: list[int] = []
            with (memoryview(arena) if arena is not None else memoryview(b"")) as scratch:
                pos = 0
                for i in chunk.items:
                    mv, n = views[i], len(views[i])
                    if n == 0:
                        continue
                    bufs, head, bounce, pos = _stage(mv, direct, scratch, pos)
                    if bounce is not None:
                        bounce[: n - head] = mv[head:]
                        # Pad with zeros, not stale scratch bytes of another block.
                        bounce[n - head:] = _ZEROS[: len(bounce) - (n - head)]
                    ops.append(_Op(is_write=True, offset=offsets[i], bufs=bufs,
                                   nbytes=sum(len(b) for b in bufs)))
                    op_items.append(i)
                backend.run(ops, _depth(ops),
                            partial(_write_done, op_items, results, on_complete))
                del ops
        finally:
            if arena is not None:
                arenas.release(arena)
    return results


def _read_ops(direct: bool, views: Sequence[memoryview], offsets: Sequence[int],
              checksums: Sequence[int] | None, items: Sequence[int], scratch: memoryview,
              ok: list[bool]) -> tuple[list[_Op], list[tuple[int, _ReadFixup, int]]]:
    """The read ops of ``items`` (bounce slots carved from ``scratch``) and, per op,
    (view index, how to finish it, bytes the op must move). Empty views are decided
    here (``ok``) and get no op."""
    ops: list[_Op] = []
    fixups: list[tuple[int, _ReadFixup, int]] = []
    pos = 0
    for i in items:
        mv, n = views[i], len(views[i])
        want = checksums[i] if checksums is not None else 0
        if n == 0:
            ok[i] = checksums is None or want == _EMPTY_XXH3
            continue
        bufs, head, bounce, pos = _stage(mv, direct, scratch, pos)
        total = head + (len(bounce) if bounce is not None else 0)
        # The value is the first n bytes of the iovec: the backend may verify it as
        # it lands (in C, without the GIL).
        ops.append(_Op(is_write=False, offset=offsets[i], bufs=bufs, nbytes=total,
                       verify_bytes=n, checksum=want if checksums is not None else None))
        fixups.append((i, _ReadFixup(out=mv, head=head, bounce=bounce, checksum=want), total))
    return ops, fixups


def read_views(backend: Backend, arenas: ArenaPool, direct: bool,
               views: Sequence[memoryview], offsets: Sequence[int],
               checksums: Sequence[int] | None, failed: Callable[[str], None]) -> list[bool]:
    """Reads ``len(view)`` bytes at each offset into each view; per-view success.

    With checksums, a block is good only if its bytes hash to its checksum;
    bounced bytes reach the caller only after they verified. Each failure is
    reported as it is found, by ``failed("io_errors")`` or
    ``failed("checksum_failures")``.
    """
    ok = [False] * len(views)
    verify = checksums is not None
    for chunk in _chunks([_bounce_need(mv, direct) for mv in views]):
        arena = arenas.acquire(chunk.bounce_bytes) if chunk.bounce_bytes else None
        try:
            with (memoryview(arena) if arena is not None else memoryview(b"")) as scratch:
                ops, fixups = _read_ops(direct, views, offsets, checksums, chunk.items,
                                        scratch, ok)
                # Each block is verified as it lands, while the rest are in flight.
                backend.run(ops, _depth(ops), partial(_read_done, ops, fixups, ok, verify, failed))
                del ops, fixups
        finally:
            if arena is not None:
                arenas.release(arena)
    return ok


class ReadJob:
    """Block reads in flight, driven by whoever calls :meth:`reap` (see
    :meth:`tiers.ssd.tier.SsdTier.submit_reads`).

    Chunks (bounded bounce memory) run one after another: the next is submitted as
    the previous one's last op is reaped. Invariants: a view index is returned by
    :meth:`reap` once, after ``ok[i]`` is final (and, if good, the caller's buffer
    holds the value); after :meth:`release` no I/O touches the caller's buffers and
    the arenas are back in the pool.
    """

    def __init__(self, backend: Backend, arenas: ArenaPool, direct: bool,
                 views: Sequence[memoryview], offsets: Sequence[int],
                 checksums: Sequence[int], failed: Callable[[str], None]) -> None:
        self.ok = [False] * len(views)
        self._backend, self._arenas, self._direct = backend, arenas, direct
        self._views, self._offsets, self._checksums = views, offsets, checksums
        self._failed = failed
        self._chunks = _chunks([_bounce_need(mv, direct) for mv in views])
        self._next_chunk = 0
        self._left = len(views)  # view indices not yet returned by reap
        self._ready: list[int] = []  # decided without I/O (empty views), not yet returned
        self._batch: Any = None
        self._ops: list[_Op] = []
        self._fixups: list[tuple[int, _ReadFixup, int]] = []
        self._arena: Any = None
        self._scratch: memoryview | None = None
        self._cancelled = False
        self._start_next()

    def _start_next(self) -> None:
        """Submits the next chunk with ops (deciding empty views on the way)."""
        while self._batch is None and self._next_chunk < len(self._chunks):
            chunk = self._chunks[self._next_chunk]
            self._next_chunk += 1
            if self._cancelled:
                self._ready.extend(chunk.items)  # never read: ok stays False
                continue
            need = chunk.bounce_bytes
            self._arena = self._arenas.acquire(need) if need else None
            self._scratch = memoryview(self._arena) if self._arena is not None else None
            before = list(chunk.items)
            ops, fixups = _read_ops(self._direct, self._views, self._offsets,
                                    self._checksums, before,
                                    self._scratch if self._scratch is not None
                                    else memoryview(b""), self.ok)
            with_op = {i for i, _, _ in fixups}
            self._ready.extend(i for i in before if i not in with_op)
            if ops:
                try:
                    self._batch = self._backend.submit(ops, _depth(ops))
                except ValueError:  # the tier closed meanwhile: these reads failed
                    self._cancelled = True
                    self._ready.extend(with_op)
                    self._drop_arena()
                    continue
                self._ops, self._fixups = ops, fixups
            else:
                self._drop_arena()

    def _drop_arena(self) -> None:
        if self._scratch is not None:
            self._scratch.release()
            self._scratch = None
        if self._arena is not None:
            self._arenas.release(self._arena)
            self._arena = None

    def reap(self, timeout: float | None = None, *, all_left: bool = False
             ) -> list[int] | None:
        """View indices finished since the last call (waiting for at least one, or
        with ``all_left`` for the rest of the current chunk); ``[]`` once all were
        returned; None if none finished within ``timeout``."""
        if self._ready:
            out, self._ready = self._ready, []
            self._left -= len(out)
            return out
        if self._left == 0:
            return []
        while True:
            assert self._batch is not None
            got = self._batch.reap(timeout, all_left=all_left)
            if got is None:
                return None
            if got:
                break
            self._end_batch()  # chunk complete: on to the next
            if self._ready:
                return self.reap(timeout, all_left=all_left)
        out = []
        results = self._batch.results
        for k in got:
            i, fx, total = self._fixups[k]
            if results[k] != -errno.ECANCELED:  # (cancelled or closed: not an I/O error)
                self.ok[i] = _finish_read(fx, results[k], total, True,
                                          self._ops[k].verified, self._failed)
            out.append(i)
        self._left -= len(out)
        return out

    def _end_batch(self) -> None:
        if self._batch is not None:
            self._batch.release()
            self._batch = None
        self._ops, self._fixups = [], []
        self._drop_arena()
        self._start_next()

    def cancel(self) -> None:
        """Reads not yet started end as failed (False) without I/O."""
        self._cancelled = True
        if self._batch is not None:
            self._batch.cancel()

    def release(self) -> None:
        """Waits for every op in flight, then frees the buffers (idempotent)."""
        self._cancelled = True
        while self._batch is not None:
            self._batch.cancel()
            self._end_batch()


def _write_done(op_items: list[int], results: list[int], on_complete: OnComplete | None,
                k: int, r: int) -> None:
    results[op_items[k]] = r
    if on_complete is not None:
        on_complete(op_items[k], r)


def _read_done(ops: list[_Op], fixups: list[tuple[int, _ReadFixup, int]], ok: list[bool],
               verify: bool, failed: Callable[[str], None], k: int, r: int) -> None:
    i, fx, total = fixups[k]
    ok[i] = _finish_read(fx, r, total, verify, ops[k].verified, failed)


def _finish_read(fx: _ReadFixup, result: int, total: int, verify: bool, verified: int,
                 failed: Callable[[str], None]) -> bool:
    """Checks one read (``verified``: the backend's verdict, -1 if it gave none) and
    copies its bounced bytes to the caller only if it is good."""
    if result != total:
        failed("io_errors")
        return False
    n = len(fx.out)
    tail = n - fx.head
    if verify and verified == 0:
        failed("checksum_failures")
        return False
    if verify and verified != 1:
        h = xxhash.xxh3_64()
        if fx.head:
            h.update(fx.out[: fx.head])
        if tail:
            assert fx.bounce is not None
            h.update(fx.bounce[:tail])
        if h.intdigest() != fx.checksum:
            failed("checksum_failures")
            return False
    if tail and fx.bounce is not None:
        fx.out[fx.head:] = fx.bounce[:tail]
    return True

