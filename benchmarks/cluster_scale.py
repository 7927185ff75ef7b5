"""``python -m benchmarks.cluster_scale``: a 100-node cluster of 1 billion blocks, on paper
and by simulation with the real placement code.

* **Paper**: with rendezvous placement a key's owners for ``R`` replicas are its ``R``
  top-ranked nodes (one zone), so a node holds ``R/N`` of the copies; when it leaves,
  each of its copies gets one new owner (the next-ranked node) and nothing else moves:
  ``R * B / N`` copies, ``B / N`` of them the keys it mastered. Repair copies each from
  the surviving owner that ranks first (``replication/copies/repair.py``), so about
  ``N - 1`` nodes push in parallel, each throttled to ``repair_bytes_per_s``
  (``NodeConfig``, default 100 MiB/s per node): the time is the busiest pusher's bytes
  over that cap.
* **Simulation**: ``replication.placement.rendezvous.Placement`` of ``N`` members (ids
  ``node-000``...) places a sample of random 16-byte keys before and after one node
  leaves (and, separately, after one joins); the counts per sampled key are scaled to
  ``B`` keys. It also tallies who pushes each new copy (repair's rule) and who receives
  it, so the busiest pusher is measured, not assumed, and times ``owners_many`` to show
  what placing every held key costs a repair pass (each node places all ``R * B / N`` of
  its keys, and asks the other owners which they lack, every pass).
* **etcd**: a real small cluster (``LocalCluster``: etcd and ``--etcd-nodes`` nodes) is
  started, every key in etcd is listed through its HTTP gateway, blocks are put through a
  ``ClusterClient``, and etcd is listed again: it holds one key (and one lease) per
  member and nothing per block, so at ``N`` nodes it holds ``N`` keys of about the same
  size, whatever ``B`` is.

Writes ``results/cluster_scale.json``. ``--quick``: a smaller sample; ``--etcd-nodes 0``
skips the real cluster.
"""

from __future__ import annotations

import argparse
import base64
import json
import math
import random
import sys
import tempfile
import time
import urllib.request
from collections import Counter
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import write_json
from kvstore.core.sizes import format_size, parse_size
from kvstore.node.config import NodeConfig
from replication.placement.rendezvous import Member, NodeId, Placement

NODES = 100
BLOCKS = 1_000_000_000
SAMPLE = 400_000
QUICK_SAMPLE = 40_000
BLOCK_BYTES = 64 << 10
ETCD_NODES = 3
ETCD_BLOCKS = 2_000
RESULTS = Path(__file__).resolve().parent / "results"


def members(n: int, *, first: int = 0) -> list[Member]:
    return [Member(node_id=NodeId(f"node-{i:03d}"), addr=f"10.0.{i // 256}.{i % 256}:7600")
            for i in range(first, first + n)]


# ---- paper -----------------------------------------------------------------------------------


def paper(*, nodes: int, blocks: int, replicas: int, block_bytes: int,
          repair_bytes_per_s: int) -> dict[str, float]:
    """What one node leaving costs, from the placement's rules alone (equal weights)."""
    if nodes < 2 or replicas < 1 or blocks < 0 or block_bytes < 1 or repair_bytes_per_s < 1:
        raise ValueError("need nodes >= 2, replicas >= 1, blocks >= 0, positive sizes")
    r = min(replicas, nodes)
    copies = r * blocks / nodes  # the copies the node held, each re-made once
    per_pusher = copies / (nodes - 1)  # the surviving owners share the pushes evenly
    return {"copies_held_per_node": copies, "copies_moved": copies,
            "fraction_of_copies_moved": 1 / nodes, "masters_moved": blocks / nodes,
            "bytes_moved": copies * block_bytes,
            "pushes_per_node": per_pusher,
            "repair_seconds": per_pusher * block_bytes / repair_bytes_per_s}


# ---- simulation ------------------------------------------------------------------------------


def _owner_sets(placement: Placement, keys: list[bytes], replicas: int) -> list[list[NodeId]]:
    return placement.owners_many(keys, replicas)


