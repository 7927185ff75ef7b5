"""Copies to a write quorum: start ``copies - 1`` pushes per group, replace each that fails.

A group is a set of blocks with the same candidate order (owners first, then the
next ranked nodes). Its first ``copies - 1`` candidates are pushed to at once;
each push that fails is replaced by the next unused candidate (a sloppy quorum: a
copy on a lower-ranked node still counts, and repair later moves it to its
owner). The first push runs in the caller's thread, the others on ``pool``. ``run``
answers when every group has ``write_quorum - 1`` copies or no
candidate left, or, with ``wait_all``, only once every push it started has
settled (the caller lends the bytes and must not reuse them before).

Bounds, so that no caller can tie up the node: without ``wait_all``, ``run`` waits
at most ``wait_s`` and returns at once when its ``Cancel`` is set (the node
stopping); the targets not started then, and the pushes still sending, are
reported failed with the reason. With ``wait_all`` neither applies: the bytes are
lent, so it waits for every push, each of which ends within the peer stream's
stall timeout.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

from kvstore.core.errors import KVStoreError

log = logging.getLogger("kvstore.replicator")

Push = Callable[[str], None]  # copies the group's blocks to the node at ADDR; raises on failure


@dataclass(slots=True, kw_only=True)
class QuorumResult:
    copies: int  # copies holding every block of every group, the caller's included
    stored_on: list[str] = field(default_factory=list)  # nodes holding every group
    failed: list[str] = field(default_factory=list)  # "ADDR: reason"


class Cancel:
    """Set once (the node stopping): every ``run`` waiting under it returns at once, and
    its pushes that fail from then on say why (the node closes their connections next)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._set = False  # guarded by _lock
        # cond -> what to do under cond when set; guarded by _lock
        self._waiting: dict[threading.Condition, Callable[[], None]] = {}

    @property
    def is_set(self) -> bool:
        with self._lock:
            return self._set

    def set(self) -> None:
        with self._lock:
            self._set = True
            waiting = list(self._waiting.items())
        for cond, on_set in waiting:  # never with _lock held: a waiter holds cond, then _lock
            with cond:
                on_set()
                cond.notify_all()

    @contextmanager
    def watching(self, cond: threading.Condition, on_set: Callable[[], None]
                 ) -> Iterator[None]:
        """Runs ``on_set`` under ``cond`` when set; the caller must not hold ``cond`` here."""
        with self._lock:
            self._waiting[cond] = on_set
        try:
            yield
        finally:
            with self._lock:
                self._waiting.pop(cond, None)


STOPPING = "node is stopping"


class _Round:
    """One group; fields guarded by the shared ``cond``."""

    __slots__ = ("candidates", "cond", "failed", "inflight", "push", "running", "stopping",
                 "stored_on")

    def __init__(self, cond: threading.Condition, candidates: list[str], push: Push) -> None:
        self.cond = cond
        self.candidates = candidates  # not yet started, in order
        self.push = push
        self.running = 0
        self.inflight: list[str] = []  # addresses of the pushes running
        self.stopping = False  # the node is stopping: no replacements, failures say so
        self.stored_on: list[str] = []
        self.failed: list[str] = []

    def settled(self, need: int, wait_all: bool) -> bool:
        if self.running and wait_all:
            return False
        return len(self.stored_on) >= need or not (self.running or self.candidates)


def run(pool: ThreadPoolExecutor, groups: Sequence[tuple[Sequence[str], Push]], *,
        copies: int, write_quorum: int, wait_all: bool = False, wait_s: float | None = None,
        cancel: Cancel | None = None) -> QuorumResult:
    """Pushes each group to ``copies - 1`` of its candidates; see the module docstring."""
    if wait_all and (wait_s is not None or cancel is not None):
        raise ValueError("wait_all lends the bytes until every push settles: no wait_s or "
                         "cancel with it")
    if not groups or copies == 1:
        return QuorumResult(copies=1)
    cond = threading.Condition()
    rounds = [_Round(cond, list(cands), push) for cands, push in groups]
    need = write_quorum - 1

    def stop_all() -> None:  # under cond
        for r in rounds:
            r.stopping = True

    def stopped() -> bool:
        return cancel is not None and cancel.is_set

    first: tuple[_Round, str] | None = None
    with nullcontext() if cancel is None else cancel.watching(cond, stop_all):
        with cond:
            if stopped():
                stop_all()
            for rnd in rounds:
                for _ in range(min(copies - 1, len(rnd.candidates))):
                    # With wait_all the caller only waits for every push: run one here, not
                    # on the pool. A bounded wait keeps every push on the pool (wakeable).
                    if first is None and wait_all:
                        first = (rnd, rnd.candidates.pop(0))
                        rnd.running += 1
                        rnd.inflight.append(first[1])
                    else:
                        _start(pool, rnd)
        if first is not None:  # ends within the peer stream's stall timeout
            _push(pool, *first)
        with cond:
            settled = cond.wait_for(
                lambda: stopped() or all(r.settled(need, wait_all) for r in rounds),
                timeout=wait_s)
            if not settled or stopped():
                why = STOPPING if stopped() else "timed out"
                for r in rounds:
                    r.failed += [f"{a}: {why}" for a in r.candidates]
                    r.candidates.clear()
                    r.failed += [f"{a}: still sending, {why}" for a in r.inflight]
            stored = set.intersection(*(set(r.stored_on) for r in rounds))
            return QuorumResult(copies=1 + min(len(r.stored_on) for r in rounds),
                                stored_on=[t for t in rounds[0].stored_on if t in stored],
                                failed=[f for r in rounds for f in r.failed])


def _start(pool: ThreadPoolExecutor, rnd: _Round) -> None:
    """Starts a push to the next candidate; caller holds ``rnd.cond``."""
    addr = rnd.candidates.pop(0)
    try:
        pool.submit(_push, pool, rnd, addr)
    except RuntimeError:  # shut down: the node is stopping
        rnd.failed.append(f"{addr}: node is stopping")
        return
    rnd.running += 1
    rnd.inflight.append(addr)


def _push(pool: ThreadPoolExecutor, rnd: _Round, addr: str) -> None:
    error = ""
    try:
        rnd.push(addr)
    except KVStoreError as exc:
        error = str(exc)
    except Exception as exc:  # a bug must not strand the waiting writer
        log.exception("replicating to %s failed", addr)
        error = f"internal error: {exc}"
    with rnd.cond:
        rnd.running -= 1
        rnd.inflight.remove(addr)
        if error:
            rnd.failed.append(f"{addr}: {error}" + (f" ({STOPPING})" if rnd.stopping else ""))
            if rnd.candidates and not rnd.stopping:
                _start(pool, rnd)
        else:
            rnd.stored_on.append(addr)
        rnd.cond.notify_all()
