"""``python -m benchmarks.ssd_restart``: how long an SSD tier of millions of small blocks
takes from restart to serving, and whether it comes back whole.

1. **fill** (this process): a fresh ``SsdTier`` gets ``--blocks`` blocks of
   ``--value-bytes`` each through ``write_blocks`` (batches of ``--batch``, each durable:
   data, headers, one synced RocksDB batch), keys in chains of 32; every acknowledged key
   is kept. One block's value is then damaged on disk (one byte flipped), as a torn
   sector would.
2. **restart, in parts** (a fresh process): ``SsdTier`` open (RocksDB opened, the format
   and high-water records validated, every entry decoded into a record, the allocator
   rebuilt from the records' extents), ``recover()``, then each record adopted into a
   ``TierManager`` (what ``Node._recover`` does), each part timed.
3. **restart, whole** (a fresh process): a real ``Node`` with the SSD tier, as
   ``kvstore serve`` builds it (DRAM not prefaulted), timed from the call to a node that
   serves; then checked: every acknowledged key is indexed (``exists``), a random sample
   of ``--verify`` blocks reads back byte for byte (the tier verifies each value's
   checksum on read), and the damaged block is refused (a miss, one checksum failure).
4. with ``--rebuild``, the index is deleted and a node started with
   ``allow_index_rebuild`` rebuilds it by scanning the region (timed and checked the same
   way).

Each block takes a 4 KiB header page and its value rounded up to 4 KiB: 8 KiB of disk for
a small value, so 10 million blocks need 82 GB. The region is sized so the blocks fill
85% of it: a node whose SSD tier is past its high watermark (95%) evicts at start, down to
its low watermark, and the blocks it drops would be counted as lost here. Writes
``results/ssd_restart.json``.

    python -m benchmarks.ssd_restart --path /var/tmp/kvstore-ssd-restart.img --blocks 1e6
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import random
import shutil
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import write_json
from kvstore.core.keys import BlockKey
from tiers.ssd.types import ALIGNMENT, HEADER_BYTES

CHAIN = 32
RESULTS = Path(__file__).resolve().parent / "results"
TARGET_S = 60.0
FILL = 0.85  # below the node's high watermark (0.95): see the module docstring


def key_of(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "big"))


def value_of(i: int, nbytes: int) -> bytes:
    return (i.to_bytes(8, "little") * (nbytes // 8 + 1))[:nbytes]


def block_disk_bytes(value_bytes: int) -> int:
    return HEADER_BYTES + -(-max(1, value_bytes) // ALIGNMENT) * ALIGNMENT


def capacity_for(blocks: int, value_bytes: int, fill: float = FILL) -> int:
    """A region the blocks fill to ``fill`` of (rounded up to the alignment)."""
    need = blocks * block_disk_bytes(value_bytes) / fill
    return -(-int(need) // ALIGNMENT) * ALIGNMENT


def _remove(path: Path) -> None:
    for p in (path, Path(f"{path}.index"), Path(f"{path}.index.witness")):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    for p in path.parent.glob(path.name + ".index.damaged*"):
        shutil.rmtree(p) if p.is_dir() else p.unlink()


# ---- 1. fill ---------------------------------------------------------------------------------


def fill(path: Path, blocks: int, value_bytes: int, batch: int) -> dict[str, Any]:
    from tiers.ssd.tier import SsdTier

    _remove(path)
    capacity = capacity_for(blocks, value_bytes)
    t0 = time.perf_counter()
    acked = 0
    damaged = -1
    damaged_offset = -1
    with SsdTier(path, capacity) as tier:
        tier.recover()
        for lo in range(0, blocks, batch):
            items = [(key_of(i), key_of(i - 1) if i % CHAIN else None,
                      memoryview(value_of(i, value_bytes)))
                     for i in range(lo, min(blocks, lo + batch))]
            locs = tier.write_blocks(items)
            if any(loc is None for loc in locs):
                raise RuntimeError(f"the tier is full after {acked} blocks")
            acked += len(locs)
            if damaged < 0 and lo + batch >= blocks // 2:  # one block in the middle
                first = locs[0]
                assert first is not None
                damaged, damaged_offset = lo, first.value_offset
    write_s = time.perf_counter() - t0
    with open(path, "r+b") as f:  # a flipped byte in one value, behind the tier's back
        f.seek(damaged_offset)
        byte = f.read(1)
        f.seek(damaged_offset)
        f.write(bytes([byte[0] ^ 0xFF]))
        os.fsync(f.fileno())
    index_bytes = sum(p.stat().st_size for p in Path(f"{path}.index").rglob("*") if p.is_file())
    return {"blocks": blocks, "acked": acked, "value_bytes": value_bytes, "batch": batch,
            "capacity": capacity, "write_s": write_s, "writes_per_s": acked / write_s,
            "damaged_block": damaged, "index_dir_bytes": index_bytes}


# ---- 2. restart in parts -----------------------------------------------------------------------


def restart_parts(path: Path, capacity: int) -> dict[str, Any]:
    from kvstore.core.collector import collector_paused
    from tiers.manager import TierManager
    from tiers.metadata import MetadataTier
    from tiers.policy import make_policy
    from tiers.ssd.tier import SsdTier

    t0, c0 = time.perf_counter(), time.process_time()
    with collector_paused():  # as Node._open_ssd and Node._recover
        tier = SsdTier(path, capacity)
    t1, c1 = time.perf_counter(), time.process_time()
    records = tier.recover()
    t2 = time.perf_counter()
    manager = TierManager([MetadataTier(64 << 20), tier], make_policy("lru"), landing=0)
    c2 = time.process_time()
    with collector_paused():
        manager.adopt_many(1, ((r.key, r.parent, r.location.nbytes, r.location, r.retention)
                               for r in records))
    t3, c3 = time.perf_counter(), time.process_time()
    n = len(records)
    del records, manager
    gc.collect()
    tier.close()
    return {"records": n, "open_s": t1 - t0, "recover_s": t2 - t1, "adopt_s": t3 - t2,
            "total_s": t3 - t0, "open_cpu_s": c1 - c0, "adopt_cpu_s": c3 - c2,
            "total_cpu_s": c3 - c0}


# ---- 3. restart whole, and check ---------------------------------------------------------------


def restart_node(path: Path, capacity: int, blocks: int, value_bytes: int, verify: int,
                 damaged: int, *, rebuild: bool) -> dict[str, Any]:
    from kvstore.node.semantics import Node, NodeSettings

    settings = NodeSettings(dram_bytes=64 << 20, prefault=False, ssd_path=str(path),
                            ssd_bytes=capacity, block_bytes=block_disk_bytes(value_bytes),
                            allow_index_rebuild=rebuild)
    t0, c0 = time.perf_counter(), time.process_time()
    node = Node(settings)
    serving_s, serving_cpu_s = time.perf_counter() - t0, time.process_time() - c0
    try:
        keys = [key_of(i) for i in range(blocks)]
        t1 = time.perf_counter()
        found: list[bool] = []
        for lo in range(0, blocks, 4096):
            found += node.exists(keys[lo:lo + 4096])
        present = sum(found)
        exists_s = time.perf_counter() - t1
        rng = random.Random(7)
        sample = sorted({rng.randrange(blocks) for _ in range(verify)} - {damaged})
        t1 = time.perf_counter()
        good = sum(1 for i in sample if node.get(keys[i]) == value_of(i, value_bytes))
        verify_s = time.perf_counter() - t1
        damaged_read = node.get(keys[damaged])
        stats = node.stats()
        ssd = stats["tiers"]["ssd"]
        info = stats["node"]
    finally:
        node.close()
    return {"serving_s": serving_s, "serving_cpu_s": serving_cpu_s,
            "recovered_blocks": info.get("recovered_blocks"),
            "rebuilt_blocks": info.get("ssd_rebuilt_blocks"),
            "rebuild_dropped": info.get("ssd_rebuild_dropped_blocks"),
            "acked_present": present, "acked_missing": blocks - present,
            "missing_besides_damaged": sum(1 for i, f in enumerate(found)
                                           if not f and i != damaged),
            "exists_s": exists_s, "verified": len(sample), "verified_equal": good,
            "verify_reads_per_s": len(sample) / verify_s if verify_s else 0.0,
            "damaged_block_refused": damaged_read is None,
            "checksum_failures": ssd.get("checksum_failures")}


# ---- the run -----------------------------------------------------------------------------------


def _child(phase: str, args: argparse.Namespace, extra: dict[str, Any]) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "benchmarks.ssd_restart", "--phase", phase,
           "--path", str(args.path), "--blocks", str(args.blocks), "--value-bytes",
           str(args.value_bytes), "--verify", str(args.verify), "--phase-args",
           json.dumps(extra)]
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise RuntimeError(f"phase {phase} failed (exit {proc.returncode}):\n{proc.stderr}")
    out: dict[str, Any] = json.loads(proc.stdout.strip().splitlines()[-1])
    return out


def format_report(r: dict[str, Any]) -> str:
    f, p, n = r["fill"], r["parts"], r["node"]
    lines = [
        f"{f['acked']:,} blocks of {f['value_bytes']} B acknowledged in {f['write_s']:.0f} s "
        f"({f['writes_per_s']:,.0f}/s, batches of {f['batch']}); index "
        f"{f['index_dir_bytes'] / 2**20:.0f} MiB",
        f"restart in parts: open {p['open_s']:.1f} s (RocksDB read, records decoded, "
        f"allocator rebuilt; {p['open_cpu_s']:.1f} s CPU) + recover {p['recover_s']:.2f} s + "
        f"adopt into the TierManager {p['adopt_s']:.1f} s ({p['adopt_cpu_s']:.1f} s CPU) = "
        f"{p['total_s']:.1f} s ({p['total_cpu_s']:.1f} s CPU) for {p['records']:,} records",
        f"restart to serving (a real Node): {n['serving_s']:.1f} s, {n['serving_cpu_s']:.1f} "
        f"s CPU (target <= {TARGET_S:.0f} "
        f"s at 10M); {n['acked_present']:,} of {f['acked']:,} acknowledged blocks indexed "
        f"({n['acked_missing']} lost); {n['verified_equal']:,} of {n['verified']:,} sampled "
        f"blocks read back equal ({n['verify_reads_per_s']:,.0f}/s, checksums verified); "
        f"the damaged block refused: {n['damaged_block_refused']} "
        f"(checksum failures {n['checksum_failures']})",
    ]
    rb = r.get("rebuild")
    if rb is not None:
        lines.append(
            f"rebuild by scan (index deleted, --allow-index-rebuild): {rb['serving_s']:.1f} s; "
            f"{rb['rebuilt_blocks']:,} rebuilt, {rb['rebuild_dropped']} dropped, "
            f"{rb['acked_missing']} acknowledged missing ({rb['missing_besides_damaged']} besides "
            f"the damaged one), {rb['verified_equal']:,} of "
            f"{rb['verified']:,} sampled equal, damaged refused: {rb['damaged_block_refused']}")
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.ssd_restart", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--path", type=Path, default=Path("/var/tmp/kvstore-ssd-restart.img"))
    p.add_argument("--blocks", type=lambda t: int(float(t)), default=1_000_000)
    p.add_argument("--value-bytes", type=int, default=64)
    p.add_argument("--batch", type=int, default=512)
    p.add_argument("--verify", type=int, default=10_000, help="blocks read back after restart")
    p.add_argument("--rebuild", action="store_true", help="also time a rebuild by scan")
    p.add_argument("--keep", action="store_true", help="leave the files (default: removed)")
    p.add_argument("--out", type=Path, default=RESULTS / "ssd_restart.json")
    p.add_argument("--phase", choices=["parts", "node"], help=argparse.SUPPRESS)
    p.add_argument("--phase-args", default="{}", help=argparse.SUPPRESS)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.blocks < 2 or args.value_bytes < 1 or args.batch < 1:
        p.error("need --blocks >= 2, --value-bytes >= 1 and --batch >= 1")
    extra = json.loads(args.phase_args)
    if args.phase == "parts":
        print(json.dumps(restart_parts(args.path, extra["capacity"])))
        return 0
    if args.phase == "node":
        print(json.dumps(restart_node(args.path, extra["capacity"], args.blocks,
                                      args.value_bytes, args.verify, extra["damaged"],
                                      rebuild=extra["rebuild"])))
        return 0
    need = capacity_for(args.blocks, args.value_bytes)
    free = shutil.disk_usage(args.path.parent).free
    if need > free * 0.8:
        p.error(f"{args.blocks:,} blocks need {need / 2**30:.1f} GiB on disk; "
                f"{args.path.parent} has {free / 2**30:.1f} GiB free")
    try:
        print(f"fill: {args.blocks:,} blocks ...", flush=True)
        result: dict[str, Any] = {"fill": fill(args.path, args.blocks, args.value_bytes,
                                                args.batch)}
        common = {"capacity": result["fill"]["capacity"],
                  "damaged": result["fill"]["damaged_block"], "rebuild": False}
        print("restart in parts ...", flush=True)
        result["parts"] = _child("parts", args, common)
        print("restart a node ...", flush=True)
        result["node"] = _child("node", args, common)
        if args.rebuild:
            print("rebuild by scan ...", flush=True)
            shutil.rmtree(f"{args.path}.index")
            result["rebuild"] = _child("node", args, common | {"rebuild": True})
    finally:
        if not args.keep:
            _remove(args.path)
    print(format_report(result))
    result["command"] = "python -m benchmarks.ssd_restart " + " ".join(
        sys.argv[1:] if argv is None else argv)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