def simulate(*, nodes: int, blocks: int, replicas: int, block_bytes: int,
             repair_bytes_per_s: int, sample: int, seed: int = 0) -> dict[str, Any]:
    """One node leaves, and separately one joins, over ``sample`` random keys scaled up."""
    rng = random.Random(seed)
    keys = [rng.randbytes(16) for _ in range(sample)]
    view = members(nodes)
    before = Placement(view)
    t0 = time.thread_time()  # CPU time: the machine is shared, wall time is not ours
    old = _owner_sets(before, keys, replicas)
    place_s = time.thread_time() - t0
    leaving = view[rng.randrange(nodes)].node_id
    after = Placement([m for m in view if m.node_id != leaving])
    new = _owner_sets(after, keys, replicas)
    scale = blocks / sample
    moved = masters = 0
    pushers: Counter[NodeId] = Counter()
    receivers: Counter[NodeId] = Counter()
    for o, n in zip(old, new, strict=True):
        if o[0] != n[0]:
            masters += 1
        gained = [x for x in n if x not in o]
        if not gained:
            continue
        moved += len(gained)
        pusher = next(x for x in n if x in o)  # repair: the first owner that holds it
        pushers[pusher] += len(gained)
        for x in gained:
            receivers[x] += 1
    joining = members(1, first=nodes)[0]
    grown = _owner_sets(Placement([*view, joining]), keys, replicas)
    joined = sum(1 for o, n in zip(old, grown, strict=True) if joining.node_id in n
                 and joining.node_id not in o)
    # The sample's busiest pusher overstates the real one: with ~40 sampled pushes each,
    # Poisson noise alone spreads them by +-15%. At full scale each pushes ~200,000, so
    # the busiest is the mean plus a few standard deviations (sqrt(mean)): 3 are used.
    # ``pusher_dispersion`` (variance / mean of the sampled counts) near 1 says the
    # spread seen is that noise and nothing systematic.
    counts = [pushers[m.node_id] for m in view if m.node_id != leaving]
    mean = sum(counts) / len(counts)
    dispersion = sum((c - mean) ** 2 for c in counts) / len(counts) / mean if mean else 0.0
    full_mean = mean * scale
    busiest = full_mean + 3 * math.sqrt(full_mean)
    held = sum(1 for o in old if leaving in o)
    p = moved / sample
    return {
        "sample_keys": sample, "leaving": leaving,
        "copies_held_by_leaving": held * scale,
        "copies_moved": moved * scale,
        "copies_moved_stderr": math.sqrt(p * (1 - p) / sample) * blocks,
        "fraction_of_copies_moved": moved / (sample * min(replicas, nodes)),
        "masters_moved": masters * scale,
        "bytes_moved": moved * scale * block_bytes,
        "pushers": len(pushers), "receivers": len(receivers),
        "busiest_pusher_copies": busiest,
        "busiest_pusher_copies_in_sample_scaled": max(counts) * scale,
        "pusher_dispersion": dispersion,
        "mean_pusher_copies": full_mean,
        "busiest_receiver_copies": max(receivers.values(), default=0) * scale,
        "repair_seconds_busiest": busiest * block_bytes / repair_bytes_per_s,
        "join_copies_to_new_node": joined * scale,
        "placement_keys_per_s": sample / place_s,
        "pass_placement_seconds_per_node": min(replicas, nodes) * blocks / nodes
        / (sample / place_s),
        "pass_exists_keys_per_node": (min(replicas, nodes) - 1) * min(replicas, nodes)
        * blocks / nodes,
    }


# ---- etcd: what a real small cluster writes ----------------------------------------------------


def etcd_keys(endpoint: str) -> dict[str, Any]:
    """Every key etcd holds (names and value sizes), its revision and its leases."""
    def call(path: str, body: dict[str, Any]) -> dict[str, Any]:
        req = urllib.request.Request(f"http://{endpoint}{path}", data=json.dumps(body).encode(),
                                     headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=10) as reply:
            out: dict[str, Any] = json.loads(reply.read())
            return out

    zero = base64.b64encode(b"\0").decode()
    listing = call("/v3/kv/range", {"key": zero, "range_end": zero})
    kvs = listing.get("kvs", [])
    leases = call("/v3/lease/leases", {}).get("leases", [])
    return {"keys": [base64.b64decode(kv["key"]).decode(errors="replace") for kv in kvs],
            "value_bytes": sum(len(base64.b64decode(kv.get("value", ""))) for kv in kvs),
            "key_bytes": sum(len(base64.b64decode(kv["key"])) for kv in kvs),
            "revision": int(listing["header"]["revision"]), "leases": len(leases)}


