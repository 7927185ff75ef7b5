"""The store node's semantics, shared by every transport (gRPC, TCP channel, shared memory).

Lock order: ``Node._lock`` is the only lock over block metadata (the
TierManager) and it is never held while bytes move. Locks that may be taken
while it is held are leaves: a tier's own lock (the SSD tier guards its
allocator and index with one). ``Node._admission`` (a plain lock: taken twice per
request) guards only ``_draining`` and ``_in_flight`` and is never held together
with ``_lock``; neither is ``TierMover._rounds`` (which counts moves in flight).
The TierMover takes ``_lock`` only to plan and to finish moves, never during I/O.

Byte copies happen outside ``_lock`` under a reservation (puts) or a read lease
(gets), both scoped by context managers so no path can forget to end them:
an exception inside a put scope aborts the reservation, leaving no partial
block and no leaked space.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from types import TracebackType
from typing import TypeVar

from kvstore.auth.quotas import QuotaBook

# Re-exported: these lived here before kvstore.core.checks, and callers import them from here.
from kvstore.core.checks import MAX_BATCH as MAX_BATCH
from kvstore.core.checks import check_key as check_key
from kvstore.core.checks import check_keys as check_keys
from kvstore.core.checks import check_parent as check_parent
from kvstore.core.collector import collector_paused
from kvstore.core.errors import (
    REPLY_BOUND,
    InvalidArgument,
    ReplyTooLarge,
    ResourceExhausted,
    Unavailable,
)
from kvstore.core.forwarding import BlockCopy
from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import (
    DEFAULT_MAX_PREFETCH_BYTES,
    DEFAULT_PREFETCH_TIER,
    MAX_PREFETCH_KEYS,
    PrefetchOutcome,
)
from kvstore.core.retention import MAX_RETAIN_KEYS, RetainOutcome
from kvstore.node.fit import check_fits, index_budget, planned_blocks
from kvstore.node.room import PutRoom, RoomTries
from tiers.base import DurableCopy, Tier
from tiers.dram import DramTier
from tiers.errors import BlockTooLarge, OutOfSpace
from tiers.index_budget import DEFAULT_BLOCK_BYTES
from tiers.index_kind import for_planned_blocks as index_for
from tiers.manager import BlockEntry, NeedsRoom, Reservation, TierManager, Watermarks
from tiers.mover import TierMover, leased_block_view, leased_block_views
from tiers.observer import TierObserver
from tiers.policy import make_policy
from tiers.retention import DEFAULT_MAX_RETAINED_FRACTION, RetentionBook, retain_ask

log = logging.getLogger("kvstore.node.semantics")
T = TypeVar("T")


@dataclass(slots=True, kw_only=True)
class NodeSettings:
    dram_bytes: int
    block_bytes: int = DEFAULT_BLOCK_BYTES  # the index's memory is planned for these blocks
    policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    prefault: bool = True
    hbm_bytes: int = 0  # 0: no HBM tier
    hbm_device: str | None = None  # None: CUDA if present, else CPU
    ssd_path: str | None = None  # None: no SSD tier
    ssd_bytes: int = 0
    ssd_io: str = "auto"
    allow_index_rebuild: bool = False  # rebuild a damaged SSD index from the data region
    max_retained_fraction: float = DEFAULT_MAX_RETAINED_FRACTION  # of all tiers' capacity
    max_prefetch_bytes: int = DEFAULT_MAX_PREFETCH_BYTES  # of blocks prefetches have in flight


class _RequestScope:
    """Reusable, stateless context manager (cheaper per request than a generator)."""

    __slots__ = ("_node",)

    def __init__(self, node: Node) -> None:
        self._node = node

    def __enter__(self) -> None:
        self._node._enter_request()

    def __exit__(self, *exc: object) -> None:
        self._node._exit_request()


class PutSlot:
    """Reserved space for one put: fill ``view``, and the scope's exit commits it."""

    __slots__ = ("reservation", "stored", "view")

    def __init__(self, reservation: Reservation, view: memoryview) -> None:
        self.reservation = reservation
        self.view = view
        self.stored = False


