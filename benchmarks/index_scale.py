"""``python -m benchmarks.index_scale``: the tier index at 1, 10 and 50 million blocks.

A ``TierManager`` on a ``MetadataTier`` (the real index, allocator and LRU queue, values
of one byte, no data: only what the index keeps is measured), filled to ``N`` blocks in
chains of 32 (each block's parent the one before, as a prompt's blocks are). Each size
runs in its own process, so its memory figures start from a clean interpreter. Per size:

* memory: the RSS delta per block after the fill (``gc.collect`` first), and the
  allocator's count of live objects per block (``sys.getallocatedblocks``); at sizes up
  to ``--tracemalloc-max`` also the bytes per block ``tracemalloc`` sees (a second build:
  it doubles the time and the memory, so not at the largest sizes);
* rates, per second of wall time and per second of the thread's CPU time (the table
  shows the latter: on a shared machine it is the one that does not depend on the
  load): puts while filling (wall, per tenth of the fill, to show how they change as
  the index grows), then on the full index: lookups (read lease and release of random keys),
  prefix matches (``prefix_length`` of a whole 32-block chain) and puts that each evict
  one block (LRU);
* pauses: a reader thread takes a read lease on a random indexed key about every
  millisecond while the writer fills, under one lock as a node's handlers do, and times
  each from when it fell due (open loop: lock wait, GIL wait, the machine's scheduling
  and garbage collection included); ``gc.callbacks`` times every collection (wall and
  CPU), and the writer times how long each put holds the lock. The index's own pause is
  the longest of those two (``index_pause_ms``): what a get waits for behind the index.
  The reader's figures also hold CPython's scheduling, which each size measures after
  its fill with no index at all (``harness_floor``: a writer holding the lock as long as
  the mean put, in the same loop; the GIL's 5 ms switch interval, and a released lock
  taken again by the writer before the waiting reader runs). The longest hold also
  carries the writer's CPU time in it and the steal time the machine's hypervisor
  reported meanwhile (``/proc/stat``, sampled every ``STEAL_EVERY`` puts: a virtual CPU
  stopped by its host can count as the thread's CPU time).
  Start-up objects are frozen out of the collector (``gc.freeze``) before the fill, as
  ``kvstore serve`` does once it serves.

``--index python`` is the pure-Python index; ``--index native`` the native one (issue
#24) where this tree has it, else the run says it is unavailable and skips it. Sizes whose
estimated peak (``tiers.index_budget`` figure, times 1.3 for the dicts' growth) does not
fit the machine's available memory are skipped and say so. Writes
``results/index_scale.json`` and ``index_scale.png``; ``--quick``: 100k and 300k blocks.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import subprocess
import sys
import threading
import time
import tracemalloc
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from benchmarks.stats import write_json
from kvstore.core.keys import BlockKey
from kvstore.node.fit import available_memory
from tiers.index_budget import INDEX_KINDS, index_bytes
from tiers.index_kind import native_available
from tiers.manager import TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy

SIZES = (1_000_000, 10_000_000, 50_000_000)
QUICK_SIZES = (100_000, 300_000)
CHAIN = 32
OPS = 200_000
QUICK_OPS = 20_000
TRACEMALLOC_MAX = 1_000_000
PEAK_FACTOR = 1.3  # a dict's growth holds the old and the new table at once
READER_PERIOD_S = 0.001
FLOOR_S = 5.0  # the harness floor's run (no index)
WINDOWS = 10
STEAL_EVERY = 1024  # puts between samples of the machine's steal time
RESULTS = Path(__file__).resolve().parent / "results"
TARGETS = {"bytes_per_block": 100, "max_get_pause_ms": 10.0}


class IndexUnavailable(Exception):
    """The index asked for is not built in this tree."""


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def make_manager(kind: str, capacity_blocks: int) -> TierManager:
    """A one-tier LRU index over a metadata tier of ``capacity_blocks`` one-byte blocks."""
    if kind not in INDEX_KINDS:
        raise ValueError(f"--index must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    if kind == "native" and not native_available():
        raise IndexUnavailable("the native tier index is not built "
                               "(python -m cffi_build.block_index_build)")
    # Both the manager's block table and the allocator's live table are the kind's.
    return TierManager(MetadataTier(capacity_blocks, index=kind), make_policy("lru"),
                       watermarks=Watermarks(high=1.0, low=1.0), index=kind)


def rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


# ---- one size, in its own process ----------------------------------------------------------


class _GcTimes:
    """Every collection's duration and generation, from ``gc.callbacks``."""

    def __init__(self) -> None:
        self.pauses: list[tuple[int, float, float]] = []  # generation, wall s, CPU s
        self._t0 = self._c0 = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            self._t0, self._c0 = time.perf_counter(), time.thread_time()
        else:
            self.pauses.append((info["generation"], time.perf_counter() - self._t0,
                                time.thread_time() - self._c0))


