"""``kvstore bench tiers``: each tier's put/get beside its physical limit, in one run.

* DRAM and HBM tiers: in-process puts (reserve, copy in, commit) and gets (read
  lease, copy out into a preallocated buffer, release) through a real
  TierManager, against a plain memcpy of the same bytes between preallocated
  buffers. HBM runs on the device torch picks (CPU here, reported as such).
* SSD tier: ``benchmarks.ssd_bench`` on a file (batched O_DIRECT through io_uring
  where available) against raw aligned O_DIRECT I/O on the same file.

Cells are interleaved with their baseline and repeated; the table shows medians
and the ratio tier/limit. Writes ``tier_bench.json`` and ``tier_bench.png``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.stats import progress
from kvstore.core.keys import BlockKey
from tiers.dram import DramTier
from tiers.manager import TierManager, Watermarks
from tiers.policy import make_policy

SIZES = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
RESULTS = Path(__file__).resolve().parent / "results"


def _time_per_op(fn: Callable[[int], None], n: int) -> list[float]:
    out = []
    for i in range(n):
        t0 = time.perf_counter()
        fn(i)
        out.append(time.perf_counter() - t0)
    return out


def _summary(size: int, samples: list[float]) -> dict[str, float]:
    s = sorted(samples)
    med = statistics.median(s)
    return {"gbps": size / med / 1e9, "p50_ms": med * 1e3,
            "p99_ms": s[min(len(s) - 1, int(0.99 * len(s)))] * 1e3}


def bench_mapped_tier(size: int, rounds: int, ops: int) -> dict[str, Any]:
    """DRAM tier put/get through the TierManager vs memcpy, interleaved per round."""
    count = max(2, ops)
    tier = DramTier(size * (count + 2), prefault=True)
    manager = TierManager(tier, make_policy("lru"), watermarks=Watermarks(high=1.0, low=1.0))
    src = np.frombuffer(np.random.default_rng(0).bytes(size), dtype=np.uint8)
    dst = np.empty(size, dtype=np.uint8)
    # .data, an array's buffer: numpy's stub declares the buffer protocol for Python 3.12+
    # only.
    srcv, dstv = src.data, dst.data
    # The limit copies into and out of as many distinct slots as the tier uses, so
    # both see the same cache misses; copying between two hot buffers would not.
    slots = np.zeros(size * count, dtype=np.uint8).data
    puts: list[float] = []
    gets: list[float] = []
    memcpy_in: list[float] = []
    memcpy_out: list[float] = []
    for r in range(rounds):
        keys = [BlockKey((r * count + i).to_bytes(16, "big")) for i in range(count)]

        def put(i: int, keys: list[BlockKey] = keys) -> None:
            res = manager.reserve(keys[i], size)
            assert res is not None
            manager.fill_view(res)[:] = srcv
            manager.commit(res)

        def get(i: int, keys: list[BlockKey] = keys) -> None:
            entry = manager.acquire_read(keys[i])
            assert entry is not None
            dstv[:] = manager.read_view(entry)
            manager.release_read(entry)

        def copy_in(i: int) -> None:
            slots[i * size : (i + 1) * size] = srcv

        def copy_out(i: int) -> None:
            dstv[:] = slots[i * size : (i + 1) * size]

        puts += _time_per_op(put, count)
        memcpy_in += _time_per_op(copy_in, count)
        gets += _time_per_op(get, count)
        memcpy_out += _time_per_op(copy_out, count)
        for k in keys:
            manager.remove(k)
    assert bytes(dst) == bytes(src)
    tier.close()
    return {"put": _summary(size, puts), "get": _summary(size, gets),
            "memcpy_in": _summary(size, memcpy_in), "memcpy_out": _summary(size, memcpy_out)}


def bench_hbm(size: int, rounds: int, ops: int) -> dict[str, Any] | None:
    try:
        from tiers.hbm import HbmTier
    except ImportError:
        return None
    try:
        tier = HbmTier(size * 2)
    except RuntimeError:
        return None
    ext = tier.allocate(size)
    assert ext is not None
    src = memoryview(np.random.default_rng(1).bytes(size))
    dst = memoryview(bytearray(size))
    writes = _time_per_op(lambda _: tier.write(ext, src), rounds * ops)
    reads = _time_per_op(lambda _: tier.read_into(ext, size, dst), rounds * ops)
    assert bytes(dst) == bytes(src)
    return {"device": tier.describe()["device"], "put": _summary(size, writes),
            "get": _summary(size, reads)}


def run(sizes: Sequence[int], *, quick: bool, ssd_path: str | None) -> dict[str, Any]:
    rounds, ops = (3, 8) if quick else (5, 20)
    out: dict[str, Any] = {"dram": {}, "hbm": {}, "ssd": None}
    bar = progress(len(sizes), "memory tiers", unit="size")
    for size in sizes:
        n = max(2, ops if size <= (4 << 20) else ops // 4)
        d = bench_mapped_tier(size, rounds, n)
        d["put_ratio"] = d["put"]["gbps"] / d["memcpy_in"]["gbps"]
        d["get_ratio"] = d["get"]["gbps"] / d["memcpy_out"]["gbps"]
        out["dram"][str(size)] = d
        h = bench_hbm(size, rounds, n)
        if h is not None:
            h["put_ratio"] = h["put"]["gbps"] / d["memcpy_in"]["gbps"]
            h["get_ratio"] = h["get"]["gbps"] / d["memcpy_out"]["gbps"]
            out["hbm"][str(size)] = h
        bar.update()
    bar.close()
    if ssd_path:
        from benchmarks.ssd_bench import run_ssd_bench

        out["ssd"] = run_ssd_bench(ssd_path, sizes=tuple(sizes),
                                   total_bytes=(64 << 20) if quick else (256 << 20))
    return out


def _fmt(n: int) -> str:
    return f"{n >> 20} MiB" if n >= 1 << 20 else f"{n >> 10} KiB"


def print_table(res: dict[str, Any]) -> None:
    print(f"{'tier':<9}{'size':>8}{'put GB/s':>10}{'get GB/s':>10}{'memcpy in/out':>15}"
          f"{'put/limit':>11}{'get/limit':>11}  target (>= 1 MiB: >= 0.8)")
    for name in ("dram", "hbm"):
        for size, d in res[name].items():
            base = res["dram"][size]
            limit = f"{base['memcpy_in']['gbps']:.2f}/{base['memcpy_out']['gbps']:.2f}"
            ok = ""
            if name == "dram" and int(size) >= 1 << 20:
                ok = "pass" if min(d["put_ratio"], d["get_ratio"]) >= 0.8 else "miss"
            label = name if name == "dram" else f"hbm({d['device']})"
            print(f"{label:<9}{_fmt(int(size)):>8}{d['put']['gbps']:>10.2f}"
                  f"{d['get']['gbps']:>10.2f}{limit:>15}{d['put_ratio']:>11.2f}"
                  f"{d['get_ratio']:>11.2f}  {ok}")
    if res["ssd"]:
        from benchmarks.ssd_bench import print_table as ssd_table

        print()
        ssd_table(res["ssd"])


def plot(res: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sizes = [int(s) for s in res["dram"]]
    for name, key in (("dram put", "put"), ("dram get", "get"), ("memcpy in", "memcpy_in"),
                      ("memcpy out", "memcpy_out")):
        ax.plot([s >> 10 for s in sizes], [res["dram"][str(s)][key]["gbps"] for s in sizes],
                marker="o", label=name)
    ax.set_xscale("log", base=2)
    ax.set_xlabel("block size (KiB)")
    ax.set_ylabel("GB/s (median)")
    ax.set_title("DRAM tier vs memcpy (in-process)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench tiers")
    p.add_argument("--quick", action="store_true", help="fewer rounds (~20 s)")
    p.add_argument("--ssd-path", default="/var/tmp/kvstore-tier-bench.img",
                   help="file for the SSD part (on a real disk, not tmpfs); '' to skip")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    res = run(SIZES, quick=args.quick, ssd_path=args.ssd_path or None)
    print_table(res)
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "tier_bench.json").write_text(json.dumps(res, indent=1, default=str))
    plot(res, out / "tier_bench.png")
    print(f"\nwrote {out / 'tier_bench.json'} and {out / 'tier_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
