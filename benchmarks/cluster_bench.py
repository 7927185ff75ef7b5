"""``kvstore bench cluster``: a real 3-node cluster on loopback (etcd + node processes).

Three parts, each against a peer or a limit measured in the same run:

* **throughput**: batches of 32 x 64 KiB and 32 x 1 MiB, put and get, through the
  cluster client with ``replicas=1`` and ``replicas=2, write_quorum=2``, beside the
  same calls on one node through a plain ``Client`` (the single-node peer), each
  with ``transport="tcp"`` (bytes cross the socket, as for a client on another host)
  and the default transport (same-host shared memory here). Rounds alternate the
  three clients; a ratio is the median of per-round ratios to one node. Targets:
  ``replicas=1`` >= 0.8 both ways; ``replicas=2`` get >= 0.8, put >= 0.4 (every byte
  of a replicated put is copied twice by processes sharing two cores: 0.5 is the
  ceiling here).
* **repair**: ``--repair-blocks`` (10,000) blocks of 64 KiB stored with two
  copies; one node is killed with SIGKILL; reported: the time until membership
  drops it (the lease TTL), the time until every block has two copies again,
  and repair throughput against the configured ``--repair-bytes-per-s`` cap.
* **fan-out**: Zipf(1.1) reads over 1,000 keys with ``replicas=1``; per-node
  reads (the nodes' own hit counters) as max/mean, without and with hot-block
  fan-out. 1.0 is a perfectly even load.

Writes ``benchmarks/results/cluster_bench.json`` and ``cluster_bench.png``.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.stats import (
    Panel,
    format_table,
    median,
    plot_panels,
    progress,
    size_label,
    write_json,
)
from kvstore.client import Client
from kvstore.core.sizes import parse_size
from replication.cluster_client import ClusterClient
from replication.local_cluster import LocalCluster

RESULTS = Path(__file__).resolve().parent / "results"
BATCH = 32


def _keys(tag: int, n: int) -> list[bytes]:
    return [tag.to_bytes(4, "big") + i.to_bytes(12, "big") for i in range(n)]


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _batched(keys: list[bytes], fn: Callable[[list[bytes]], object]) -> None:
    for lo in range(0, len(keys), BATCH):
        fn(keys[lo : lo + BATCH])


def _cpu_s(pids: Sequence[int]) -> float:
    """CPU seconds (user + system) used so far by this process and the node processes."""
    tick = os.sysconf("SC_CLK_TCK")
    total = sum(os.times()[:2])
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += (int(fields[11]) + int(fields[12])) / tick  # utime, stime
    return total


def _put_all(c: Any, keys: list[bytes], value: bytes) -> float:
    return _timed(lambda: _batched(keys, lambda ks: c.put_batch(ks, [value] * len(ks))))


def _get_all(c: Any, keys: list[bytes], bufs: list[bytearray]) -> float:
    return _timed(lambda: _batched(keys, lambda ks: c.get_batch_into(ks, bufs[: len(ks)])))


TRANSPORTS = ("tcp", "auto")
# (put, get) against one node: issue 27's (replicas=1 both 0.9; replicas=2 put 0.45, the
# ceiling of two copies on two shared cores being 0.5), and issue 13's 0.8 for a replicated get.
TARGETS = {"cluster r=1": (0.9, 0.9), "cluster r=2 w=2": (0.45, 0.8)}


def throughput(cluster: LocalCluster, sizes: Sequence[int], total: int, rounds: int, *,
               transports: Sequence[str] = TRANSPORTS, unpipelined: bool = False
               ) -> list[dict[str, Any]]:
    """Per transport and block size: one node, then the cluster with ``replicas=1`` and with
    ``replicas=2, write_quorum=2``, in alternated rounds (each round runs all three on
    fresh keys); ratios are medians of the per-round ratios to the round's one node."""
    rows = []
    tag = 1
    pids = [rec.pid for rec in cluster.nodes]
    for transport in transports:
        clients: dict[str, Any] = {
            "single node": Client(cluster.nodes[0].addr, transport=transport),
            "cluster r=1": Client(etcd=cluster.etcd, replicas=1, transport=transport),
            "cluster r=2 w=2": Client(etcd=cluster.etcd, replicas=2, write_quorum=2,
                                      transport=transport),
        }
        if unpipelined:  # the same clients with a thread per master (puts before pipelining)
            clients |= {
                f"{name} unpipelined": Client(etcd=cluster.etcd, replicas=r, write_quorum=r,
                                              transport=transport, pipeline=False)
                for name, r in (("cluster r=1", 1), ("cluster r=2 w=2", 2))}
        try:
            for size in sizes:
                n = max(BATCH, total // size)
                value = os.urandom(size)
                bufs = [bytearray(size) for _ in range(BATCH)]
                puts: dict[str, list[float]] = {name: [] for name in clients}
                gets: dict[str, list[float]] = {name: [] for name in clients}
                # CPU time of every process involved: what a byte costs, whoever's core
                # runs it; the machine's other load moves it far less than wall time.
                cpu = {name: [0.0, 0.0] for name in clients}
                for _ in range(rounds):
                    for name, c in clients.items():
                        keys = _keys(tag, n)
                        tag += 1
                        c0 = _cpu_s(pids)
                        puts[name].append(_put_all(c, keys, value))
                        c1 = _cpu_s(pids)
                        gets[name].append(_get_all(c, keys, bufs))
                        c2 = _cpu_s(pids)
                        cpu[name][0] += c1 - c0
                        cpu[name][1] += c2 - c1
                        for k in keys:  # keep memory bounded between rounds
                            c.remove(k)
                base_p, base_g = puts["single node"], gets["single node"]
                for name in clients:
                    row: dict[str, Any]
                    row = {"transport": transport, "size": size, "client": name, "blocks": n,
                           "rounds": rounds,
                           "put_gbps": n * size / median(puts[name]) / 1e9,
                           "get_gbps": n * size / median(gets[name]) / 1e9,
                           # time ratios inverted: throughput relative to one node
                           "put_vs_single": median([b / t for b, t in
                                                    zip(base_p, puts[name], strict=True)]),
                           "get_vs_single": median([b / t for b, t in
                                                    zip(base_g, gets[name], strict=True)]),
                           "put_cpu_ms_per_mib": cpu[name][0] * 1e3 / (rounds * n * size / 2**20),
                           "get_cpu_ms_per_mib": cpu[name][1] * 1e3 / (rounds * n * size / 2**20)}
                    if name in TARGETS:
                        put_t, get_t = TARGETS[name]
                        row |= {"put_target": put_t, "get_target": get_t,
                                "meets_target": row["put_vs_single"] >= put_t
                                and row["get_vs_single"] >= get_t}
                    rows.append(row)
        finally:
            for c in clients.values():
                c.close()
    return rows


def _copies(cluster: LocalCluster, keys: list[bytes], skip: str) -> np.ndarray:
    counts = np.zeros(len(keys), dtype=np.int64)
    for rec in cluster.nodes:
        if rec.id == skip:
            continue
        with Client(rec.addr, transport="grpc") as c:
            for lo in range(0, len(keys), 4096):
                counts[lo : lo + 4096] += np.array(c.exists(keys[lo : lo + 4096]), dtype=bool)
    return counts


def repair(directory: Path, blocks: int, rate: int, ttl: int) -> dict[str, Any]:
    args = ["--dram-bytes", "1GiB", "--no-prefault", "--lease-ttl", str(ttl),
            "--replicas", "2", "--repair-bytes-per-s", str(rate)]
    cluster = LocalCluster.up(directory, 3, node_args=args)
    try:
        keys = _keys(99, blocks)
        value = os.urandom(64 << 10)
        with Client(etcd=cluster.etcd, replicas=2, write_quorum=2) as c:
            _batched(keys, lambda ks: c.put_batch(ks, [value] * len(ks)))
            victim = cluster.node("node-3")
            lost = int((_copies(cluster, keys, "") == 2).sum() - (
                _copies(cluster, keys, "node-3") == 2).sum())
            os.kill(victim.pid, signal.SIGKILL)
            t0 = time.monotonic()
            while "node-3" in {m.node_id for m in c.members()}:
                time.sleep(0.05)
            detected = time.monotonic() - t0
            while (_copies(cluster, keys, "node-3") < 2).any():
                time.sleep(0.1)
            repaired = time.monotonic() - t0
            stats = {nid: s["node"] for nid, s in c.stats().items()}
    finally:
        cluster.down(timeout=10)
    moved = sum(int(s.get("repaired_bytes", 0)) for s in stats.values())
    copy_s = max(repaired - detected, 1e-9)
    return {"blocks": blocks, "block_bytes": 64 << 10, "lease_ttl_s": ttl,
            "blocks_that_lost_a_copy": lost, "detect_s": detected, "repaired_s": repaired,
            "repair_copy_s": copy_s, "repaired_bytes": moved,
            "repair_bytes_per_s": moved / copy_s, "cap_bytes_per_s_per_node": rate,
            "vs_cap": moved / copy_s / (2 * rate)}


def fanout(cluster: LocalCluster, reads: int, keys_n: int, hot_rate: float
           ) -> dict[str, Any]:
    keys = _keys(7, keys_n)
    value = os.urandom(16 << 10)
    rng = np.random.default_rng(11)
    p = 1.0 / np.arange(1, keys_n + 1) ** 1.1
    p /= p.sum()
    out = {}
    with Client(etcd=cluster.etcd, replicas=1) as writer:
        _batched(keys, lambda ks: writer.put_batch(ks, [value] * len(ks)))
    for label, hot in (("without fan-out", None), ("with fan-out", hot_rate)):
        with Client(etcd=cluster.etcd, replicas=1, hot_reads_per_s=hot, fanout=2) as c:
            order = rng.choice(keys_n, size=reads, p=p)
            warm = order[: reads // 3]
            _batched([keys[i] for i in warm], c.get_batch)  # lets hot keys fan out
            time.sleep(0.5)
            before = _hits(c)
            _batched([keys[i] for i in order[reads // 3 :]], c.get_batch)
            after = _hits(c)
            load = np.array([after[n] - before[n] for n in sorted(after)], dtype=float)
            out[label] = {"reads_per_node": load.tolist(),
                          "max_over_mean": float(load.max() / load.mean()),
                          "fanned_keys": len(c.fanned_out()) if isinstance(c, ClusterClient)
                          else 0}
    return out


def _hits(c: Any) -> dict[str, int]:
    return {n: sum(t["hits"] for t in s["tiers"].values()) for n, s in c.stats().items()}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench cluster", description=__doc__.split("\n")[0]
                                if __doc__ else None)
    p.add_argument("--quick", action="store_true", help="smaller runs (a smoke test)")
    p.add_argument("--repair-blocks", type=int, default=10_000)
    p.add_argument("--repair-bytes-per-s", type=int, default=200 << 20,
                   help="repair cap per node (default 200 MiB/s)")
    p.add_argument("--lease-ttl", type=int, default=3)
    p.add_argument("--rounds", type=int, default=5,
                   help="alternated throughput rounds (default 5)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--parts", default="throughput,fanout,repair",
                   help="which parts to run, comma-separated (default all three)")
    p.add_argument("--transports", default=",".join(TRANSPORTS),
                   help="throughput's transports, comma-separated (tcp, auto)")
    p.add_argument("--sizes", default="64KiB,1MiB",
                   help="throughput's block sizes, comma-separated (default 64KiB,1MiB)")
    p.add_argument("--unpipelined", action="store_true",
                   help="throughput also runs the cluster clients with pipeline=False (a "
                        "thread per master): the same rounds, before and after pipelining")
    args = p.parse_args(argv)
    parts = {x for x in args.parts.split(",") if x}
    transports = [t for t in args.transports.split(",") if t]
    if not parts or parts - {"throughput", "fanout", "repair"}:
        p.error(f"--parts: choose from throughput, fanout, repair; got {args.parts!r}")
    if not transports or set(transports) - set(TRANSPORTS):
        p.error(f"--transports: choose from {', '.join(TRANSPORTS)}; got {args.transports!r}")
    quick = args.quick
    try:
        sizes = [parse_size(x) for x in args.sizes.split(",") if x]
    except ValueError as exc:
        p.error(f"--sizes: {exc}")
    if not sizes or min(sizes) <= 0:
        p.error(f"--sizes: give sizes above 0; got {args.sizes!r}")
    total = (16 << 20) if quick else (128 << 20)
    rounds = 1 if quick else args.rounds
    blocks = 500 if quick else args.repair_blocks
    result: dict[str, Any] = {"command": "kvstore bench cluster " + " ".join(argv or [])}
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-cluster-") as tmp:
        cluster = LocalCluster.up(Path(tmp) / "main", 3,
                                  node_args=["--dram-bytes", "1GiB", "--no-prefault"])
        bar = progress(len(parts), "cluster bench", unit="part")
        try:
            if "throughput" in parts:
                print("throughput ...", flush=True)
                result["throughput"] = throughput(cluster, sizes, total, rounds,
                                                  transports=transports,
                                                  unpipelined=args.unpipelined)
                bar.update()
            if "fanout" in parts:
                print("fan-out ...", flush=True)
                result["fanout"] = fanout(cluster, 3000 if quick else 30_000, 1000, 50.0)
                bar.update()
        finally:
            cluster.down(timeout=10)
        if "repair" in parts:
            print("repair ...", flush=True)
            result["repair"] = repair(Path(tmp) / "repair", blocks, args.repair_bytes_per_s,
                                      args.lease_ttl)
            bar.update()
        bar.close()
    report(result)
    if args.out_dir:
        out = Path(args.out_dir)
        write_json(out / "cluster_bench.json", result)
        if len(parts) == 3:  # the plot shows every part
            plot(result, out / "cluster_bench.png")
        print(f"\nwrote {out / 'cluster_bench.json'}")
    return 0


def report(result: dict[str, Any]) -> None:
    if "throughput" in result:
        report_throughput(result)
    if "fanout" in result:
        report_fanout(result)
    if "repair" in result:
        report_repair(result)


def report_throughput(result: dict[str, Any]) -> None:
    rows = [[r["transport"], r["client"], size_label(r["size"]), r["put_gbps"],
             r["put_vs_single"], r["put_cpu_ms_per_mib"], r["get_gbps"], r["get_vs_single"],
             r["get_cpu_ms_per_mib"],
             "" if "meets_target" not in r else
             f"{'yes' if r['meets_target'] else 'NO'} (>= {r['put_target']}/{r['get_target']})"]
            for r in result["throughput"]]
    print("\nthroughput (GB/s; ratio to one node: median of per-round ratios)")
    print(format_table(["transport", "client", "block", "put GB/s", "put ratio",
                        "put CPU ms/MiB", "get GB/s", "get ratio", "get CPU ms/MiB",
                        "meets target (put/get)"], rows))


def report_fanout(result: dict[str, Any]) -> None:
    f = result["fanout"]
    print("\nZipf(1.1) reads, replicas=1: per-node reads max/mean (1.0 is even)")
    print(format_table(["", "max/mean", "reads per node", "hot keys fanned out"],
                       [[k, v["max_over_mean"], " ".join(f"{x:.0f}" for x in v["reads_per_node"]),
                         v["fanned_keys"]] for k, v in f.items()]))


def report_repair(result: dict[str, Any]) -> None:
    r = result["repair"]
    print(f"\nrepair after kill -9 of 1 of 3 nodes: {r['blocks']:,} blocks x 64 KiB, "
          f"{r['blocks_that_lost_a_copy']:,} lost a copy")
    print(format_table(["membership drop", "two copies again", "copying", "repair MB/s",
                        "vs cap (2 senders)"],
                       [[f"{r['detect_s']:.2f} s", f"{r['repaired_s']:.2f} s",
                         f"{r['repair_copy_s']:.2f} s", r["repair_bytes_per_s"] / 1e6,
                         r["vs_cap"]]]))


def plot(result: dict[str, Any], path: Path) -> None:
    tp = [r for r in result["throughput"] if r["transport"] == "tcp"]
    clients = list(dict.fromkeys(r["client"] for r in tp))
    sizes = sorted({r["size"] for r in tp})

    def series(field: str) -> dict[str, list[float | None]]:
        return {c: [next(r[field] for r in tp if r["client"] == c and r["size"] == s)
                    for s in sizes] for c in clients}

    f = result["fanout"]
    panels = [
        Panel(title="put GB/s (tcp)", x=[size_label(s) for s in sizes], series=series("put_gbps"),
              kind="bars"),
        Panel(title="get GB/s (tcp)", x=[size_label(s) for s in sizes], series=series("get_gbps"),
              kind="bars"),
        Panel(title="Zipf(1.1) reads per node", x=[f"node {i + 1}" for i in range(3)],
              series={k: v["reads_per_node"] for k, v in f.items()}, kind="bars"),
    ]
    plot_panels(path, panels, title="kvstore bench cluster (3 local nodes)", ncols=3)


if __name__ == "__main__":
    sys.exit(main())