class _Leasing(Protocol):
    """What the reader calls: a ``TierManager``, or ``_NoIndex`` for the harness floor."""

    def acquire_read(self, key: BlockKey) -> Any: ...

    def release_read(self, entry: Any) -> Any: ...


class _Reader(threading.Thread):
    """Times a read lease on a random committed key about every ``READER_PERIOD_S``."""

    def __init__(self, manager: _Leasing, lock: threading.Lock, filled: list[int]) -> None:
        super().__init__(daemon=True)
        self._manager, self._lock, self._filled = manager, lock, filled
        self.stop = threading.Event()
        self.samples: list[float] = []

    def run(self) -> None:
        rng = random.Random(1)
        m, lock, samples = self._manager, self._lock, self.samples
        due = time.perf_counter()
        while not self.stop.is_set():
            # Open loop: a get is due every period, and its time counts from when it was
            # due, so a pause (a collection, the lock, the GIL) that starts while the
            # reader sleeps is seen by the get that falls due in it.
            due += READER_PERIOD_S
            delay = due - time.perf_counter()
            if delay > 0 and self.stop.wait(delay):
                break
            n = self._filled[0]
            if n:
                key = key_of(rng.randrange(n))
                with lock:
                    entry = m.acquire_read(key)
                    if entry is not None:
                        m.release_read(entry)
                samples.append(time.perf_counter() - due)
            due = max(due, time.perf_counter() - READER_PERIOD_S)  # one sample per pause


@dataclass(slots=True, kw_only=True)
class _Fill:
    """What the fill saw: the put rate of each tenth, and the longest time one put held
    the lock (what a get waits for at most behind the index, collections in the put
    included, once it is the lock's next holder), with the writer's CPU time in that
    hold: about the hold if it was the index's work, far less if the writer was
    descheduled or waited for the GIL."""

    windows: list[dict[str, float]] = field(default_factory=list)
    max_hold_s: float = 0.0
    max_hold_cpu_s: float = 0.0
    max_hold_steal_ms: float = 0.0  # steal since the last sample before it, to after it
    max_hold_at: int = 0  # which put (0-based): to tell a growth from chance
    steal_ms: float = 0.0  # the whole fill's
    total_hold_s: float = 0.0
    holds_over_10ms: int = 0


