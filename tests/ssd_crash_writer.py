"""Writes blocks to an SSD tier forever, printing each key once it is acknowledged.

Used by tests/test_ssd_tier.py: the test SIGKILLs this process mid-run, reopens the
tier, and checks that every key printed here (printed only after write_blocks
returned) reads back byte-exact. A block's content is a pure function of its key
(:func:`payload_for`), so the checker needs nothing but the printed keys.
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from pathlib import Path

import xxhash

# Run as a script: make the repository importable without an installed package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tiers.ssd.tier import SsdTier

MAX_BLOCK = 48 << 10


def key_for(i: int) -> bytes:
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def payload_for(key: bytes) -> bytes:
    rng = random.Random(key)
    return rng.randbytes(rng.randint(1, MAX_BLOCK))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--path", required=True)
    ap.add_argument("--capacity", type=int, required=True)
    ap.add_argument("--io", default="auto")
    ap.add_argument("--batch", type=int, default=4)
    args = ap.parse_args()

    tier = SsdTier(args.path, args.capacity, io=args.io)
    tier.recover()
    print(f"BACKEND {tier.io_backend}", flush=True)
    i = 0
    while True:
        keys = [key_for(i + j) for j in range(args.batch)]
        i += args.batch
        items = [(k, None, memoryview(payload_for(k))) for k in keys]
        locations = tier.write_blocks(items)  # type: ignore[arg-type]
        acked = [k for k, loc in zip(keys, locations, strict=True) if loc is not None]
        if not acked:
            print("FULL", flush=True)
            break
        # One write per batch, so a kill mid-print can only cut the last line.
        sys.stdout.write("".join(f"ACK {k.hex()}\n" for k in acked))
        sys.stdout.flush()
    # Stay alive until killed: the test decides when the "crash" happens.
    while True:
        time.sleep(1)


if __name__ == "__main__":
    sys.exit(main())
