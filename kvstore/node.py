"""The store node's semantics, shared by every transport (gRPC, TCP channel, shared memory).

Lock order: ``Node._lock`` is the only lock over block metadata and it is never
held while bytes move or while any other lock is taken. ``Node._admission``
(a Condition with its own lock) guards only ``_draining`` and ``_in_flight``;
it is never held together with ``_lock``.

Byte copies happen outside ``_lock`` under a reservation (puts) or a read lease
(gets), both scoped by context managers so no path can forget to end them:
an exception inside a put scope aborts the reservation, leaving no partial
block and no leaked space.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

from kvstore.errors import InvalidArgument, ResourceExhausted, Unavailable
from kvstore.keys import KEY_BYTES, BlockKey
from tiers.dram import DramTier
from tiers.errors import BlockTooLarge, OutOfSpace
from tiers.manager import BlockEntry, Reservation, TierManager, Watermarks
from tiers.policy import make_policy

MAX_BATCH = 65536
"""Most keys one request may name; larger batches are split by the client."""


@dataclass(slots=True, kw_only=True)
class NodeSettings:
    dram_bytes: int
    policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    prefault: bool = True


def check_key(key: object, what: str = "key") -> BlockKey:
    if not isinstance(key, bytes | bytearray | memoryview) or len(key) != KEY_BYTES:
        n = len(key) if isinstance(key, bytes | bytearray | memoryview) else type(key).__name__
        raise InvalidArgument(f"{what} must be {KEY_BYTES} bytes, got {n}")
    return BlockKey(bytes(key))


def check_keys(keys: Sequence[object]) -> list[BlockKey]:
    if len(keys) > MAX_BATCH:
        raise InvalidArgument(f"at most {MAX_BATCH} keys per request, got {len(keys)}")
    return [check_key(k) for k in keys]


def check_parent(parent: object) -> BlockKey | None:
    if parent is None or (isinstance(parent, bytes | bytearray | memoryview) and len(parent) == 0):
        return None
    return check_key(parent, "parent key")


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


class Node:
    """One store node: the tier manager behind a lock, with admission control."""

    def __init__(self, settings: NodeSettings, *, clock: Callable[[], float] = time.monotonic):
        self.settings = settings
        self._clock = clock
        self._started = clock()
        self._tier = DramTier(settings.dram_bytes, prefault=settings.prefault)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._manager = TierManager(
            self._tier,
            make_policy(settings.policy),
            watermarks=Watermarks(high=settings.high_watermark, low=settings.low_watermark),
        )
        self._admission = threading.Condition(threading.Lock())
        # guarded by _admission:
        self._draining = False
        self._in_flight = 0
        self._request_scope = _RequestScope(self)

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
            if self._in_flight == 0:
                self._admission.notify_all()

    @property
    def draining(self) -> bool:
        with self._admission:
            return self._draining

    def drain(self, timeout: float) -> bool:
        """Refuses new requests and waits for in-flight ones; True if all finished in time."""
        with self._admission:
            self._draining = True
            return self._admission.wait_for(lambda: self._in_flight == 0, timeout)

    # ---- puts ----------------------------------------------------------------------------

    def _reserve(self, key: BlockKey, nbytes: int, parent: BlockKey | None, pin: bool
                 ) -> Reservation | None:
        if nbytes <= 0:
            raise InvalidArgument("a block value must not be empty")
        if parent == key:
            raise InvalidArgument("a block cannot be its own parent")
        try:
            with self._lock:
                reservation = self._manager.reserve(key, nbytes, parent=parent, pin=pin)
                # Nothing outside the node needs to hear of evictions yet (no lower
                # tier, no replicas): drop the events so they cannot pile up.
                self._manager.drain_evicted()
                return reservation
        except (BlockTooLarge, OutOfSpace) as exc:
            raise ResourceExhausted(str(exc)) from None

    def reserve(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None,
                pin: bool = False) -> Reservation | None:
        """Space for a put whose bytes arrive later (None: the key is already stored).

        The caller owns the reservation until it hands it to ``commit`` or ``abort``;
        transports keep them in a ``ReservationSet`` that aborts leftovers on close.
        """
        return self._reserve(key, nbytes, parent, pin)

    def fill_view(self, reservation: Reservation) -> memoryview:
        return self._manager.fill_view(reservation)

    def commit(self, reservation: Reservation) -> bool:
        with self._lock:
            return self._manager.commit(reservation)

    def abort(self, reservation: Reservation) -> None:
        with self._lock:
            self._manager.abort(reservation)

    @contextmanager
    def put_slot(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None = None,
                 pin: bool = False) -> Iterator[PutSlot | None]:
        """Two-phase put: reserve, let the caller fill ``slot.view``, commit on a clean exit.

        Yields None when the key is already stored (the put is an idempotent no-op).
        """
        reservation = self._reserve(key, nbytes, parent, pin)
        if reservation is None:
            yield None
            return
        slot = PutSlot(reservation, self._manager.fill_view(reservation))
        try:
            yield slot
        except BaseException:
            slot.view.release()
            self.abort(reservation)
            raise
        slot.view.release()
        slot.stored = self.commit(reservation)

    def put(self, key: BlockKey, value: memoryview, *, parent: BlockKey | None = None,
            pin: bool = False) -> bool:
        """Stores ``value`` under ``key``; False if the key was already stored."""
        with self.put_slot(key, len(value), parent=parent, pin=pin) as slot:
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
            self._manager.release_read(entry)

    def acquire_reads(self, keys: Sequence[BlockKey]) -> list[BlockEntry | None]:
        """Read leases on several keys under one lock acquisition."""
        with self._lock:
            acquire = self._manager.acquire_read
            return [acquire(k) for k in keys]

    def release_reads(self, entries: Sequence[BlockEntry | None]) -> None:
        with self._lock:
            for entry in entries:
                if entry is not None:
                    self._manager.release_read(entry)

    def read_view(self, entry: BlockEntry) -> memoryview:
        return self._manager.read_view(entry)

    @contextmanager
    def reading_many(self, keys: Sequence[BlockKey]) -> Iterator[list[memoryview | None]]:
        """Views of several blocks (None per miss), valid inside the scope."""
        entries = self.acquire_reads(keys)
        try:
            yield [None if e is None else self._manager.read_view(e) for e in entries]
        finally:
            self.release_reads(entries)

    @contextmanager
    def reading(self, key: BlockKey) -> Iterator[memoryview | None]:
        """The block's bytes, valid inside the scope (None on a miss)."""
        entry = self.acquire_read(key)
        if entry is None:
            yield None
            return
        view = self._manager.read_view(entry)
        try:
            yield view
        finally:
            view.release()
            self.release_read(entry)

    def get(self, key: BlockKey) -> bytes | None:
        with self.reading(key) as view:
            return None if view is None else bytes(view)

    # ---- queries -------------------------------------------------------------------------

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        with self._lock:
            m = self._manager
            return [k in m for k in keys]

    def prefix_match(self, keys: list[BlockKey]) -> int:
        with self._lock:
            return self._manager.prefix_length(keys)

    def remove(self, key: BlockKey) -> bool:
        with self._lock:
            return self._manager.remove(key)

    def stats(self) -> dict:
        with self._lock:
            tier = self._manager.tier_stats()
        with self._admission:
            draining, in_flight = self._draining, self._in_flight
        return {
            "node": {
                "policy": self.settings.policy,
                "uptime_s": round(self._clock() - self._started, 3),
                "draining": draining,
                "in_flight": in_flight,
            },
            "tiers": {str(tier["name"]): tier},
        }

    # ---- shared memory -------------------------------------------------------------------

    @property
    def region_fd(self) -> int:
        """memfd of the DRAM region, for same-host clients."""
        return self._tier.fd

    @property
    def region_bytes(self) -> int:
        return self._tier.region_bytes

    def close(self) -> None:
        self._tier.close()