class PutScope:
    """``Node.put_slot``'s scope: entering reserves (a ``PutSlot``, or None when the key is
    stored already), a clean exit commits, an exception aborts and propagates. A class, not
    a generator: a node enters one per put."""

    __slots__ = ("_args", "_node", "_slot")

    def __init__(self, node: Node, args: tuple[BlockKey, int, BlockKey | None, bool,
                                               str | None, int | None, float | None, int]
                 ) -> None:
        self._node = node
        self._args = args
        self._slot: PutSlot | None = None

    def __enter__(self) -> PutSlot | None:
        node = self._node
        reservation = node._reserve(*self._args)
        if reservation is None:
            return None
        self._slot = PutSlot(reservation, node._manager.fill_view(reservation))
        return self._slot

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        slot = self._slot
        if slot is None:
            return
        self._slot = None
        slot.view.release()
        if exc_type is not None:
            self._node.abort(slot.reservation)
            return
        slot.stored = self._node.commit(slot.reservation)


class Node:
    """One store node: the tier manager behind a lock, with admission control."""

    def __init__(self, settings: NodeSettings, *, clock: Callable[[], float] = time.monotonic,
                 wall_clock: Callable[[], float] = time.time):
        """``clock``: monotonic seconds (retention, uptime); ``wall_clock``: seconds since
        the epoch, for retention deadlines the SSD tier keeps across restarts."""
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._info: dict[str, str | int | bool] = {}
        self._stat_sources: list[Callable[[], dict[str, object]]] = []
        tiers = self._open_tiers(settings)
        self._tiers = tiers
        self._tier = next(t for t in tiers if isinstance(t, DramTier))
        self._lock = threading.Lock()
        # guarded by _lock:
        self._quotas = QuotaBook()
        self._manager = TierManager(
            tiers,
            make_policy(settings.policy),
            watermarks=Watermarks(high=settings.high_watermark, low=settings.low_watermark),
            retention=RetentionBook(clock=clock, wall_clock=wall_clock, max_bytes=int(
                settings.max_retained_fraction * sum(t.capacity for t in tiers))),
            index=self._index,
        )
        self._recover()
        self._mover: TierMover | None = None
        self._room: PutRoom | None = None
        if len(tiers) > 1:
            self._mover = TierMover(self._manager, self._lock)
            self._room = PutRoom(self._manager, self._lock, self._mover)
            self._mover.start()
        self._admission = threading.Lock()
        # guarded by _admission:
        self._draining = False
        self._in_flight = 0
        self._idle = threading.Event()  # set once draining and no request is in flight
        self._request_scope = _RequestScope(self)

    def _open_tiers(self, s: NodeSettings) -> list[Tier]:
        tier_bytes = {"hbm": s.hbm_bytes, "dram": s.dram_bytes,
                      "ssd": s.ssd_bytes if s.ssd_path else 0}
        # What every tier's allocator and the manager run:
        self._index = index_for(sum(planned_blocks(tier_bytes, s.block_bytes).values()))
        budget = index_budget(tier_bytes, s.block_bytes, kind=self._index)
        # Reported once the node serves (``kvstore serve``): a CLI error before that stays
        # one line.
        self._info["tier_index"] = self._index
        self._info["index_budget"] = budget.describe()
        self._info["index_budget_bytes"] = budget.nbytes
        self._info["index_budget_blocks"] = budget.total_blocks
        check_fits(s.dram_bytes, s.hbm_bytes, s.hbm_device, index=budget)
        tiers: list[Tier] = []
        try:
            if s.hbm_bytes:
                from tiers.hbm import HbmTier

                hbm = HbmTier(s.hbm_bytes, device=s.hbm_device, index=self._index)
                self._info["hbm_device"] = hbm.device
                log.info("HBM tier: %d bytes on device %s%s", s.hbm_bytes, hbm.device,
                         "" if hbm.on_gpu else " (no GPU: the HBM code path runs on the CPU)")
                tiers.append(hbm)
            dram = DramTier(s.dram_bytes, prefault=s.prefault, index=self._index)
            self._info["dram_pinned"] = dram.pinned
            tiers.append(dram)
            if s.ssd_path:
                tiers.append(self._open_ssd(s))
        except BaseException:
            for t in tiers:
                t.close()
            raise
        return tiers

    def _open_ssd(self, s: NodeSettings) -> Tier:
        """The SSD tier; a damaged index is an ERROR, and the node does not start unless
        ``allow_index_rebuild`` (then the index is rebuilt from the data region, counted)."""
        from tiers.ssd.tier import SsdIndexDamagedError, SsdTier

        try:
            with collector_paused():  # its records: what a restart recovers
                ssd = SsdTier(s.ssd_path or "", s.ssd_bytes, io=s.ssd_io,
                              allow_index_rebuild=s.allow_index_rebuild,
                              index_kind=self._index)
        except SsdIndexDamagedError as exc:
            log.error("the SSD tier's index is damaged, so its blocks cannot be served: %s",
                      exc)
            raise SsdIndexDamagedError(
                f"{exc}. The blocks may still be intact on {s.ssd_path}: start with "
                "--allow-index-rebuild (config key allow_index_rebuild = true) to rebuild "
                "the index from them (the damaged index is kept beside it)") from exc
        self._info["ssd_io"] = ssd.io_backend
        report = ssd.rebuild_report
        self._info["ssd_index_rebuilds"] = 0 if report is None else 1
        self._info["ssd_rebuilt_blocks"] = 0 if report is None else report.rebuilt
        self._info["ssd_rebuild_dropped_blocks"] = 0 if report is None else report.dropped
        if report is not None:
            log.error("the SSD tier's index was damaged (%s) and was rebuilt from %s: %d "
                      "blocks intact and served, %d dropped (torn, corrupt or superseded), "
                      "%d header-like pages not verified by this node's key; the damaged "
                      "index was kept at %s", report.reason, s.ssd_path, report.rebuilt,
                      report.dropped, report.unverified, report.kept_at or "(none: it was gone)")
        return ssd

    def _recover(self) -> None:
        """Indexes every block the SSD tier kept across a restart (its index, no data scan),
        retained until the deadline each kept if that has not passed."""
        for level, lv in enumerate(self._manager.levels):
            if lv.durable_tier is not None:
                records = lv.durable_tier.recover()
                m = self._manager
                with collector_paused():
                    m.adopt_many(level, ((r.key, r.parent, r.location.nbytes, r.location,
                                          r.retention) for r in records))
                self._info["recovered_blocks"] = len(records)
                log.info("recovered %d blocks from the %s tier (%d still retained)",
                         len(records), lv.tier.name, len(m.retention.held))

    def _delete_durable(self, garbage: Sequence[DurableCopy]) -> None:
        """Deletes durable copies released by the manager (I/O: never under ``_lock``)."""
        if garbage and self._mover is not None:
            self._mover.delete_durable(garbage)

    # ---- admission -----------------------------------------------------------------------

    def request(self) -> _RequestScope:
        """Scope of one client request; entering it raises Unavailable once draining."""
        return self._request_scope

    def _enter_request(self) -> None:
        with self._admission:
            if self._draining:
                raise Unavailable("node is draining")
            self._in_flight += 1

    def _exit_request(self) -> None:
        with self._admission:
            self._in_flight -= 1
            if self._draining and self._in_flight == 0:
                self._idle.set()

    @property
    def draining(self) -> bool:
        with self._admission:
            return self._draining

    def drain(self, timeout: float) -> bool:
        """Refuses new requests and waits for in-flight ones; True if all finished in time."""
        with self._admission:
            self._draining = True
            if self._in_flight == 0:
                self._idle.set()
        return self._idle.wait(timeout)

    # ---- puts ----------------------------------------------------------------------------

    def _reserve(self, key: BlockKey, nbytes: int, parent: BlockKey | None, pin: bool,
                 owner: str | None = None, quota: int | None = None,
                 retain_s: float | None = None, holding: int = 0) -> Reservation | None:
        if nbytes <= 0:
            raise InvalidArgument("a block value must not be empty")
        if parent == key:
            raise InvalidArgument("a block cannot be its own parent")
        retain = retain_ask(retain_s, owner=owner, quota=quota,
                            fraction=self.settings.max_retained_fraction)
        tries: RoomTries | None = None
        while True:
            try:
                with self._lock:
                    if owner is not None and quota is not None and key not in self._manager:
                        self._quotas.check(owner, quota, nbytes, key=key)
                    reservation = self._manager.reserve(key, nbytes, parent=parent, pin=pin,
                                                        retain=retain)
                    if reservation is not None and owner is not None:
                        self._quotas.charge_reservation(owner, reservation, nbytes,
                                                        key=key)
                    # Evicted blocks leave their owner's quota; nothing else needs to hear
                    # of them, so the events cannot pile up.
                    for gone in self._manager.drain_evicted():
                        self._quotas.release(gone)
                    over = bool(self._mover) and bool(self._manager.over_high())
                if over and self._mover is not None:
                    self._mover.nudge()
                return reservation
            except NeedsRoom as need:
                # The background mover fell behind: make room here, outside the lock, or
                # wait for it (``kvstore.node.room``); raises when none will come.
                assert self._room is not None
                if tries is None:
                    tries = self._room.start()
                self._room.make(need, tries, holding=holding)
            except (BlockTooLarge, OutOfSpace) as exc:
                raise ResourceExhausted(str(exc)) from exc

    def reserve(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None,
                pin: bool = False, owner: str | None = None, quota: int | None = None,
                retain_s: float | None = None, holding: int = 0) -> Reservation | None:
        """Space for a put whose bytes arrive later (None: the key is already stored).

        The caller owns the reservation until it hands it to ``commit`` or ``abort``;
        transports keep them in a ``ReservationSet`` that aborts leftovers on close.
        ``holding``: bytes of reservations the caller holds already (``reserved_bytes``
        of them), which a full DRAM tier must not wait for (``kvstore.node.room``).
        """
        return self._reserve(key, nbytes, parent, pin, owner, quota, retain_s, holding)

    def fill_view(self, reservation: Reservation) -> memoryview:
        return self._manager.fill_view(reservation)

    def commit(self, reservation: Reservation) -> bool:
        """Publishes the block: True, or False (space and charge returned) if another put
        of the key stored it first."""
        with self._lock:
            stored = self._manager.commit(reservation)
            self._quotas.settle(reservation, reservation.key, stored=stored)
        if self._room is not None:
            self._room.settled()
        return stored

    def abort(self, reservation: Reservation) -> None:
        with self._lock:
            self._manager.abort(reservation)
            self._quotas.settle(reservation, reservation.key, stored=False)
        if self._room is not None:
            self._room.settled()

    def put_slot(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None,
                 pin: bool = False, owner: str | None = None, quota: int | None = None,
                 retain_s: float | None = None, holding: int = 0) -> PutScope:
        """Two-phase put: reserve, let the caller fill ``slot.view``, commit on a clean exit.

        Yields None when the key is already stored (the put is an idempotent no-op).
        ``owner`` is charged ``nbytes`` against ``quota`` (see ``kvstore.auth.quotas``);
        ``retain_s``: see ``tiers.retention``; ``holding``: see ``reserve``.
        """
        return PutScope(self, (key, nbytes, parent, pin, owner, quota, retain_s, holding))

    def put(self, key: BlockKey, value: memoryview, *, parent: BlockKey | None = None,
            pin: bool = False, owner: str | None = None, quota: int | None = None,
            retain_s: float | None = None) -> bool:
        """Stores ``value`` under ``key``; False if the key was already stored."""
        with self.put_slot(key, len(value), parent=parent, pin=pin, owner=owner,
                           quota=quota, retain_s=retain_s) as slot:
            if slot is None:
                return False
            slot.view[:] = value
        return slot.stored

    # ---- reads ---------------------------------------------------------------------------

    def acquire_read(self, key: BlockKey) -> BlockEntry | None:
        """A read lease; pair with ``release_read`` via ``reading`` or a ``LeaseSet``."""
        with self._lock:
            return self._manager.acquire_read(key)

    def release_read(self, entry: BlockEntry) -> None:
        with self._lock:
            gone = self._manager.release_read(entry)
        if gone is not None:
            self._delete_durable([gone])

    def block_view(self, entry: BlockEntry) -> memoryview | None:
        """The bytes of a leased block: in place for a mapped tier, else read into a buffer.

        None if the copy failed its checksum: the block is then reported corrupt
        (counted, and dropped from the index) and must be treated as a miss.
        """
        return leased_block_view(self._manager, self._lock, entry)

    def block_views(self, entries: Sequence[BlockEntry | None]) -> list[memoryview | None]:
        """``block_view`` of each leased entry (None stays None); an SSD tier's blocks are
        read in one batch, so its queue stays as deep as the request."""
        return leased_block_views(self._manager, self._lock, entries)

    def is_mapped(self, entry: BlockEntry) -> bool:
        return self._manager.is_mapped(entry)

    def acquire_reads(self, keys: Sequence[BlockKey], *, access: bool = True
                      ) -> list[BlockEntry | None]:
        """Read leases on several keys under one lock acquisition (``access``: see
        ``TierManager.acquire_read``)."""
        with self._lock:
            acquire = self._manager.acquire_read
            return [acquire(k, access=access) for k in keys]

    def release_reads(self, entries: Sequence[BlockEntry | None]) -> None:
        garbage: list[DurableCopy] = []
        with self._lock:
            for entry in entries:
                if entry is not None:
                    gone = self._manager.release_read(entry)
                    if gone is not None:
                        garbage.append(gone)
        self._delete_durable(garbage)

    def read_view(self, entry: BlockEntry) -> memoryview:
        return self._manager.read_view(entry)

    @contextmanager
    def reading_many(self, keys: Sequence[BlockKey], *, max_bytes: int | None = None
                     ) -> Iterator[list[memoryview | None]]:
        """Views of several blocks (None per miss), valid inside the scope."""
        with self.reading_blocks(keys, max_bytes=max_bytes) as blocks:
            yield [None if b is None else b[1] for b in blocks]

    @contextmanager
    def reading_blocks(self, keys: Sequence[BlockKey], *, access: bool = True,
                       max_bytes: int | None = None
                       ) -> Iterator[list[tuple[BlockEntry, memoryview] | None]]:
        """Each block's entry (parent, pin) and bytes, None per miss, valid inside the scope.

        ``access=False`` for copies the cluster makes: not counted as reads.
        ``max_bytes``: ReplyTooLarge if the leased blocks (repeats included) sum past
        it, checked on the leases themselves (no put can grow the total after the check)
        and before any block is read into a buffer."""
        entries = self.acquire_reads(keys, access=access)
        try:
            if max_bytes is not None:
                total = sum(e.nbytes for e in entries if e is not None)
                if total > max_bytes:
                    raise ReplyTooLarge(
                        f"the reply would be {total} bytes, over the {max_bytes}-byte "
                        f"{REPLY_BOUND}: ask for fewer keys per request")
            views = self.block_views(entries)
            yield [None if e is None or v is None else (e, v)
                   for e, v in zip(entries, views, strict=True)]
        finally:
            self.release_reads(entries)

    @contextmanager
    def copying(self, keys: Sequence[BlockKey]) -> Iterator[list[BlockCopy | None]]:
        """Frozen copies-to-be of the blocks (None per miss) for replication and repair,
        their bytes valid inside the scope, each with the tenant it is charged to here;
        not counted as reads."""
        with self.reading_blocks(keys, access=False) as blocks:
            # A copy carries the retention the block has now, and its tenant (charged there).
            with self._lock:
                held, owner_of = self._manager.retention.seconds_of, self._quotas.owner_of
                kept = [(0.0, None) if b is None else (held(b[0].key), owner_of(b[0].key))
                        for b in blocks]
            yield [None if b is None else BlockCopy(key=b[0].key, place=b[0].key,
                                                    parent=b[0].parent, pin=b[0].pinned,
                                                    retain_s=s, owner=o, value=b[1])
                   for b, (s, o) in zip(blocks, kept, strict=True)]

    def block_sizes(self, keys: Sequence[BlockKey]) -> list[int | None]:
        """Each key's block size (None if absent); not counted as reads."""
        with self._lock:
            m = self._manager
            return [None if e is None else e.nbytes for e in map(m.entry, keys)]

    def keys(self) -> list[BlockKey]:
        """A snapshot of every stored key (for repair scans)."""
        with self._lock:
            return self._manager.keys()

    def observe(self, observer: TierObserver | None) -> None:
        """Tells ``observer`` of every later index change, under ``_lock``
        (kvstore.node.kv_events)."""
        with self._lock:
            self._manager.observer = observer

    def index_snapshot(self, atomically: Callable[[], T]
                       ) -> tuple[list[tuple[BlockKey, BlockKey | None, int]], T]:
        """Every block as (key, parent, level), and ``atomically()``, under one lock hold."""
        with self._lock:
            m = self._manager
            return [(e.key, e.parent, e.level) for e in map(m.entry, m.keys()) if e], atomically()

    @contextmanager
    def reading(self, key: BlockKey) -> Iterator[memoryview | None]:
        """The block's bytes, valid inside the scope (None on a miss)."""
        entry = self.acquire_read(key)
        if entry is None:
            yield None
            return
        try:
            view = self.block_view(entry)
            yield view
        finally:
            self.release_read(entry)

    def get(self, key: BlockKey) -> bytes | None:
        with self.reading(key) as view:
            return None if view is None else bytes(view)

    # ---- queries -------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            m = self._manager
            return [k in m for k in keys]

    def locate(self, keys: Sequence[BlockKey]) -> list[str | None]:
        """The name of the tier holding each key (None if absent); not counted as a read."""
        with self._lock:
            m = self._manager
            out: list[str | None] = []
            for k in keys:
                e = m.entry(k)
                out.append(None if e is None else m.levels[e.level].tier.name)
            return out

    def prefix_match(self, keys: list[BlockKey]) -> int:
        with self._lock:
            return self._manager.prefix_length(keys)

    def prefetch(self, keys: Sequence[BlockKey], tier: str = DEFAULT_PREFETCH_TIER, *,
                 wait: bool = False) -> list[PrefetchOutcome]:
        """Brings the blocks of ``keys`` this node holds up to the memory tier ``tier``
        ahead of their use; one ``PrefetchOutcome`` per key, in order (docs/node.md,
        "Prefetch"; the rules: ``tiers.manager``, "Prefetch").

        Why asynchronous by default: the caller (a router whose request waits for an
        instance) wants the moves started, not to wait on SSD reads; the plan is made
        under the lock before the call returns, so every answer but QUEUED is already
        final (PRESENT, MISSING, BUSY, NO_ROOM: no room could be planned), and QUEUED
        means the room is reserved or its demotions planned, the copies running on the
        mover's worker. ``wait=True`` runs the moves in the calling thread and answers
        their result (PROMOTED or UNDONE instead of QUEUED), for callers that need to
        know (tests, a benchmark that measures a warm turn).

        InvalidArgument for more than ``MAX_PREFETCH_KEYS`` keys or a tier the node does
        not have as memory. Keys are stored keys (a transport salts a tenant's first).
        """
        if len(keys) > MAX_PREFETCH_KEYS:
            raise InvalidArgument(f"at most {MAX_PREFETCH_KEYS} keys per prefetch, got "
                                  f"{len(keys)}")
        with self._lock:
            try:
                level = self._manager.memory_level(tier)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            plan = self._manager.plan_prefetch(keys, level,
                                               max_bytes=self.settings.max_prefetch_bytes)
            if not plan.has_work:
                self._manager.settle_prefetch(plan)
                return plan.answer()
        # Work means a block below the tier: a node with one tier has no mover and none.
        assert self._mover is not None
        if wait:
            self._mover.prefetch(plan)
            return plan.answer()
        answer = plan.answer()  # before the worker moves its outcomes on
        self._mover.submit_prefetch(plan)
        return answer

    def retain(self, keys: Sequence[BlockKey], retain_s: float, *, owner: str | None = None,
               quota: int | None = None) -> list[RetainOutcome]:
        """Retains the stored blocks of ``keys`` for ``retain_s`` seconds as a put of each
        would (the node's cap, ``owner``'s share of ``quota``), or with 0 releases them to
        ordinary eviction; one ``RetainOutcome`` per key, in order (docs/node.md,
        "Retaining stored blocks"). InvalidArgument for more than ``MAX_RETAIN_KEYS`` keys
        or a bad ``retain_s``. Keys are stored keys (a transport salts a tenant's first)."""
        if len(keys) > MAX_RETAIN_KEYS:
            raise InvalidArgument(f"at most {MAX_RETAIN_KEYS} keys per retain, got {len(keys)}")
        ask = retain_ask(retain_s, owner=owner, quota=quota,
                         fraction=self.settings.max_retained_fraction)
        with self._lock:
            m = self._manager
            if ask is None:
                return [RetainOutcome.RELEASED if m.release(k) else RetainOutcome.MISSING
                        for k in keys]
            got = [m.retain(k, ask) for k in keys]
        return [RetainOutcome.MISSING if g is None else
                RetainOutcome.RETAINED if g else RetainOutcome.DENIED for g in got]

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            gone = self._manager.remove(key)
            if gone is not False:
                self._quotas.release(key)
        if isinstance(gone, DurableCopy):
            self._delete_durable([gone])
            return True
        return gone

    def stats(self) -> dict:
        with self._lock:
            m = self._manager
            tiers = [m.level_stats(i) for i in range(len(m.levels))]
            pending = m.pending_promotions()
            quota_used = self._quotas.used()
            retained = m.retention.stats()
            prefetched = m.prefetch_stats()
        with self._admission:
            draining, in_flight = self._draining, self._in_flight
        return {
            "node": {
                "policy": self.settings.policy,
                "uptime_s": round(self._clock() - self._started, 3),
                "draining": draining,
                "in_flight": in_flight,
                "pending_promotions": pending,
                **({"namespace_bytes": quota_used} if quota_used else {}),
                **retained,
                **prefetched,
                **self._info,
                **{k: v for source in self._stat_sources for k, v in source().items()},
            },
            "tiers": {str(t["name"]): t for t in tiers},
        }

    def add_stat_source(self, source: Callable[[], dict[str, object]]) -> None:
        """Adds ``source()``'s items to the node section of ``stats`` (cluster parts report
        here). Sources are called without any node lock held."""
        self._stat_sources.append(source)

    # ---- shared memory -------------------------------------------------------------------

    @property
    def region_fd(self) -> int:
        """memfd of the DRAM region, for same-host clients."""
        return self._tier.fd

    @property
    def region_bytes(self) -> int:
        return self._tier.region_bytes

    def close(self) -> None:
        if self._mover is not None:
            self._mover.stop()
            self._mover.flush_retention()  # the last reads' deadlines, for the next start
        for t in self._tiers:
            t.close()
