"""The soak run's books and verdicts (``benchmarks/soak.py``), exact so tests can pin them.

**Blocks.** Every block the soak writes is named by its traffic class and a counter, and
its bytes follow from ``(seed, class, id, size)`` (``value_of``): the ledger keeps only
ids, sizes and states, and any read can be checked byte for byte. A block is

* ``LIVE`` once a put returned (acknowledged: ``write_quorum`` copies exist);
* ``MAYBE`` when a put raised (some copies may exist) or a remove raised;
* ``GONE`` once a remove returned.

The final check (``check``) reads every block the ledger ever named: a ``LIVE`` block
that is missing is **lost**; any block read with other bytes than its own is a **wrong
byte**, whatever its state (a removed block may come back from a copy, but never with
another block's bytes). This is exact only if nothing was evicted: the soak sizes its
data below every node's capacity (each node could hold a copy of every block and stay
under its low watermark) and reports the nodes' eviction counters beside.

**Memory.** RSS samples ``(t, pid, MiB)`` per node; a restart is a new pid, whose memory
starts low and warms up again. ``pooled_slope`` is the least-squares slope of RSS over
time with one intercept per pid (the growth within each process's life), in MiB per
minute. ``memory_verdict`` takes the samples of the run's second half that are at least
``warmup_s`` into their process's life, of processes that then live on for at least
``min_span_s``, and calls a node flat when that slope is at most ``max_slope``; with
fewer than ``MIN_SAMPLES`` such samples it is unknown (None).
"""

from __future__ import annotations

import enum
import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

MIN_SAMPLES = 10
"""Samples a node needs in the judged window for its slope to count."""


def value_of(seed: int, cls: str, i: int, size: int) -> bytes:
    """Block ``i`` of class ``cls``: ``size`` bytes, different for every (seed, cls, i)."""
    return random.Random(f"kvstore-soak/{seed}/{cls}/{i}").randbytes(size)


def key_of(tag: int, i: int) -> bytes:
    """The 16-byte key of block ``i`` of the class tagged ``tag`` (0..255)."""
    return bytes([0x50, tag]) + i.to_bytes(14, "big")


class State(enum.Enum):
    LIVE = "live"
    MAYBE = "maybe"
    GONE = "gone"


class _Bag:
    """A set with O(1) add, discard and uniform random choice."""

    __slots__ = ("_items", "_pos")

    def __init__(self) -> None:
        self._items: list[int] = []
        self._pos: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._items)

    def add(self, x: int) -> None:
        if x not in self._pos:
            self._pos[x] = len(self._items)
            self._items.append(x)

    def discard(self, x: int) -> None:
        i = self._pos.pop(x, None)
        if i is None:
            return
        last = self._items.pop()
        if last != x:
            self._items[i] = last
            self._pos[last] = i

    def choice(self, rng: random.Random) -> int:
        return self._items[rng.randrange(len(self._items))]

    def items(self) -> list[int]:
        return list(self._items)


@dataclass(slots=True, kw_only=True)
class Ledger:
    """One traffic class's blocks: ids, sizes, states. One thread writes it (the class's
    worker); others read ``live_ids`` (a copy) between its steps."""

    cls: str
    tag: int
    seed: int
    sizes: dict[int, int] = field(default_factory=dict)
    state: dict[int, State] = field(default_factory=dict)
    held_bytes: int = 0  # LIVE + MAYBE: what the nodes may hold of this class
    _live: _Bag = field(default_factory=_Bag)
    _maybe: _Bag = field(default_factory=_Bag)

    def key(self, i: int) -> bytes:
        return key_of(self.tag, i)

    def value(self, i: int) -> bytes:
        return value_of(self.seed, self.cls, i, self.sizes[i])

    def new(self, size: int) -> int:
        """A fresh block id of ``size`` bytes, counted as held from now (MAYBE) until its
        put's outcome is known."""
        i = len(self.sizes)
        self.sizes[i] = size
        self._set(i, State.MAYBE)
        return i

    def _set(self, i: int, st: State) -> None:
        old = self.state.get(i)
        held_before = old in (State.LIVE, State.MAYBE)
        held_after = st in (State.LIVE, State.MAYBE)
        self.held_bytes += self.sizes[i] * (held_after - held_before)
        self.state[i] = st
        (self._live.add if st is State.LIVE else self._live.discard)(i)
        (self._maybe.add if st is State.MAYBE else self._maybe.discard)(i)

    def acked(self, i: int) -> None:
        self._set(i, State.LIVE)

    def refused(self, i: int) -> None:
        """A put or a remove that raised: the block may or may not be held."""
        self._set(i, State.MAYBE)

    def removed(self, i: int) -> None:
        self._set(i, State.GONE)

    def pick_live(self, rng: random.Random) -> int | None:
        return self._live.choice(rng) if len(self._live) else None

    def pick_held(self, rng: random.Random) -> int | None:
        """A LIVE or MAYBE block, uniformly (what a remove may take back)."""
        n_live, n_maybe = len(self._live), len(self._maybe)
        if not n_live + n_maybe:
            return None
        if rng.randrange(n_live + n_maybe) < n_live:
            return self._live.choice(rng)
        return self._maybe.choice(rng)

    def live_ids(self) -> list[int]:
        return self._live.items()

    def counts(self) -> dict[str, int]:
        out = {s.value: 0 for s in State}
        for st in self.state.values():
            out[st.value] += 1
        return out


