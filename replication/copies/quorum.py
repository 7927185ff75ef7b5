"""Copies to a write quorum: start ``copies - 1`` pushes per group, replace each that fails.

A group is a set of blocks with the same candidate order (owners first, then the
next ranked nodes). Its first ``copies - 1`` candidates are pushed to at once;
each push that fails is replaced by the next unused candidate (a sloppy quorum: a
copy on a lower-ranked node still counts, and repair later moves it to its
owner). Two ways to run them:

* ``run`` (``Replicate``: the master reads blocks it holds): every push runs on ``pool``;
  ``run`` answers when every group has ``write_quorum - 1`` copies or no candidate left.
  Bounded, so that no caller can tie up the node: it waits at most ``wait_s`` and returns
  at once when its ``Cancel`` is set (the node stopping); the targets not started then,
  and the pushes still sending, are reported failed with the reason.
* ``run_lent`` (a replicated put's forwards: the caller lends the bytes and must not
  reuse them before every push it started has settled): every push runs in the caller's
  thread, in two halves. First each push is *started* (its blocks sent, on a stream
  connection, without waiting for the answer), then each is *finished* (its answer
  read), so the targets store at the same time with no hand-off between threads; the
  groups bound for one target go as one push, and replacements go in a next wave. No
  bound but the peer stream's stall timeout, which ends every read and write.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from kvstore.core.errors import KVStoreError

log = logging.getLogger("kvstore.replicator")

Push = Callable[[str], None]  # copies the group's blocks to the node at ADDR; raises on failure
Finish = Callable[[], None]
"""Reads the answer of a started push; raises if it failed. ``run_lent``'s ``start(addr,
items)`` sends the items to the node at ADDR (raises if that fails) and returns one; a
push that cannot be split does all of its work in the start and returns a ``Finish`` with
nothing left to do."""
T = TypeVar("T")


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

    def settled(self, need: int) -> bool:
        return len(self.stored_on) >= need or not (self.running or self.candidates)


def run(pool: ThreadPoolExecutor, groups: Sequence[tuple[Sequence[str], Push]], *,
        copies: int, write_quorum: int, wait_s: float | None = None,
        cancel: Cancel | None = None) -> QuorumResult:
    """Pushes each group to ``copies - 1`` of its candidates; see the module docstring."""
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

    with nullcontext() if cancel is None else cancel.watching(cond, stop_all):
        with cond:
            if stopped():
                stop_all()
            for rnd in rounds:
                for _ in range(min(copies - 1, len(rnd.candidates))):
                    _start(pool, rnd)  # on the pool, so that a bounded wait can leave it
        with cond:
            settled = cond.wait_for(
                lambda: stopped() or all(r.settled(need) for r in rounds),
                timeout=wait_s)
            if not settled or stopped():
                why = STOPPING if stopped() else "timed out"
                for r in rounds:
                    r.failed += [f"{a}: {why}" for a in r.candidates]
                    r.candidates.clear()
                    r.failed += [f"{a}: still sending, {why}" for a in r.inflight]
            return _result(rounds)


def _result(rounds: Sequence[_Round | _LentRound[Any]]) -> QuorumResult:
    """Copies of every group (the caller's included), the targets holding every group, and
    every failure."""
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
    except Exception as exc:
        error = _why(addr, exc)
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


@dataclass(slots=True)
class _LentRound(Generic[T]):
    """One group of ``run_lent``: its blocks, and its candidates not yet tried, in order."""

    candidates: list[str]
    items: Sequence[T]
    want: int
    """Pushes to start in the next wave (a failure in this one adds one)."""
    stored_on: list[str] = field(default_factory=list)
    failed: list[str] = field(default_factory=list)


def run_lent(groups: Sequence[tuple[Sequence[str], Sequence[T]]],
             start: Callable[[str, list[T]], Finish], *, copies: int) -> QuorumResult:
    """Pushes each group's items to ``copies - 1`` of its candidates, every push in this
    thread, and returns once every push started has settled (see the module docstring).

    In waves: each group takes its next candidates, skipping any that failed earlier in
    this call; the items bound for one address travel as one push (``start(addr,
    items)``); every push of the wave is started, then every one finished. A push that
    fails fails every group in it, and each takes its next candidate in the next wave. So
    a dead target costs one failure per wave, at most, however many groups rank it first,
    and is never tried again in this call."""
    if not groups or copies == 1:
        return QuorumResult(copies=1)
    rounds = [_LentRound(list(cands), items, copies - 1) for cands, items in groups]
    dead: set[str] = set()
    while wave := _next_wave(rounds, dead):
        started: list[tuple[str, list[_LentRound[T]], Finish]] = []
        for addr, members in wave.items():
            try:
                started.append((addr, members,
                                start(addr, [it for r in members for it in r.items])))
            except Exception as exc:
                _failed(addr, members, _why(addr, exc), dead)
        for addr, members, finish in started:
            try:
                finish()
            except Exception as exc:
                _failed(addr, members, _why(addr, exc), dead)
            else:
                for r in members:
                    r.stored_on.append(addr)
    return _result(rounds)


def _next_wave(rounds: Sequence[_LentRound[T]], dead: set[str]
               ) -> dict[str, list[_LentRound[T]]]:
    """The groups each address is pushed in the next wave, in the order first named."""
    wave: dict[str, list[_LentRound[T]]] = {}
    for rnd in rounds:
        while rnd.want and rnd.candidates:
            addr = rnd.candidates.pop(0)
            if addr not in dead:
                wave.setdefault(addr, []).append(rnd)
                rnd.want -= 1
        rnd.want = 0  # no candidate left for the rest
    return wave


def _failed(addr: str, members: Sequence[_LentRound[T]], why: str, dead: set[str]) -> None:
    dead.add(addr)
    for r in members:
        r.failed.append(f"{addr}: {why}")
        r.want += 1


def _why(addr: str, exc: Exception) -> str:
    """What a failed push to ``addr`` reports. A bug is logged whole, and reported like any
    failure, so it never strands the waiting caller."""
    if isinstance(exc, KVStoreError):
        return str(exc)
    log.exception("replicating to %s failed", addr, exc_info=exc)
    return f"internal error: {exc}"
