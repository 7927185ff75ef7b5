"""What the weights' fingerprint (``kvstore.integrations.identity``) costs at start-up.

Writes a synthetic multi-file safetensors checkpoint of real bytes on disk (``--files``
files, ``--tensors`` tensors spread over them, ``--gib`` GiB in all), then fingerprints
it ``--runs`` times with the page cache warm and ``--runs`` times cold (each file's pages
dropped first with ``posix_fadvise(DONTNEED)`` after an ``fsync``, which needs no root),
and prints the median seconds, the bytes read and the reads made, as a table and JSON.

The cost depends on the number of files and tensors (a header per file, three windows of
256 bytes per tensor), not on the checkpoint's size: the extrapolation to a 100 GB
checkpoint in docs/engines/vllm.md ("Identity") scales these figures by tensor count.

    python -m benchmarks.identity_cost --dir /tmp/ckpt --files 8 --tensors 1000 --gib 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import time
from pathlib import Path

from kvstore.integrations.identity import fingerprint_checkpoint

CHUNK = 64 << 20


def write_checkpoint(root: Path, files: int, tensors: int, total: int) -> None:
    """``files`` safetensors files holding ``tensors`` uint8 tensors of equal size (random
    bytes, so nothing compresses or deduplicates), ``total`` bytes of data in all."""
    root.mkdir(parents=True, exist_ok=True)
    per_tensor = total // tensors
    counts = [tensors // files + (i < tensors % files) for i in range(files)]
    block = os.urandom(CHUNK)
    n = 0
    for i, count in enumerate(counts):
        header = {}
        offset = 0
        for _ in range(count):
            header[f"model.layers.{n}.weight"] = {
                "dtype": "U8", "shape": [per_tensor], "data_offsets": [offset, offset + per_tensor]}
            offset += per_tensor
            n += 1
        raw = json.dumps(header).encode()
        path = root / f"model-{i + 1:05d}-of-{files:05d}.safetensors"
        with open(path, "wb") as f:
            f.write(struct.pack("<Q", len(raw)) + raw)
            left = offset
            while left:
                k = min(left, CHUNK)
                f.write(block[:k])
                left -= k
            f.flush()
            os.fsync(f.fileno())
    (root / "config.json").write_text(json.dumps({"model_type": "llama"}))


def drop_cache(root: Path) -> None:
    for p in root.iterdir():
        fd = os.open(p, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def measure(root: Path, runs: int, cold: bool) -> dict:
    times = []
    fp = None
    for _ in range(runs):
        if cold:
            drop_cache(root)
        t0 = time.perf_counter()
        fp = fingerprint_checkpoint(root)
        times.append(time.perf_counter() - t0)
    assert fp is not None
    return {"cache": "cold" if cold else "warm", "median_s": statistics.median(times),
            "max_s": max(times), "files": fp.files, "tensors": fp.tensors,
            "bytes_read": fp.bytes_read, "reads": fp.tensors * 3}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--dir", type=Path, required=True, help="where to write the checkpoint")
    ap.add_argument("--files", type=int, default=8)
    ap.add_argument("--tensors", type=int, default=1000)
    ap.add_argument("--gib", type=float, default=2.0)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--keep", action="store_true", help="keep the checkpoint afterwards")
    args = ap.parse_args(argv)
    total = int(args.gib * (1 << 30))
    t0 = time.perf_counter()
    write_checkpoint(args.dir, args.files, args.tensors, total)
    written = time.perf_counter() - t0
    rows = [measure(args.dir, args.runs, cold=False), measure(args.dir, args.runs, cold=True)]
    print(f"checkpoint: {args.files} files, {args.tensors} tensors, {args.gib} GiB "
          f"(written in {written:.1f} s)")
    print(f"{'cache':<6} {'median s':>9} {'max s':>8} {'bytes read':>11} {'reads':>7}")
    for r in rows:
        print(f"{r['cache']:<6} {r['median_s']:9.4f} {r['max_s']:8.4f} {r['bytes_read']:11d} "
              f"{r['reads']:7d}")
    print(json.dumps({"files": args.files, "tensors": args.tensors, "gib": args.gib,
                      "runs": rows}))
    if not args.keep:
        for p in args.dir.iterdir():
            p.unlink()
        args.dir.rmdir()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