@dataclass(slots=True, kw_only=True)
class CheckResult:
    """The final check of one ledger (ids in ascending order)."""

    live: int = 0
    lost: list[int] = field(default_factory=list)
    wrong: list[int] = field(default_factory=list)
    maybe_found: int = 0
    gone_found: int = 0
    read_errors: int = 0

    def summary(self, ledger: Ledger, shown: int = 20) -> dict[str, Any]:
        return {"live": self.live, "lost": len(self.lost), "wrong_bytes": len(self.wrong),
                "maybe_found": self.maybe_found, "gone_found": self.gone_found,
                "lost_keys": [ledger.key(i).hex() for i in self.lost[:shown]],
                "wrong_keys": [ledger.key(i).hex() for i in self.wrong[:shown]],
                "states": ledger.counts()}


def check(ledger: Ledger, read: Callable[[list[bytes]], Sequence[bytes | None]], *,
          batch_bytes: int = 4 << 20) -> CheckResult:
    """Reads every block the ledger named, through ``read`` (keys -> values or None, in
    order), in batches of about ``batch_bytes``; see the module docstring."""
    out = CheckResult()
    for ids in _batches(sorted(ledger.state), ledger.sizes, batch_bytes):
        got = read([ledger.key(i) for i in ids])
        for i, value in zip(ids, got, strict=True):
            st = ledger.state[i]
            if value is None:
                if st is State.LIVE:
                    out.lost.append(i)
            elif value != ledger.value(i):
                out.wrong.append(i)
            elif st is State.MAYBE:
                out.maybe_found += 1
            elif st is State.GONE:
                out.gone_found += 1
        out.live += sum(ledger.state[i] is State.LIVE for i in ids)
    return out


def _batches(ids: Sequence[int], sizes: dict[int, int], limit: int) -> Iterable[list[int]]:
    batch: list[int] = []
    total = 0
    for i in ids:
        if batch and (total + sizes[i] > limit or len(batch) >= 1024):
            yield batch
            batch, total = [], 0
        batch.append(i)
        total += sizes[i]
    if batch:
        yield batch


# ---- memory -------------------------------------------------------------------------------


Sample = tuple[float, int, float]  # (seconds since the start, pid, RSS in MiB)


def pooled_slope(samples: Iterable[Sample]) -> float | None:
    """Least-squares slope of RSS over time, one intercept per pid, in MiB per minute;
    None without two samples at distinct times in one pid."""
    groups: dict[int, list[tuple[float, float]]] = {}
    for t, pid, mib in samples:
        groups.setdefault(pid, []).append((t, mib))
    sxx = sxy = 0.0
    for pts in groups.values():
        if len(pts) < 2:
            continue
        mt = sum(t for t, _ in pts) / len(pts)
        my = sum(y for _, y in pts) / len(pts)
        sxx += sum((t - mt) ** 2 for t, _ in pts)
        sxy += sum((t - mt) * (y - my) for t, y in pts)
    return None if sxx <= 0 else sxy / sxx * 60.0


def judged(samples: Iterable[Sample], *, run_s: float, started: dict[int, float],
           warmup_s: float, min_span_s: float = 0.0) -> list[Sample]:
    """The samples the verdict looks at: in the run's second half, at least ``warmup_s``
    after their process started (``started``: pid -> seconds; a pid not in it started
    with the run), of processes whose samples so chosen span at least ``min_span_s``
    (a trend needs time: a process killed soon after its warm-up shows none)."""
    window = [s for s in samples
              if s[0] >= run_s / 2 and s[0] >= started.get(s[1], 0.0) + warmup_s]
    span: dict[int, tuple[float, float]] = {}
    for t, pid, _ in window:
        lo, hi = span.get(pid, (t, t))
        span[pid] = (min(lo, t), max(hi, t))
    return [s for s in window if span[s[1]][1] - span[s[1]][0] >= min_span_s]


def memory_verdict(by_node: dict[str, list[Sample]], *, run_s: float,
                   started: dict[int, float], warmup_s: float, max_slope: float,
                   min_span_s: float = 0.0) -> dict[str, dict[str, Any]]:
    """Per node: the judged samples' count (``judged``), their pooled slope (MiB/min) and
    whether it is flat (slope <= ``max_slope``); slope and flat are None with fewer than
    ``MIN_SAMPLES`` judged samples."""
    out: dict[str, dict[str, Any]] = {}
    for node, samples in by_node.items():
        window = judged(samples, run_s=run_s, started=started, warmup_s=warmup_s,
                        min_span_s=min_span_s)
        slope = pooled_slope(window) if len(window) >= MIN_SAMPLES else None
        out[node] = {"judged_samples": len(window), "slope_mib_per_min": slope,
                     "flat": None if slope is None else slope <= max_slope}
    return out


# ---- shared-memory regions ------------------------------------------------------------------


def stale_regions(mapped: dict[int, set[int]]) -> int:
    """How many shared-memory regions live node processes map that no live node owns.

    ``mapped``: pid of every live node -> the inodes of the kvstore DRAM regions (memfds)
    it maps. Every node maps its own region and may map its peers' (same-host copies), so
    the union holds the live nodes' regions, one each, plus regions of nodes that died: a
    dead node's memory, kept allocated by the mapping. Whose region is whose cannot be
    read from outside (a memfd's times change as it is written), so this is a count."""
    union: set[int] = set()
    for regions in mapped.values():
        union |= regions
    return len(union) - len(mapped)
