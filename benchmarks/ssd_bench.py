"""SSD tier throughput against the raw O_DIRECT limit of the same file.

For each block size it measures, in one run and on one file:

* tier sequential ``write_blocks`` (batched, durable: data fdatasync + synced index
  batch per call) and ``read_blocks_into`` (checksum verified);
* the raw limit: aligned ``O_DIRECT`` ``pwrite`` (one fdatasync at the end) and
  ``preadv`` over the same offsets at several queue depths (``--raw-qds``, default
  1, 4, 32): a plain loop at QD1, threads at higher QDs, and, when the native
  module ``tiers._uring`` is available, io_uring batches at each QD > 1 (the
  tier's own helper, with no checksum or index work), all reading into as many
  buffers as one tier read call fills (see ``benchmarks.ssd_raw``: on this disk a
  single reused buffer reads up to 1.9x faster, which no reader returning distinct
  blocks can do; that one-buffer loop is printed as a reference). The best variant
  is taken as the physical limit; every variant is printed and saved;

and then 64 KiB random reads at queue depth 32, against 32 threads issuing raw
``preadv`` back to back and (if available) raw io_uring at QD32 (the better raw
figure is the limit), with the tier read three ways, 32 blocks in flight each:

* ``batch``: one caller, ``read_blocks_into`` of 32 random blocks per call (the
  queue drains at the end of every call);
* ``callers4x8``: 4 threads, each calling ``read_blocks_into`` with 8 blocks;
* ``node``: 32 threads, each reading one block per call into its own buffer, which
  is how a node reads a block for a client (``leased_block_view``);
* ``async``: one caller through ``submit_reads`` (32 blocks per handle, two handles
  outstanding, collecting one while the other runs): the queue stays full across
  batches. A different access pattern from ``batch``: what a caller with more than
  32 blocks to read can do, not a faster way to wait for each batch.

A raw reference that drains the same way as ``batch`` (io_uring, 32 reads per
batch, waiting for each batch: ``uring_qd32_batch32``) is measured too and
reported beside the limit, never taken as it: ``batch`` over it is the tier's own
overhead, the rest of ``batch``'s gap is the drain.

Every case runs ``--rounds`` times (default 3), tier and raw alternating inside each
round, so a slow spell of the shared disk hits both; figures are medians over rounds
(each raw variant's too), the raw limit is the variant with the best median, and
each ratio is the tier's median over that limit's median (per-round ratios saved).

Latencies: the tier's are per call (one batch); the raw ones are per request.

    python -m benchmarks.ssd_bench --path /var/tmp/kvstore-ssd-bench.img

Put the file on a real disk, not tmpfs. The file and its ``.index`` directory are
overwritten. Prints a table and writes ``benchmarks/results/ssd_bench.json``.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import random
import shutil
import stat
import statistics
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.ssd_raw import (
    RAW_QDS,
    aligned,
    pct_ms,
    raw_random_threads,
    raw_sequential,
    raw_uring,
    run_workers,
    uring_lib,
)
from kvstore.core.keys import BlockKey
from tiers.ssd.tier import ALIGNMENT, SsdLocation, SsdTier

RESULTS = Path(__file__).resolve().parent / "results" / "ssd_bench.json"
KiB, MiB, GB = 1 << 10, 1 << 20, 1e9
RANDOM_BLOCK = 64 * KiB
RANDOM_QD = 32
ROUNDS = 3
# Random-read tier cases: (name, concurrent callers); 32 blocks in flight in total.
RANDOM_CALLERS = (("batch", 1), ("callers4x8", 4), ("node", RANDOM_QD), ("async", 0))
# Handles the async case keeps outstanding (each RANDOM_QD blocks).
ASYNC_OUTSTANDING = 2


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def _prepare(path: Path) -> None:
    if path.exists() and not stat.S_ISREG(path.stat().st_mode):
        raise SystemExit(f"{path} is not a regular file; this benchmark overwrites its path")
    path.unlink(missing_ok=True)
    shutil.rmtree(str(path) + ".index", ignore_errors=True)


def _tier_sequential(tier: SsdTier, size: int, n: int, batch: int,
                     src: mmap.mmap) -> dict[str, float]:
    view = memoryview(src)
    locs: list[SsdLocation] = []
    wlat: list[float] = []
    t_start = time.perf_counter()
    for start in range(0, n, batch):
        items = [(_key(i), None, view) for i in range(start, min(n, start + batch))]
        t0 = time.perf_counter()
        got = tier.write_blocks(items)
        wlat.append(time.perf_counter() - t0)
        if any(loc is None for loc in got):
            raise RuntimeError("tier full during the benchmark: raise capacity")
        locs.extend(loc for loc in got if loc is not None)
    t_write = time.perf_counter() - t_start

    outs = [aligned(size, fill=False) for _ in range(batch)]
    out_views = [memoryview(o) for o in outs]
    rlat: list[float] = []
    t_start = time.perf_counter()
    for start in range(0, n, batch):
        chunk = locs[start:start + batch]
        t0 = time.perf_counter()
        ok = tier.read_blocks_into(chunk, out_views[: len(chunk)])
        rlat.append(time.perf_counter() - t0)
        if not all(ok):
            raise RuntimeError("checksum failure during the benchmark")
    t_read = time.perf_counter() - t_start
    if bytes(out_views[0]) != bytes(view):
        raise RuntimeError("tier read back different bytes")
    for v in out_views:
        v.release()
    tier.delete([(_key(i), loc) for i, loc in enumerate(locs)])
    view.release()
    total = n * size
    return {
        "tier_write_gbps": total / t_write / GB,
        "tier_read_gbps": total / t_read / GB,
        "tier_write_call_ms_p50": pct_ms(wlat, 0.5),
        "tier_write_call_ms_p99": pct_ms(wlat, 0.99),
        "tier_read_call_ms_p50": pct_ms(rlat, 0.5),
        "tier_read_call_ms_p99": pct_ms(rlat, 0.99),
    }


def _tier_random(tier: SsdTier, locs: Sequence[SsdLocation], picks: Sequence[int],
                 callers: int) -> tuple[float, list[float]]:
    """GB/s of ``callers`` threads reading the picked blocks, RANDOM_QD // callers per
    ``read_blocks_into`` call (RANDOM_QD in flight in all), and per-call latencies."""
    per_call = RANDOM_QD // callers
    lat: list[float] = []
    lock = threading.Lock()
    calls = [picks[i:i + per_call] for i in range(0, len(picks), per_call)]

    def worker(w: int) -> None:
        outs = [aligned(RANDOM_BLOCK, fill=False) for _ in range(per_call)]
        views = [memoryview(o) for o in outs]
        mine: list[float] = []
        for call in calls[w::callers]:
            chunk = [locs[p] for p in call]
            t0 = time.perf_counter()
            ok = tier.read_blocks_into(chunk, views[: len(chunk)])
            mine.append(time.perf_counter() - t0)
            if not all(ok):
                raise RuntimeError("checksum failure during the benchmark")
        for v in views:
            v.release()
        with lock:
            lat.extend(mine)

    t_start = time.perf_counter()
    run_workers(worker, callers)
    return len(picks) * RANDOM_BLOCK / (time.perf_counter() - t_start) / GB, lat


def _tier_async(tier: SsdTier, locs: Sequence[SsdLocation],
                picks: Sequence[int]) -> tuple[float, list[float]]:
    """GB/s of one caller reading the picked blocks through ``submit_reads``, RANDOM_QD
    blocks per handle with ASYNC_OUTSTANDING handles outstanding, and per-handle
    latencies (submit to last result)."""
    outs = [[aligned(RANDOM_BLOCK, fill=False) for _ in range(RANDOM_QD)]
            for _ in range(ASYNC_OUTSTANDING)]
    views = [[memoryview(o) for o in row] for row in outs]
    calls = [picks[i:i + RANDOM_QD] for i in range(0, len(picks), RANDOM_QD)]
    lat: list[float] = []
    inflight: list[tuple[Any, float, int]] = []
    t_start = time.perf_counter()
    for k, call in enumerate(calls):
        slot = k % ASYNC_OUTSTANDING
        if len(inflight) == ASYNC_OUTSTANDING:
            h, t0, _ = inflight.pop(0)  # the oldest: its buffers are reused now
            if not all(h.wait()):
                raise RuntimeError("checksum failure during the benchmark")
            lat.append(time.perf_counter() - t0)
        chunk = [locs[p] for p in call]
        inflight.append((tier.submit_reads(chunk, views[slot][: len(chunk)]),
                         time.perf_counter(), slot))
    for h, t0, _ in inflight:
        if not all(h.wait()):
            raise RuntimeError("checksum failure during the benchmark")
        lat.append(time.perf_counter() - t0)
    gbps = len(picks) * RANDOM_BLOCK / (time.perf_counter() - t_start) / GB
    for row in views:
        for v in row:
            v.release()
    return gbps, lat


def _random_reads(tier: SsdTier, path: Path, region: int, ops: int, seed: int,
                  rounds: int) -> dict[str, Any]:
    nblocks = region // RANDOM_BLOCK
    src = aligned(RANDOM_BLOCK, fill=True)
    view = memoryview(src)
    locs: list[SsdLocation] = []
    for start in range(0, nblocks, 256):
        got = tier.write_blocks([(_key(i), None, view)
                                 for i in range(start, min(nblocks, start + 256))])
        locs.extend(loc for loc in got if loc is not None)
    rng = random.Random(seed)
    tier_runs: dict[str, list[float]] = {name: [] for name, _ in RANDOM_CALLERS}
    tier_lat: dict[str, list[float]] = {name: [] for name, _ in RANDOM_CALLERS}
    raw_runs: dict[str, list[float]] = {}
    drain_runs: list[float] = []  # raw io_uring waiting for every 32: not a limit
    rlat: list[float] = []
    for _ in range(rounds):
        # Fresh random blocks each round; tier cases and raw variants read the same ones.
        picks = [rng.randrange(len(locs)) for _ in range(ops)]
        offsets = [locs[p].value_offset for p in picks]
        for name, callers in RANDOM_CALLERS:
            gbps, lat = (_tier_async(tier, locs, picks) if name == "async"
                         else _tier_random(tier, locs, picks, callers))
            tier_runs[name].append(gbps)
            tier_lat[name].extend(lat)
        gbps, lat = raw_random_threads(path, RANDOM_BLOCK, offsets, RANDOM_QD)
        raw_runs.setdefault(f"threads_qd{RANDOM_QD}", []).append(gbps)
        rlat.extend(lat)
        if uring_lib() is not None:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
            try:
                raw_runs.setdefault(f"uring_qd{RANDOM_QD}", []).append(
                    raw_uring(fd, RANDOM_BLOCK, offsets, RANDOM_QD, write=False))
                drain_runs.append(raw_uring(fd, RANDOM_BLOCK, offsets, RANDOM_QD,
                                             write=False, batch=RANDOM_QD))
            finally:
                os.close(fd)
    view.release()
    tier.delete([(_key(i), loc) for i, loc in enumerate(locs)])
    raw_variants = {k: statistics.median(v) for k, v in raw_runs.items()}
    raw_best = max(raw_variants, key=raw_variants.__getitem__)
    raw_gbps = raw_variants[raw_best]
    cases: dict[str, dict[str, Any]] = {}
    for name, callers in RANDOM_CALLERS:
        g = statistics.median(tier_runs[name])
        cases[name] = {
            "callers": max(callers, 1),
            "blocks_per_call": RANDOM_QD // max(callers, 1),
            "tier_gbps": g,
            "tier_iops": g * GB / RANDOM_BLOCK,
            "tier_call_ms_p50": pct_ms(tier_lat[name], 0.5),
            "tier_call_ms_p99": pct_ms(tier_lat[name], 0.99),
            "ratio": g / raw_gbps,
            "ratio_rounds": [t / r for t, r in zip(tier_runs[name], raw_runs[raw_best],
                                                   strict=True)],
            "tier_gbps_rounds": tier_runs[name],
        }
    batch = cases["batch"]
    if drain_runs:
        # The drain alone: raw io_uring that waits for each batch of 32, as batch does.
        d = statistics.median(drain_runs)
        batch["raw_drain_gbps"] = d
        batch["ratio_to_raw_drain"] = batch["tier_gbps"] / d
        batch["ratio_to_raw_drain_rounds"] = [
            t / r for t, r in zip(tier_runs["batch"], drain_runs, strict=True)]
        batch["raw_drain_gbps_rounds"] = drain_runs
    return {
        "block_size": RANDOM_BLOCK,
        "queue_depth": RANDOM_QD,
        "ops": ops,
        "rounds": rounds,
        # The single-caller batch (the figure earlier versions reported) at the top.
        "tier_gbps": batch["tier_gbps"],
        "tier_iops": batch["tier_iops"],
        "tier_call_ms_p50": batch["tier_call_ms_p50"],
        "tier_call_ms_p99": batch["tier_call_ms_p99"],
        "ratio": batch["ratio"],
        "cases": cases,
        "raw_gbps": raw_gbps,
        "raw_best": raw_best,
        "raw_variants_gbps": raw_variants,
        "raw_variants_gbps_rounds": raw_runs,
        "raw_iops": raw_gbps * GB / RANDOM_BLOCK,
        "raw_op_ms_p50": pct_ms(rlat, 0.5),
        "raw_op_ms_p99": pct_ms(rlat, 0.99),
    }


def _merge_rounds(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """One sequential row from per-round rows: medians, best raw variant by median."""
    out: dict[str, Any] = {}
    for k, v in runs[0].items():
        if isinstance(v, float):
            out[k] = statistics.median(r[k] for r in runs)
    for kind in ("write", "read"):
        per = {name: [r[f"raw_{kind}_variants_gbps"][name] for r in runs]
               for name in runs[0][f"raw_{kind}_variants_gbps"]}
        med = {name: statistics.median(v) for name, v in per.items()}
        best = max(med, key=med.__getitem__)
        out[f"raw_{kind}_gbps"] = med[best]
        out[f"raw_{kind}_best"] = best
        out[f"raw_{kind}_variants_gbps"] = med
        out[f"{kind}_ratio"] = out[f"tier_{kind}_gbps"] / med[best]
        out[f"{kind}_ratio_rounds"] = [r[f"tier_{kind}_gbps"] / b
                                       for r, b in zip(runs, per[best], strict=True)]
        out[f"tier_{kind}_gbps_rounds"] = [r[f"tier_{kind}_gbps"] for r in runs]
    return out


def run_ssd_bench(
    path: str | os.PathLike[str],
    sizes: Sequence[int] = (64 << 10, 1 << 20, 4 << 20, 16 << 20),
    total_bytes: int = 256 << 20,
    io: str = "auto",
    *,
    queue_depth: int = 32,
    max_batch_bytes: int = 64 << 20,
    random_ops: int = 8192,
    seed: int = 0,
    raw_qds: Sequence[int] = RAW_QDS,
    rounds: int = ROUNDS,
) -> dict[str, Any]:
    """Runs the benchmark on ``path`` (overwritten) and returns the figures.

    Each block size moves ``total_bytes`` (at least one block) each way per round;
    the tier writes batches of up to ``queue_depth`` blocks and ``max_batch_bytes``.
    """
    p = Path(path)
    _prepare(p)
    largest = max(sizes)
    capacity = -(-(max(total_bytes, largest) + largest) // ALIGNMENT) * ALIGNMENT
    tier = SsdTier(p, capacity, io=io, queue_depth=queue_depth)
    try:
        tier.recover()
        rows = []
        for size in sizes:
            n = max(1, total_bytes // size)
            batch = max(1, min(queue_depth, max_batch_bytes // size, n))
            src = aligned(size, fill=True)
            runs = []
            for _ in range(rounds):
                run = _tier_sequential(tier, size, n, batch, src)
                run.update(raw_sequential(p, size, n, src, raw_qds, dests=batch))
                runs.append(run)
            src.close()
            row: dict[str, Any] = {"block_size": size, "blocks": n, "batch_blocks": batch,
                                   "rounds": rounds}
            row.update(_merge_rounds(runs))
            rows.append(row)
        rand = _random_reads(tier, p, min(total_bytes, capacity - largest), random_ops, seed,
                             rounds)
        stats = tier.stats()
        verify_in_c = tier.verifies_in_c
    finally:
        tier.close()
    _prepare(p)  # leave no large file behind
    return {
        "benchmark": "ssd_tier",
        "config": {
            "path": str(p),
            "capacity": capacity,
            "total_bytes_per_size": total_bytes,
            "io_backend": stats["io_backend"],
            "io_backend_reason": stats["io_backend_reason"],
            "o_direct": stats["o_direct"],
            "queue_depth": queue_depth,
            "kernel": platform.release(),
            "python": platform.python_version(),
            "cpus": os.cpu_count(),
            "raw_queue_depths": list(raw_qds),
            "rounds": rounds,
            "verify_in_c": verify_in_c,
            "raw_uring": uring_lib() is not None,
            "note": ("tier latencies are per call (one batch); raw latencies per request "
                     "(the QD1 loop for sequential, the threads for random). Figures are "
                     "medians over rounds (tier and raw alternating). The raw limit of "
                     "each case is the raw variant with the best median: O_DIRECT "
                     "preadv/pwritev at QD1, threads at each other QD, and io_uring "
                     "(tiers._uring, no checksum or index work) at each QD > 1."),
        },
        "sequential": rows,
        "random_read": rand,
        "tier_stats": stats,
    }


def _fmt_size(n: int) -> str:
    return f"{n // MiB} MiB" if n >= MiB else f"{n // KiB} KiB"


def print_table(res: dict[str, Any]) -> None:
    cfg = res["config"]
    print(f"SSD tier bench: {cfg['path']}  backend={cfg['io_backend']} "
          f"o_direct={cfg['o_direct']} qd={cfg['queue_depth']} kernel={cfg['kernel']}")
    hdr = (f"{'block':>8} {'batch':>5} | {'tier W':>7} {'raw W':>7} {'W ratio':>7} | "
           f"{'tier R':>7} {'raw R':>7} {'R ratio':>7} | {'tierW p50/p99 ms':>17} "
           f"{'tierR p50/p99 ms':>17} {'rawR p50/p99 ms':>16}")
    print(hdr)
    print("-" * len(hdr))
    for r in res["sequential"]:
        print(f"{_fmt_size(r['block_size']):>8} {r['batch_blocks']:>5} | "
              f"{r['tier_write_gbps']:7.2f} {r['raw_write_gbps']:7.2f} {r['write_ratio']:7.2f} | "
              f"{r['tier_read_gbps']:7.2f} {r['raw_read_gbps']:7.2f} {r['read_ratio']:7.2f} | "
              f"{r['tier_write_call_ms_p50']:8.2f}/{r['tier_write_call_ms_p99']:<8.2f} "
              f"{r['tier_read_call_ms_p50']:8.2f}/{r['tier_read_call_ms_p99']:<8.2f} "
              f"{r['raw_read_op_ms_p50']:7.2f}/{r['raw_read_op_ms_p99']:<8.2f}")
    print("(GB/s, medians over rounds; tier latencies per batch call, raw per request; "
          "raw = variant with the best median)")
    for r in res["sequential"]:
        if "read_ratio_rounds" in r:
            print(f"  {_fmt_size(r['block_size']):>7} per-round ratios W "
                  + " ".join(f"{x:.2f}" for x in r["write_ratio_rounds"]) + "  R "
                  + " ".join(f"{x:.2f}" for x in r["read_ratio_rounds"]))
    print("raw variants (write/read GB/s):")
    for r in res["sequential"]:
        w, rd = r["raw_write_variants_gbps"], r["raw_read_variants_gbps"]
        print(f"  {_fmt_size(r['block_size']):>7}: " + "  ".join(
            f"{k} {w[k]:.2f}/{rd[k]:.2f}" for k in w)
              + f"  | best W {r['raw_write_best']}, R {r['raw_read_best']}")
    fills = ", ".join(str(r["batch_blocks"]) for r in res["sequential"])
    print(f"  reads land in as many buffers as a tier call fills ({fills}); reference, not a "
          "limit: QD1 into one reused buffer " + "  ".join(
              f"{_fmt_size(r['block_size'])} {r['raw_read_one_buffer_gbps']:.2f}"
              for r in res["sequential"] if "raw_read_one_buffer_gbps" in r))
    rr = res["random_read"]
    print(f"random 64 KiB reads, QD{rr['queue_depth']}, {rr['ops']} ops x "
          f"{rr.get('rounds', 1)} rounds: raw "
          f"{rr['raw_gbps']:.2f} GB/s ({rr['raw_iops']:.0f} IOPS, per-op p50 "
          f"{rr['raw_op_ms_p50']:.2f} ms p99 {rr['raw_op_ms_p99']:.2f} ms)")
    for name, c in rr.get("cases", {"batch": {**rr, "callers": 1, "blocks_per_call": 32,
                                              "ratio_rounds": [rr["ratio"]]}}).items():
        print(f"  tier {name:<10} ({c['callers']:>2} callers x {c['blocks_per_call']:>2} "
              f"blocks/call): {c['tier_gbps']:.2f} GB/s ({c['tier_iops']:.0f} IOPS, call "
              f"p50 {c['tier_call_ms_p50']:.2f} ms p99 {c['tier_call_ms_p99']:.2f} ms) "
              f"ratio {c['ratio']:.2f} (rounds "
              + " ".join(f"{x:.2f}" for x in c["ratio_rounds"]) + ")")
    b = rr.get("cases", {}).get("batch", {})
    if "raw_drain_gbps" in b:
        print(f"  raw io_uring waiting for each batch of 32 (the drain alone, not a limit): "
              f"{b['raw_drain_gbps']:.2f} GB/s; tier batch over it {b['ratio_to_raw_drain']:.2f}"
              " (rounds " + " ".join(f"{x:.2f}" for x in b["ratio_to_raw_drain_rounds"]) + ")")
    print("  raw random variants: " + "  ".join(
        f"{k} {v:.2f}" for k, v in rr["raw_variants_gbps"].items()) + f"  (best {rr['raw_best']})")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--path", default="/var/tmp/kvstore-ssd-bench.img")
    ap.add_argument("--sizes", default="64K,1M,4M,16M",
                    help="comma-separated block sizes with K/M suffix")
    ap.add_argument("--total-mib", type=int, default=256, help="MiB moved per size, each way")
    ap.add_argument("--io", default="auto", choices=["auto", "uring", "python"])
    ap.add_argument("--queue-depth", type=int, default=32)
    ap.add_argument("--random-ops", type=int, default=8192)
    ap.add_argument("--raw-qds", default=",".join(map(str, RAW_QDS)),
                    help="queue depths of the raw sequential baselines")
    ap.add_argument("--rounds", type=int, default=ROUNDS,
                    help="repetitions of every case (tier and raw alternate); medians")
    ap.add_argument("--out", default=str(RESULTS))
    args = ap.parse_args(argv)
    units = {"K": KiB, "M": MiB}
    sizes = [int(s[:-1]) * units[s[-1].upper()] if s[-1].upper() in units else int(s)
             for s in args.sizes.split(",")]
    res = run_ssd_bench(args.path, sizes, args.total_mib * MiB, args.io,
                        queue_depth=args.queue_depth, random_ops=args.random_ops,
                        raw_qds=[int(q) for q in args.raw_qds.split(",")],
                        rounds=args.rounds)
    print_table(res)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(res, indent=2) + "\n")
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
