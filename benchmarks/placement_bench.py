"""``python -m benchmarks.placement_bench``: rendezvous placement at cluster scale.

Simulates ``--nodes`` nodes (1,000) and ``--keys`` random 16-byte block keys
(10,000,000; ``--quick`` 1,000,000) twice: every node of weight 1, and weights
drawn from 1..4. For each run it reports

* the base placement's master load per node: max/mean and the coefficient of
  variation (std/mean); for mixed weights the load is divided by the node's
  expected share, so 1.0 is ideal in both runs. Pure sampling noise gives a CV
  of about ``sqrt(N/K)``, printed beside it;
* one node leaving and one node joining: the fraction of keys whose master
  changes, against the ideal ``w / W`` (``1/N`` for equal weights), with the
  binomial z-score of the difference.

How it is computed. A key's score for a node depends on that pair only, so one
pass over all (key, node) hashes yields the masters of all three placements:
with ``S`` the best of the nodes that stay, ``L`` the leaving and ``J`` the joining
node, the master is ``max(S, L)`` before, ``S`` after the leave and
``max(S, L, J)`` after the join. The hash is the spec's XXH3-64 evaluated in numpy
(``replication.placement.rendezvous.xxh3_64_key16``), checked bit for bit against xxhash, and
the masters of a sample of keys are checked against ``Placement.masters_many``
for all six placements. Within a run every node's weight is one of a few values,
and for a fixed weight the score grows with ``h >> 12``, so the best node of each
weight group is found on integers (``h`` with its low 12 bits replaced by
``4095 - column``, which also breaks ties towards the smaller node id) and only
a few logarithms per key are taken. Both runs use the same node ids and keys, so
they share the hashes. Chunks of keys run on ``--threads`` threads (numpy
releases the GIL).

Writes ``benchmarks/results/placement_bench.json`` and ``placement_bench.png``
(load histograms and moved fractions).
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt
import xxhash

from benchmarks.stats import Panel, format_table, plot_panels, write_json
from replication.placement.rendezvous import (
    Member,
    NodeId,
    Placement,
    node_seed,
    split_keys16,
    xxh3_64_key16,
)

RESULTS = Path(__file__).resolve().parent / "results"
FULL_KEYS = 10_000_000
QUICK_KEYS = 1_000_000
U64 = npt.NDArray[np.uint64]
F64 = npt.NDArray[np.float64]

_FLIP1 = np.uint64(0x6782737BEA4239B9)
_FLIP2 = np.uint64(0xAF56BC3B0996523A)
_MX1 = np.uint64(0x165667919E3779F9)
_LO32 = np.uint64(0xFFFFFFFF)
_HIGH52 = np.uint64(~0xFFF & ((1 << 64) - 1))
_LOW12 = np.uint64(0xFFF)
_NODE_BLOCK = 16  # nodes per 2-D block: (block, chunk) temporaries stay in L2


def node_id(i: int) -> NodeId:
    return NodeId(f"node-{i:04d}")


@dataclass(slots=True)
class Scenario:
    """One run: the N base nodes' weights, the leaving column and the joiner's weight.

    Columns ``0..N-1`` are the base nodes and ``N`` the joiner, in node id order.
    """

    name: str
    weights: F64  # (N + 1,), joiner last
    leave: int

    @property
    def n(self) -> int:
        return len(self.weights) - 1

    def members(self, cols: Sequence[int]) -> list[Member]:
        return [Member(node_id=node_id(c), addr=f"10.0.{c // 256}.{c % 256}:7000",
                       weight=float(self.weights[c])) for c in cols]


def _unit(v: U64) -> F64:
    """``u`` of the spec from packed values (the top 52 bits are ``h >> 12``)."""
    u = (v >> np.uint64(12)).astype(np.float64)
    u *= 2.0
    u += 1.0
    u *= 2.0**-53
    return u


class Kernel:
    """All (key, node) hashes of a chunk of keys, reduced to the per-group best nodes."""

    def __init__(self, n_cols: int, groups: Sequence[Sequence[int]], chunk: int) -> None:
        if n_cols > 4095:
            raise ValueError("at most 4095 columns (12 bits of tie-break index)")
        seeds = np.array([node_seed(node_id(c)) for c in range(n_cols)], dtype=np.uint64)
        self.f1 = (_FLIP1 + seeds)[:, None]  # XXH3 9..16-byte bitflips with the node's seed
        self.f2 = (_FLIP2 - seeds)[:, None]
        self.bf1 = self.f1.byteswap()  # bswap(k0 ^ f1) == bswap(k0) ^ bswap(f1)
        self.low = (np.uint64(4095) - np.arange(n_cols, dtype=np.uint64))[:, None]
        self.groups = [np.asarray(g, dtype=np.intp) for g in groups]
        self.chunk = chunk

    def run(self, k0: U64, k1: U64) -> U64:
        """Packed best value of every group for each key: shape (len(groups), len(k0))."""
        c = len(k0)
        k0r, k1r, bk0 = k0[None, :], k1[None, :], k0.byteswap()[None, :]
        bufs = [np.empty((_NODE_BLOCK, c), dtype=np.uint64) for _ in range(8)]
        out = np.empty((len(self.groups), c), dtype=np.uint64)
        for gi, cols in enumerate(self.groups):
            best = out[gi]
            best.fill(0)
            for a in range(0, len(cols), _NODE_BLOCK):
                sel = cols[a:a + _NODE_BLOCK]
                b = len(sel)
                v = self._hash_block(k0r, k1r, bk0, sel, [x[:b] for x in bufs])
                np.maximum(best, v.max(axis=0), out=best)
        return out

    def _hash_block(self, k0: U64, k1: U64, bk0: U64, sel: npt.NDArray[np.intp],
                    bufs: list[U64]) -> U64:
        # xxh3_64 of a 16-byte key (see replication.placement.rendezvous), with out= buffers.
        lo, hi, acc, a0, a1, b0, t, x = bufs
        f1, f2, bf1 = self.f1[sel], self.f2[sel], self.bf1[sel]
        np.bitwise_xor(k0, f1, out=lo)
        np.bitwise_xor(k1, f2, out=hi)
        np.bitwise_xor(bk0, bf1, out=acc)  # bswap(lo)
        np.add(acc, hi, out=acc)
        np.bitwise_and(lo, _LO32, out=a0)
        np.right_shift(lo, np.uint64(32), out=a1)
        np.bitwise_and(hi, _LO32, out=b0)
        np.multiply(a1, b0, out=t)  # t = a1*b0 + (a0*b0 >> 32)
        np.multiply(a0, b0, out=x)
        np.right_shift(x, np.uint64(32), out=x)
        np.add(t, x, out=t)
        np.right_shift(hi, np.uint64(32), out=b0)  # b0 now holds b1
        np.multiply(a0, b0, out=x)  # w = (t & lo32) + a0*b1, kept in a0
        np.bitwise_and(t, _LO32, out=a0)
        np.add(a0, x, out=a0)
        np.multiply(a1, b0, out=x)  # high = a1*b1 + (t >> 32) + (w >> 32)
        np.right_shift(t, np.uint64(32), out=t)
        np.add(x, t, out=x)
        np.right_shift(a0, np.uint64(32), out=a0)
        np.add(x, a0, out=x)
        np.multiply(lo, hi, out=lo)  # low 64 bits of the product
        np.bitwise_xor(x, lo, out=x)  # mul128_fold64
        np.add(acc, x, out=acc)
        np.add(acc, np.uint64(16), out=acc)
        np.right_shift(acc, np.uint64(37), out=x)  # avalanche
        np.bitwise_xor(acc, x, out=acc)
        np.multiply(acc, _MX1, out=acc)
        np.right_shift(acc, np.uint64(32), out=x)
        np.bitwise_xor(acc, x, out=acc)
        np.bitwise_and(acc, _HIGH52, out=acc)  # pack: top 52 bits, then 4095 - column
        np.bitwise_or(acc, self.low[sel], out=acc)
        return acc


def _col(v: U64) -> npt.NDArray[np.intp]:
    return (np.uint64(4095) - (v & _LOW12)).astype(np.intp)


def _beats(s_a: F64, c_a: npt.NDArray[np.intp], s_b: F64, c_b: npt.NDArray[np.intp]
           ) -> npt.NDArray[np.bool_]:
    """Does (score a, column a) rank above (score b, column b)? Ties: smaller column."""
    return (s_a > s_b) | ((s_a == s_b) & (c_a < c_b))


def _masters(sc: Scenario, gw: Sequence[float], best: U64
             ) -> tuple[npt.NDArray[np.intp], npt.NDArray[np.intp], npt.NDArray[np.intp]]:
    """Masters before, after the leave and after the join, from the group bests.

    ``best`` rows: the stay groups (weights ``gw``), then the leaving node, then the joiner.
    """
    ng = len(gw)
    s_stay = -gw[0] / np.log(_unit(best[0]))
    c_stay = _col(best[0])
    for g in range(1, ng):
        s = -gw[g] / np.log(_unit(best[g]))
        c = _col(best[g])
        take = _beats(s, c, s_stay, c_stay)
        s_stay = np.where(take, s, s_stay)
        c_stay = np.where(take, c, c_stay)
    s_l = -float(sc.weights[sc.leave]) / np.log(_unit(best[ng]))
    s_j = -float(sc.weights[sc.n]) / np.log(_unit(best[ng + 1]))
    c_l, c_j = _col(best[ng]), _col(best[ng + 1])
    l_top = _beats(s_l, c_l, s_stay, c_stay)
    s_before = np.where(l_top, s_l, s_stay)
    c_before = np.where(l_top, c_l, c_stay)
    c_join = np.where(_beats(s_j, c_j, s_before, c_before), c_j, c_before)
    return c_before, c_stay, c_join


def _keys(seed: int, chunk_index: int, count: int) -> bytes:
    return np.random.default_rng([seed, chunk_index]).bytes(16 * count)


def simulate(scenarios: Sequence[Scenario], n_keys: int, *, seed: int, chunk: int,
             threads: int) -> dict[str, dict[str, Any]]:
    """Loads and moved counts of every scenario over the same ``n_keys`` keys."""
    n = scenarios[0].n
    leave = scenarios[0].leave
    if any(s.n != n or s.leave != leave for s in scenarios):
        raise ValueError("scenarios must share the node set and the leaving node")
    stay = [c for c in range(n) if c != leave]
    # Groups: every distinct (weight in each scenario) combination of the stay nodes, so
    # each group is one weight per scenario; then the leaving node; then the joiner.
    combos: dict[tuple[float, ...], list[int]] = {}
    for c in stay:
        combos.setdefault(tuple(float(s.weights[c]) for s in scenarios), []).append(c)
    combo_keys = list(combos)
    kernel = Kernel(n + 1, [*combos.values(), [leave], [n]], chunk)

    def one(ci: int) -> list[dict[str, Any]]:
        count = min(chunk, n_keys - ci * chunk)
        k0, k1 = split_keys16(_keys(seed, ci, count))
        best = kernel.run(k0, k1)
        out = []
        for si, sc in enumerate(scenarios):
            before, after_leave, after_join = _masters(
                sc, [ck[si] for ck in combo_keys], best)
            out.append({
                "load": np.bincount(before, minlength=n + 1)[:n],
                "moved_leave": int(np.count_nonzero(before != after_leave)),
                "moved_join": int(np.count_nonzero(before != after_join)),
                "leave_only_from_l": bool(np.all(before[before != after_leave] == leave)),
                "join_only_to_j": bool(np.all(after_join[before != after_join] == n)),
            })
        return out

    n_chunks = math.ceil(n_keys / chunk)
    totals = [{"load": np.zeros(n, dtype=np.int64), "moved_leave": 0, "moved_join": 0,
               "leave_only_from_l": True, "join_only_to_j": True} for _ in scenarios]
    with ThreadPoolExecutor(max_workers=threads) as pool:
        for parts in pool.map(one, range(n_chunks)):
            for tot, part in zip(totals, parts, strict=True):
                tot["load"] += part["load"]
                tot["moved_leave"] += part["moved_leave"]
                tot["moved_join"] += part["moved_join"]
                tot["leave_only_from_l"] &= part["leave_only_from_l"]
                tot["join_only_to_j"] &= part["join_only_to_j"]
    return {sc.name: tot for sc, tot in zip(scenarios, totals, strict=True)}


def verify(scenarios: Sequence[Scenario], seed: int, sample: int) -> int:
    """Checks the kernel against xxhash and ``Placement`` on ``sample`` keys; returns checks."""
    sc0 = scenarios[0]
    n = sc0.n
    raw = _keys(seed, 0, sample)
    keys = [raw[i * 16:(i + 1) * 16] for i in range(sample)]
    k0, k1 = split_keys16(raw)
    cols = list(range(n + 1))
    seeds = np.array([node_seed(node_id(c)) for c in cols[:8]], dtype=np.uint64)
    h = xxh3_64_key16(k0[:64, None], k1[:64, None], seeds)
    for i in range(64):
        for j in range(8):
            if int(h[i, j]) != xxhash.xxh3_64_intdigest(keys[i], seed=int(seeds[j])):
                raise AssertionError("numpy xxh3_64 differs from xxhash")
    kernel = Kernel(n + 1, [[c] for c in cols], sample)
    best = kernel.run(k0, k1)
    checks = 0
    for sc in scenarios:
        stay = [c for c in range(n) if c != sc.leave]
        # Every column its own group: the kernel's masters from scores alone.
        gw = [float(sc.weights[c]) for c in stay]
        rows = np.array([*stay, sc.leave, n])
        before, after_leave, after_join = _masters(sc, gw, best[rows])
        for cols_, got in ((list(range(n)), before), (stay, after_leave),
                           (list(range(n + 1)), after_join)):
            want = Placement(sc.members(cols_)).masters_many(keys)
            if [node_id(int(c)) for c in got] != want:
                raise AssertionError(f"{sc.name}: kernel masters differ from Placement")
            checks += len(keys)
    return checks


def report(sc: Scenario, tot: dict[str, Any], n_keys: int) -> dict[str, Any]:
    n = sc.n
    w = sc.weights[:n]
    total_w = float(w.sum())
    expected = n_keys * w / total_w
    rel = tot["load"] / expected
    w_l, w_j = float(sc.weights[sc.leave]), float(sc.weights[n])
    ideal_leave = w_l / total_w
    ideal_join = w_j / (total_w + w_j)

    def moved(count: int, p: float) -> dict[str, Any]:
        f = count / n_keys
        sd = math.sqrt(p * (1 - p) / n_keys)
        return {"keys": count, "fraction": f, "ideal": p, "ratio": f / p,
                "z": (f - p) / sd, "one_over_n": 1 / n}

    return {
        "nodes": n, "keys": n_keys,
        "weights": {str(k): int(v) for k, v in zip(*np.unique(w, return_counts=True),
                                                    strict=True)},
        "load": {
            "mean_keys": float(tot["load"].mean()), "max_keys": int(tot["load"].max()),
            "min_keys": int(tot["load"].min()),
            "max_over_mean": float(rel.max() / rel.mean()),
            "min_over_mean": float(rel.min() / rel.mean()),
            "cv": float(rel.std() / rel.mean()),
            "noise_cv": math.sqrt(float(np.mean((1 - w / total_w) / expected))),
            "normalised_by_weight": bool(np.any(w != w[0])),
        },
        "leave": {"node": node_id(sc.leave), "weight": w_l,
                  **moved(tot["moved_leave"], ideal_leave),
                  "only_keys_of_leaving_node": tot["leave_only_from_l"]},
        "join": {"node": node_id(n), "weight": w_j, **moved(tot["moved_join"], ideal_join),
                 "only_keys_to_joining_node": tot["join_only_to_j"]},
        "relative_load": rel.tolist(),
    }


def print_tables(runs: dict[str, dict[str, Any]]) -> None:
    rows = []
    for name, r in runs.items():
        for ev in ("leave", "join"):
            e = r[ev]
            rows.append([name, f"{ev} {e['node']} (w={e['weight']:g})", f"{e['keys']:,}",
                         f"{e['fraction']:.6f}", f"{e['ideal']:.6f}", f"{e['ratio']:.4f}",
                         f"{e['z']:+.2f}"])
    print(format_table(["run", "event", "moved keys", "moved frac", "ideal w/W", "ratio",
                        "z"], rows))
    print()
    rows = [[name, f"{r['load']['mean_keys']:,.0f}", f"{r['load']['max_keys']:,}",
             f"{r['load']['max_over_mean']:.4f}", f"{r['load']['min_over_mean']:.4f}",
             f"{r['load']['cv']:.4f}", f"{r['load']['noise_cv']:.4f}"]
            for name, r in runs.items()]
    print(format_table(["run", "mean keys/node", "max keys", "max/mean", "min/mean", "CV",
                        "noise CV"], rows))
    print("(mixed weights: load divided by the node's expected share before max/mean and CV)")
    for name, r in runs.items():
        print(f"{name}: every moved key was the leaving node's: "
              f"{r['leave']['only_keys_of_leaving_node']}; moved to the joiner: "
              f"{r['join']['only_keys_to_joining_node']}")


def plot(path: Path, runs: dict[str, dict[str, Any]]) -> None:
    rels = {name: np.asarray(r["relative_load"]) for name, r in runs.items()}
    lo = min(float(v.min()) for v in rels.values())
    hi = max(float(v.max()) for v in rels.values())
    edges = np.linspace(lo, hi, 31)
    centers = ((edges[:-1] + edges[1:]) / 2).tolist()
    hist = {name: np.histogram(v, bins=edges)[0].astype(float).tolist()
            for name, v in rels.items()}
    events = [f"{name}\n{ev}" for name in runs for ev in ("leave", "join")]
    moved = [runs[name][ev]["fraction"] * 1e3 for name in runs for ev in ("leave", "join")]
    ideal = [runs[name][ev]["ideal"] * 1e3 for name in runs for ev in ("leave", "join")]
    keys = next(iter(runs.values()))["keys"]
    nodes = next(iter(runs.values()))["nodes"]
    plot_panels(path, [
        Panel(title=f"Master load per node ({nodes} nodes, {keys:,} keys)", x=centers,
              series=hist, xlabel="load / expected load (weight share)", ylabel="nodes",
              hlines={}),
        Panel(title="Keys whose master changed", x=list(range(len(events))),
              series={"moved": moved, "ideal w/W": ideal}, kind="bars",
              xticklabels=events, ylabel="per mille of keys"),
    ], title="Weighted rendezvous placement")


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.placement_bench",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--nodes", type=int, default=1000)
    p.add_argument("--keys", type=int, default=FULL_KEYS)
    p.add_argument("--quick", action="store_true", help=f"{QUICK_KEYS:,} keys")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--chunk", type=int, default=4096, help="keys per work item")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--verify-keys", type=int, default=2000,
                   help="keys checked against Placement.masters_many (0: skip)")
    p.add_argument("--out-dir", default=str(RESULTS))
    p.add_argument("--no-files", action="store_true")
    args = p.parse_args(argv)
    n_keys = QUICK_KEYS if args.quick else args.keys
    n = args.nodes
    if n < 2 or n > 4094 or n_keys < 1:
        p.error("need 2..4094 nodes and at least one key")

    rng = np.random.default_rng(args.seed)
    leave = int(rng.integers(n))
    mixed = rng.integers(1, 5, size=n + 1).astype(np.float64)
    scenarios = [Scenario("equal", np.ones(n + 1), leave), Scenario("mixed 1..4", mixed, leave)]

    t0 = time.perf_counter()
    checked = verify(scenarios, args.seed, args.verify_keys) if args.verify_keys else 0
    t_verify = time.perf_counter() - t0
    t0 = time.perf_counter()
    totals = simulate(scenarios, n_keys, seed=args.seed, chunk=args.chunk, threads=args.threads)
    t_sim = time.perf_counter() - t0
    runs = {sc.name: report(sc, totals[sc.name], n_keys) for sc in scenarios}

    print(f"{n:,} nodes, {n_keys:,} keys, {n_keys * (n + 1):,} (key, node) hashes in "
          f"{t_sim:.1f} s on {args.threads} threads "
          f"({t_sim / (n_keys * (n + 1)) * 1e9 * args.threads:.2f} ns per hash per thread)")
    if checked:
        print(f"verified: masters of {checked:,} (placement, key) pairs equal "
              f"Placement.masters_many ({t_verify:.1f} s)")
    print()
    print_tables(runs)
    result = {
        "command": "python -m benchmarks.placement_bench " + " ".join(argv or sys.argv[1:]),
        "nodes": n, "keys": n_keys, "seed": args.seed, "threads": args.threads,
        "seconds": t_sim, "verified_pairs": checked, "runs": runs,
    }
    if not args.no_files:
        out = Path(args.out_dir)
        write_json(out / "placement_bench.json", result)
        plot(out / "placement_bench.png", runs)
        print(f"\nwrote {out / 'placement_bench.json'} and {out / 'placement_bench.png'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