def etcd_census(n_nodes: int, n_blocks: int, *, replicas: int) -> dict[str, Any]:
    """etcd's contents with ``n_nodes`` real nodes, before and after ``n_blocks`` puts."""
    from replication.cluster_client import ClusterClient
    from replication.local_cluster import LocalCluster

    with tempfile.TemporaryDirectory(prefix="kvstore-cluster-scale-") as tmp:
        cluster = LocalCluster.up(Path(tmp) / "c", n_nodes, node_args=[
            "--dram-bytes", "64MiB", "--no-prefault", "--replicas", str(replicas)])
        try:
            empty = etcd_keys(cluster.etcd)
            rng = random.Random(1)
            keys = [rng.randbytes(16) for _ in range(n_blocks)]
            with ClusterClient(etcd=cluster.etcd, replicas=replicas) as client:
                for lo in range(0, n_blocks, 100):
                    client.put_batch(keys[lo:lo + 100], [b"x" * 4096] * len(keys[lo:lo + 100]))
                assert all(client.exists(keys))
            full = etcd_keys(cluster.etcd)
        finally:
            cluster.down(timeout=20)
    return {"nodes": n_nodes, "blocks_put": n_blocks, "before": empty, "after": full,
            "keys_per_member": len(full["keys"]) / n_nodes,
            "bytes_per_member": (full["key_bytes"] + full["value_bytes"]) / n_nodes,
            "keys_added_by_blocks": len(full["keys"]) - len(empty["keys"]),
            "revisions_added_by_blocks": full["revision"] - empty["revision"]}


def extrapolate(census: dict[str, Any], nodes: int) -> dict[str, float]:
    return {"nodes": nodes, "keys": census["keys_per_member"] * nodes,
            "bytes": census["bytes_per_member"] * nodes,
            "leases": census["after"]["leases"] / census["nodes"] * nodes,
            "keys_per_block": census["keys_added_by_blocks"] / max(1, census["blocks_put"])}


# ---- output ------------------------------------------------------------------------------------