class LeaseSet:
    """Read leases a same-host client holds across requests, ended on release or close."""

    __slots__ = ("_leases", "_next_id", "_node")

    def __init__(self, node: Node) -> None:
        self._node = node
        self._leases: dict[int, BlockEntry] = {}
        self._next_id = 1

    def acquire(self, key: BlockKey) -> tuple[int, BlockEntry] | None:
        entry = self._node.acquire_read(key)
        if entry is None:
            return None
        lease_id = self._next_id
        self._next_id += 1
        self._leases[lease_id] = entry
        return lease_id, entry

    def release(self, lease_id: int) -> bool:
        entry = self._leases.pop(lease_id, None)
        if entry is None:
            return False
        self._node.release_read(entry)
        return True

    def close(self) -> None:
        for entry in self._leases.values():
            self._node.release_read(entry)
        self._leases.clear()

    def __len__(self) -> int:
        return len(self._leases)


class ReservationSet:
    """Reservations a same-host client fills in shared memory, aborted if it goes away."""

    __slots__ = ("_next_id", "_node", "_pending")

    def __init__(self, node: Node) -> None:
        self._node = node
        self._pending: dict[int, Reservation] = {}
        self._next_id = 1

    def reserve(self, key: BlockKey, nbytes: int, *, parent: BlockKey | None, pin: bool
                ) -> tuple[int, Reservation] | None:
        reservation = self._node.reserve(key, nbytes, parent=parent, pin=pin)
        if reservation is None:
            return None
        rid = self._next_id
        self._next_id += 1
        self._pending[rid] = reservation
        return rid, reservation

    def commit(self, rid: int) -> bool:
        reservation = self._pending.pop(rid, None)
        if reservation is None:
            raise InvalidArgument(f"unknown reservation {rid}")
        return self._node.commit(reservation)

    def abort(self, rid: int) -> None:
        reservation = self._pending.pop(rid, None)
        if reservation is not None:
            self._node.abort(reservation)

    def close(self) -> None:
        for reservation in self._pending.values():
            self._node.abort(reservation)
        self._pending.clear()