def _fill(manager: TierManager, n: int, lock: threading.Lock, filled: list[int]) -> _Fill:
    """Puts ``n`` blocks in chains."""
    out = _Fill()
    step = max(1, n // WINDOWS)
    parent: BlockKey | None = None
    clock, cpu = time.perf_counter, time.thread_time
    t0 = clock()
    steal_start = steal_at = steal_ms()
    for i in range(n):
        key = key_of(i)
        if i % STEAL_EVERY == 0:
            steal_at = steal_ms()
        with lock:
            h0, c0 = clock(), cpu()
            res = manager.reserve(key, 1, parent=parent if i % CHAIN else None)
            assert res is not None
            manager.commit(res)
            hold, hold_cpu = clock() - h0, cpu() - c0
        out.total_hold_s += hold
        if hold > out.max_hold_s:
            out.max_hold_s, out.max_hold_cpu_s = hold, hold_cpu
            out.max_hold_steal_ms = steal_ms() - steal_at
            out.max_hold_at = i
        out.holds_over_10ms += hold > 0.010
        filled[0] = i + 1
        parent = key
        if (i + 1) % step == 0:
            t1 = clock()
            out.windows.append({"blocks": i + 1, "puts_per_s": step / (t1 - t0)})
            t0 = t1
    out.steal_ms = steal_ms() - steal_start
    return out


def steal_ms() -> float:
    """CPU time the hypervisor took from this machine's CPUs, all of them, since boot, in ms
    (``/proc/stat``; 0 where it is not reported)."""
    try:
        with open("/proc/stat") as f:
            fields = f.readline().split()
    except OSError:
        return 0.0
    return int(fields[8]) * 1000 / os.sysconf("SC_CLK_TCK") if len(fields) > 8 else 0.0


def harness_floor(hold_s: float, seconds: float = FLOOR_S) -> dict[str, float]:
    """The reader's figures with no index at all: a writer that holds the same lock for
    ``hold_s`` (the fill's mean put) in the same tight loop. What it measures is CPython's
    own scheduling, which every figure of the reader includes: the GIL's 5 ms switch
    interval, and a lock released and taken again by the writer before the waiting reader
    runs."""
    lock = threading.Lock()
    reader = _Reader(_NoIndex(), lock, [1])
    reader.start()
    clock = time.perf_counter
    end = clock() + seconds
    while clock() < end:
        with lock:
            until = clock() + hold_s
            while clock() < until:
                pass
    reader.stop.set()
    reader.join()
    samples = sorted(reader.samples)
    return {"floor_max_get_ms": _pct(samples, 1.0) * 1e3,
            "floor_p99_get_ms": _pct(samples, 0.99) * 1e3,
            "floor_p999_get_ms": _pct(samples, 0.999) * 1e3}


class _NoIndex:
    """Stands for the manager in ``harness_floor``: every get misses at once."""

    def acquire_read(self, key: BlockKey) -> None:
        return None

    def release_read(self, entry: object) -> None:
        raise AssertionError("nothing is leased")


def _pct(sorted_s: list[float], q: float) -> float:
    return sorted_s[min(len(sorted_s) - 1, int(q * len(sorted_s)))] if sorted_s else 0.0


class _Clock:
    """Wall and this thread's CPU time since it was made: on a shared machine the CPU
    time is the figure that does not depend on what else runs."""

    def __init__(self) -> None:
        self.t0, self.c0 = time.perf_counter(), time.thread_time()

    def rates(self, name: str, count: float) -> dict[str, float]:
        wall, cpu = time.perf_counter() - self.t0, time.thread_time() - self.c0
        return {f"{name}_per_s": count / wall, f"{name}_per_cpu_s": count / max(cpu, 1e-9)}


def _rates(manager: TierManager, n: int, ops: int) -> dict[str, float]:
    """Lookups, prefix matches and evicting puts per second (wall and CPU) on the full
    index."""
    rng = random.Random(2)
    keys = [key_of(rng.randrange(n)) for _ in range(ops)]
    out: dict[str, float] = {}
    clock = _Clock()
    for k in keys:
        e = manager.acquire_read(k)
        assert e is not None
        manager.release_read(e)
    out |= clock.rates("lookups", ops)
    chains = [[key_of(c * CHAIN + j) for j in range(CHAIN)]
              for c in (rng.randrange(n // CHAIN) for _ in range(max(1, ops // CHAIN)))]
    clock = _Clock()
    for chain in chains:
        manager.prefix_length(chain)
    out |= clock.rates("prefix_matches", len(chains))
    new = [key_of(n + i) for i in range(ops)]
    clock = _Clock()
    for k in new:
        res = manager.reserve(k, 1)
        assert res is not None
        manager.commit(res)
    out |= clock.rates("evicting_puts", ops)
    assert len(manager) == n
    return out


def measure(kind: str, n: int, *, ops: int, tracemalloc_max: int) -> dict[str, Any]:
    """Every figure for one size (run in a fresh process: ``--child``)."""
    gc.collect()
    rss0, objs0 = rss_bytes(), sys.getallocatedblocks()
    manager = make_manager(kind, n)
    # As ``kvstore serve`` does once started: what start-up built is never garbage, so
    # a full collection does not walk it again.
    gc.freeze()
    lock = threading.Lock()
    filled = [0]
    gc_times = _GcTimes()
    gc.callbacks.append(gc_times)
    reader = _Reader(manager, lock, filled)
    reader.start()
    t0, c0 = time.perf_counter(), time.thread_time()
    try:
        fill = _fill(manager, n, lock, filled)
    finally:
        fill_cpu_s = time.thread_time() - c0
        reader.stop.set()
        reader.join()
        gc.callbacks.remove(gc_times)
    fill_s = time.perf_counter() - t0
    gc.collect()
    rss = rss_bytes() - rss0
    objs = sys.getallocatedblocks() - objs0
    samples = sorted(reader.samples)
    out: dict[str, Any] = {
        "index": kind, "blocks": n, "chain": CHAIN, "fill_s": fill_s,
        "rss_bytes_per_block": rss / n, "objects_per_block": objs / n,
        "puts_per_s": n / fill_s, "puts_per_cpu_s": n / fill_cpu_s,
        "put_windows": fill.windows, "max_put_hold_ms": fill.max_hold_s * 1e3,
        "max_put_hold_cpu_ms": fill.max_hold_cpu_s * 1e3,
        "max_put_hold_steal_ms": fill.max_hold_steal_ms, "fill_steal_ms": fill.steal_ms,
        "max_put_hold_at": fill.max_hold_at,
        "put_holds_over_10ms": fill.holds_over_10ms,
        "gets_timed": len(samples), "max_get_pause_ms": _pct(samples, 1.0) * 1e3,
        "p99_get_ms": _pct(samples, 0.99) * 1e3, "p999_get_ms": _pct(samples, 0.999) * 1e3,
        "gets_over_10ms": sum(1 for s in samples if s > 0.010),
        "gc_collections": {str(g): sum(1 for gg, _, _ in gc_times.pauses if gg == g)
                           for g in (0, 1, 2)},
        "max_gc_pause_ms": max((d for _, d, _ in gc_times.pauses), default=0.0) * 1e3,
        "max_gc_pause_cpu_ms": max((c for _, _, c in gc_times.pauses), default=0.0) * 1e3,
        "gc_total_s": sum(d for _, d, _ in gc_times.pauses),
        "gc_total_cpu_s": sum(c for _, _, c in gc_times.pauses),
        "budget_bytes_per_block": index_bytes(n, kind=kind) / n,
    }
    # The longest a get waits for the index itself: one put's hold of the lock (its
    # collections included), or a collection in the reader's own get.
    out["index_pause_ms"] = max(out["max_put_hold_ms"], out["max_gc_pause_ms"])
    out |= harness_floor(fill.total_hold_s / n)
    out.update(_rates(manager, n, ops))
    del manager, reader
    gc.collect()
    if n <= tracemalloc_max:
        tracemalloc.start()
        try:
            base = tracemalloc.get_traced_memory()[0]
            manager = make_manager(kind, n)
            _fill(manager, n, threading.Lock(), [0])
            gc.collect()
            out["tracemalloc_bytes_per_block"] = (tracemalloc.get_traced_memory()[0] - base) / n
        finally:
            tracemalloc.stop()
    return out


# ---- the run: one process per size -----------------------------------------------------------


def estimated_peak(kind: str, n: int) -> int:
    return int(index_bytes(n, kind=kind) * PEAK_FACTOR) + (256 << 20)


def run_size(kind: str, n: int, *, ops: int, tracemalloc_max: int) -> dict[str, Any]:
    """One size in a child process, or a skip record saying why not."""
    try:
        make_manager(kind, 1)
    except IndexUnavailable as exc:
        return {"index": kind, "blocks": n, "skipped": str(exc)}
    need, avail = estimated_peak(kind, n), available_memory()
    if avail is not None and need > avail:
        return {"index": kind, "blocks": n, "skipped": (
            f"needs about {need / 2**30:.1f} GiB (the {kind} index's budget x {PEAK_FACTOR}), "
            f"the machine has {avail / 2**30:.1f} GiB available")}
    cmd = [sys.executable, "-m", "benchmarks.index_scale", "--child", str(n), "--index", kind,
           "--ops", str(ops), "--tracemalloc-max", str(tracemalloc_max)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        return {"index": kind, "blocks": n,
                "skipped": f"the run failed (exit {proc.returncode}): {proc.stderr[-500:]}"}
    result: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return result


def format_table(runs: Sequence[dict[str, Any]]) -> str:
    head = (f"{'index':<7} {'blocks':>11} {'RSS B/blk':>9} {'objs/blk':>8} {'tm B/blk':>8} "
            f"{'put/s':>9} {'lookup/s':>9} {'prefix/s':>9} {'evict/s':>9} "
            f"{'max get ms':>10} {'p99.9 ms':>8} {'max gc ms':>9} {'gc cpu ms':>9} "
            f"{'hold/cpu/steal ms':>17} {'index pause':>11} {'floor max':>9}")
    lines = [head, "-" * len(head)]
    for r in runs:
        if "skipped" in r:
            lines.append(f"{r['index']:<7} {r['blocks']:>11,} skipped: {r['skipped']}")
            continue
        tm = r.get("tracemalloc_bytes_per_block")
        hold = (f"{r['max_put_hold_ms']:.1f}/{r['max_put_hold_cpu_ms']:.1f}/"
                f"{r.get('max_put_hold_steal_ms', 0.0):.0f}")
        lines.append(
            f"{r['index']:<7} {r['blocks']:>11,} {r['rss_bytes_per_block']:>9.0f} "
            f"{r['objects_per_block']:>8.2f} {'-' if tm is None else f'{tm:.0f}':>8} "
            f"{r['puts_per_cpu_s']:>9,.0f} {r['lookups_per_cpu_s']:>9,.0f} "
            f"{r['prefix_matches_per_cpu_s']:>9,.0f} {r['evicting_puts_per_cpu_s']:>9,.0f} "
            f"{r['max_get_pause_ms']:>10.1f} {r['p999_get_ms']:>8.2f} "
            f"{r['max_gc_pause_ms']:>9.1f} {r['max_gc_pause_cpu_ms']:>9.1f} "
            f"{hold:>17} {r['index_pause_ms']:>11.1f} "
            f"{r['floor_max_get_ms']:>9.1f}")
    return "\n".join(lines)


def ratios(runs: Sequence[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Per index: each rate at its largest measured size over the smallest (1.0 is flat)."""
    out: dict[str, dict[str, float]] = {}
    for kind in INDEX_KINDS:
        done = sorted((r for r in runs if r["index"] == kind and "skipped" not in r),
                      key=lambda r: r["blocks"])
        if len(done) < 2:
            continue
        lo, hi = done[0], done[-1]
        out[kind] = {"from_blocks": lo["blocks"], "to_blocks": hi["blocks"]} | {
            k: hi[k] / lo[k] for k in ("puts_per_cpu_s", "lookups_per_cpu_s",
                                       "prefix_matches_per_cpu_s", "evicting_puts_per_cpu_s",
                                       "rss_bytes_per_block", "max_gc_pause_cpu_ms")}
    return out


def plot(path: Path, runs: Sequence[dict[str, Any]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    for kind in INDEX_KINDS:
        done = [r for r in runs if r["index"] == kind and "skipped" not in r]
        if not done:
            continue
        xs = [r["blocks"] for r in done]
        axes[0].plot(xs, [r["rss_bytes_per_block"] for r in done], "o-", label=f"{kind} RSS")
        for name in ("lookups_per_cpu_s", "prefix_matches_per_cpu_s",
                     "evicting_puts_per_cpu_s", "puts_per_cpu_s"):
            axes[1].plot(xs, [r[name] for r in done], "o-", label=f"{kind} {name}")
        axes[2].plot(xs, [r["max_get_pause_ms"] for r in done], "o-", label=f"{kind} max get")
        axes[2].plot(xs, [r["max_gc_pause_ms"] for r in done], "x--", label=f"{kind} max gc")
        axes[2].plot(xs, [r["index_pause_ms"] for r in done], "s-", label=f"{kind} index pause")
        axes[2].plot(xs, [r["max_gc_pause_cpu_ms"] for r in done], "+:",
                     label=f"{kind} max gc (CPU)")
    axes[0].axhline(TARGETS["bytes_per_block"], color="grey", ls=":", label="target")
    axes[2].axhline(TARGETS["max_get_pause_ms"], color="grey", ls=":", label="target")
    titles = ("bytes per block", "operations per CPU second", "longest pause (ms)")
    for ax, title in zip(axes, titles, strict=True):
        ax.set_xscale("log")
        ax.set_xlabel("blocks indexed")
        ax.set_title(title)
        ax.legend(fontsize=7)
    axes[1].set_yscale("log")
    axes[2].set_yscale("log")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.index_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--index", default="python", choices=(*INDEX_KINDS, "both"),
                   help="which tier index (default python; both: each, side by side)")
    p.add_argument("--sizes", type=lambda t: [int(float(x)) for x in t.split(",")],
                   help="block counts, e.g. 1e6,1e7 (default 1e6,1e7,5e7)")
    p.add_argument("--ops", type=int, help=f"operations per rate (default {OPS:,})")
    p.add_argument("--tracemalloc-max", type=int, default=TRACEMALLOC_MAX,
                   help="largest size also built under tracemalloc (default 1,000,000)")
    p.add_argument("--quick", action="store_true", help="100k and 300k blocks, fewer ops")
    p.add_argument("--out", type=Path, default=RESULTS / "index_scale.json")
    p.add_argument("--child", type=int, help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    ops = args.ops or (QUICK_OPS if args.quick else OPS)
    if args.child is not None:
        print(json.dumps(measure(args.index, args.child, ops=ops,
                                 tracemalloc_max=args.tracemalloc_max)))
        return 0
    sizes = args.sizes or (QUICK_SIZES if args.quick else SIZES)
    if any(n < CHAIN * 2 for n in sizes):
        p.error(f"sizes must be at least {CHAIN * 2} blocks")
    kinds = INDEX_KINDS if args.index == "both" else (args.index,)
    runs = []
    for n in sizes:
        for kind in kinds:
            print(f"{kind} index, {n:,} blocks ...", flush=True)
            runs.append(run_size(kind, n, ops=min(ops, n), tracemalloc_max=args.tracemalloc_max))
            print(format_table(runs[-1:]).splitlines()[-1], flush=True)
    print()
    print(format_table(runs))
    scaled = ratios(runs)
    result = {"runs": runs, "ratios": scaled, "targets": TARGETS,
              "command": "python -m benchmarks.index_scale " + " ".join(argv or sys.argv[1:])}
    for kind, r in scaled.items():
        print(f"{kind}: {r['from_blocks']:,} -> {r['to_blocks']:,} blocks: " + ", ".join(
            f"{k} x{v:.2f}" for k, v in r.items() if k not in ("from_blocks", "to_blocks")))
    write_json(args.out, result)
    plot(args.out.with_suffix(".png"), runs)
    print(f"wrote {args.out} and {args.out.with_suffix('.png')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
