"""``make demo``: one node on the embedded default, a client that caches prompt prefixes.

Starts ``kvstore serve`` (DRAM tier only, no etcd, 127.0.0.1, a free port), then
plays a serving workload: prompts that share a system prompt and earlier turns
of a chat. For each prompt it asks the store how much of the prefix is cached,
stores the blocks it had to "compute", and reads every block back, checking
the bytes. Then it moves a few hundred 1 MiB blocks to show throughput, prints
the node's stats, and stops the node with SIGTERM (it must exit 0).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import random
import signal
import subprocess
import sys
import time

from kvstore.client import Client
from kvstore.core.keys import BlockKey, block_keys
from kvstore.core.ports import free_port  # re-exported: kvstore.demo.free_port stays
from kvstore.remote.stat_table import format_stat_table

NAMESPACE = "demo-llama/bf16/tp0"
BLOCK_TOKENS = 256


def start_node(port: int, dram: str) -> subprocess.Popen:
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore", "serve", "--listen", f"127.0.0.1:{port}",
         "--dram-bytes", dram],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert proc.stdout is not None
    for line in proc.stdout:
        if line.startswith("kvstore: serving on"):
            print(f"  node pid {proc.pid}: {line.strip()[len('kvstore: '):]}")
            return proc
    raise SystemExit(f"demo: the node did not start (exit {proc.wait()})")


def kv_block(key: BlockKey, nbytes: int) -> bytes:
    """Stand-in for a block's K/V tensors: deterministic bytes derived from its key."""
    seed = hashlib.blake2b(key, digest_size=8).digest()
    return (seed * (nbytes // len(seed) + 1))[:nbytes]


def prompts(rng: random.Random) -> list[tuple[str, list[int]]]:
    system = [rng.randrange(32000) for _ in range(1024)]  # 4 blocks, shared by everyone
    doc = [rng.randrange(32000) for _ in range(2048)]
    chat: list[int] = []
    out = []
    for turn in range(4):
        chat += [rng.randrange(32000) for _ in range(300 + 120 * turn)]
        out.append((f"chat turn {turn + 1}", system + chat))
    for q in range(3):
        out.append((f"doc question {q + 1}", system + doc + [rng.randrange(32000)
                                                                for _ in range(200)]))
    out.append(("new user", system + [rng.randrange(32000) for _ in range(900)]))
    return out


def run_prefix_workload(c: Client, block_bytes: int) -> tuple[int, int]:
    rng = random.Random(7)
    print(f"\n  {'request':<16}{'tokens':>8}{'blocks':>8}{'cached':>8}{'stored':>8}"
          f"{'saved tokens':>14}")
    total_blocks = cached_total = 0
    for label, tokens in prompts(rng):
        keys = block_keys(tokens, BLOCK_TOKENS, NAMESPACE)
        cached = c.prefix_match(keys)
        new = keys[cached:]
        parents = [keys[i - 1] if i > 0 else None for i in range(cached, len(keys))]
        stored = c.put_batch(new, [kv_block(k, block_bytes) for k in new], parents=parents)
        values = c.get_batch(keys)
        bad = [i for i, (k, v) in enumerate(zip(keys, values, strict=True))
               if v != kv_block(k, block_bytes)]
        if bad:
            raise SystemExit(f"demo: blocks {bad} of {label!r} came back wrong")
        total_blocks += len(keys)
        cached_total += cached
        print(f"  {label:<16}{len(tokens):>8}{len(keys):>8}{cached:>8}{sum(stored):>8}"
              f"{cached * BLOCK_TOKENS:>14}")
    return total_blocks, cached_total


def run_throughput(c: Client, count: int, nbytes: int) -> None:
    keys = [BlockKey(os.urandom(16)) for _ in range(count)]
    value = os.urandom(nbytes)
    t0 = time.perf_counter()
    for k in keys:
        c.put(k, value)
    t_put = time.perf_counter() - t0
    buf = bytearray(nbytes)
    hits = 0
    t0 = time.perf_counter()
    for k in keys:
        hits += c.get_into(k, buf) == nbytes
    t_get = time.perf_counter() - t0
    misses = sum(v is None for v in c.get_batch([BlockKey(os.urandom(16)) for _ in range(10)]))
    gb = count * nbytes / 1e9
    print(f"\n  {count} blocks of {nbytes >> 20} MiB over '{c.transport}': "
          f"put {gb / t_put:.2f} GB/s ({count / t_put:.0f} ops/s), "
          f"get_into {gb / t_get:.2f} GB/s ({count / t_get:.0f} ops/s); "
          f"{hits} hits, {misses} misses of 10 unknown keys")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvstore.demo")
    p.add_argument("--blocks", type=int, default=300, help="1 MiB blocks for the throughput part")
    p.add_argument("--block-bytes", type=int, default=128 << 10,
                   help="bytes per KV block in the prefix workload")
    p.add_argument("--transport", default="auto", choices=["auto", "grpc", "tcp", "shm"])
    args = p.parse_args(argv)

    port = free_port()
    print("kvstore demo: one node, DRAM tier only, no etcd (the embedded default)")
    proc = start_node(port, "512MiB")
    try:
        with Client(f"127.0.0.1:{port}", transport=args.transport) as c:
            total, cached = run_prefix_workload(c, args.block_bytes)
            print(f"\n  prefix cache: {cached} of {total} blocks were already stored "
                  f"({cached / total:.0%}); every block read back byte-exact")
            run_throughput(c, args.blocks, 1 << 20)
            print("\n" + "\n".join("  " + line for line in
                                   format_stat_table(c.stats()).splitlines()))
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            code = proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            code = proc.wait()
    print(f"\n  node stopped with SIGTERM, exit code {code}")
    return 0 if code == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