def format_report(result: dict[str, Any]) -> str:
    pp, sim, a = result["paper"], result["simulation"], result["args"]
    rate = a["repair_bytes_per_s"]
    lines = [
        f"{a['nodes']} nodes, {a['blocks']:,} blocks of {format_size(a['block_bytes'])}, "
        f"{a['replicas']} replicas, repair cap {format_size(rate)}/s per node "
        f"(sample of {sim['sample_keys']:,} keys, {sim['leaving']} leaves)",
        "",
        f"{'one node leaves':<44} {'paper':>16} {'simulated':>16}",
        f"{'copies it held':<44} {pp['copies_held_per_node']:>16,.0f} "
        f"{sim['copies_held_by_leaving']:>16,.0f}",
        f"{'copies repair makes':<44} {pp['copies_moved']:>16,.0f} "
        f"{sim['copies_moved']:>16,.0f}",
        f"{'  share of all copies':<44} {pp['fraction_of_copies_moved']:>16.4f} "
        f"{sim['fraction_of_copies_moved']:>16.4f}",
        f"{'keys whose master changes':<44} {pp['masters_moved']:>16,.0f} "
        f"{sim['masters_moved']:>16,.0f}",
        f"{'bytes copied':<44} {format_size(int(pp['bytes_moved'])):>16} "
        f"{format_size(int(sim['bytes_moved'])):>16}",
        f"{'copies pushed per node (mean)':<44} {pp['pushes_per_node']:>16,.0f} "
        f"{sim['mean_pusher_copies']:>16,.0f}",
        f"{'  by the busiest (mean + 3 sqrt(mean))':<44} {'':>16} "
        f"{sim['busiest_pusher_copies']:>16,.0f}",
        f"{'repair time at the cap (busiest pusher)':<44} {pp['repair_seconds']:>15,.0f}s "
        f"{sim['repair_seconds_busiest']:>15,.0f}s",
        f"{'nodes pushing / receiving':<44} {a['nodes'] - 1:>16} "
        f"{sim['pushers']:>7} / {sim['receivers']:<6}",
        f"{'pushes per node: variance / mean (1: noise)':<44} {'':>16} "
        f"{sim['pusher_dispersion']:>16.2f}",
        "",
        f"one node joins: {sim['join_copies_to_new_node']:,.0f} copies move to it "
        f"(paper {a['replicas'] * a['blocks'] / (a['nodes'] + 1):,.0f})",
        f"a repair pass per node: places {a['replicas'] * a['blocks'] / a['nodes']:,.0f} keys "
        f"({sim['placement_keys_per_s']:,.0f} keys/s of one core's CPU here: "
        f"{sim['pass_placement_seconds_per_node']:,.0f} s of CPU) and asks other owners "
        f"about {sim['pass_exists_keys_per_node']:,.0f}",
    ]
    census = result.get("etcd")
    if census is not None:
        ex = result["etcd_at_scale"]
        lines += [
            "",
            f"etcd with {census['nodes']} real nodes: {len(census['after']['keys'])} keys "
            f"({', '.join(census['after']['keys'])}), {census['after']['leases']} leases; "
            f"after {census['blocks_put']:,} blocks put: {census['keys_added_by_blocks']} keys "
            f"and {census['revisions_added_by_blocks']} revisions added",
            f"etcd at {ex['nodes']} nodes: {ex['keys']:,.0f} keys, {ex['leases']:,.0f} leases, "
            f"{format_size(int(ex['bytes']))}, {ex['keys_per_block']:.0f} keys per block "
            f"(so the same at {a['blocks']:,} blocks)",
        ]
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m benchmarks.cluster_scale", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    defaults = NodeConfig()
    p.add_argument("--nodes", type=int, default=NODES)
    p.add_argument("--blocks", type=lambda t: int(float(t)), default=BLOCKS)
    p.add_argument("--replicas", type=int, default=defaults.replicas)
    p.add_argument("--block-bytes", type=parse_size, default=BLOCK_BYTES)
    p.add_argument("--repair-bytes-per-s", type=parse_size,
                   default=defaults.repair_bytes_per_s,
                   help="the repair cap per node (default: NodeConfig's, 100MiB)")
    p.add_argument("--sample", type=int, help=f"keys placed (default {SAMPLE:,})")
    p.add_argument("--etcd-nodes", type=int, default=ETCD_NODES,
                   help="real nodes whose etcd keys are counted (0: skip)")
    p.add_argument("--quick", action="store_true", help="a smaller sample")
    p.add_argument("--out", type=Path, default=RESULTS / "cluster_scale.json")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    p = build_parser()
    args = p.parse_args(argv)
    if args.nodes < 2 or args.replicas < 1 or args.blocks < 1:
        p.error("need --nodes >= 2, --replicas >= 1 and --blocks >= 1")
    sample = args.sample or (QUICK_SAMPLE if args.quick else SAMPLE)
    common = {"nodes": args.nodes, "blocks": args.blocks, "replicas": args.replicas,
              "block_bytes": args.block_bytes, "repair_bytes_per_s": args.repair_bytes_per_s}
    result: dict[str, Any] = {"args": common, "paper": paper(**common),
                              "simulation": simulate(**common, sample=sample)}
    if args.etcd_nodes:
        census = etcd_census(args.etcd_nodes, ETCD_BLOCKS // (10 if args.quick else 1),
                             replicas=min(args.replicas, args.etcd_nodes))
        result["etcd"] = census
        result["etcd_at_scale"] = extrapolate(census, args.nodes)
    print(format_report(result))
    result["command"] = "python -m benchmarks.cluster_scale " + " ".join(
        sys.argv[1:] if argv is None else argv)
    write_json(args.out, result)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
