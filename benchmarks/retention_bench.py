"""``python -m benchmarks.retention_bench``: what retention costs the tier index.

A ``TierManager`` over a metadata-only tier (the real index, queues and policy, no
bytes: what a node does under its lock) of ``--blocks`` blocks (100,000) is filled,
the oldest fraction ``f`` of them put with ``retain_s`` (so LRU would evict them
first), then timed:

* **puts under pressure**: ``--puts`` new blocks, each one evicting one victim;
  every eviction round meets the retained blocks at the head of the LRU queue;
* **reads**: read leases (acquire + release) over the stored blocks in random order,
  where reads of retained blocks also restart their retention.

Times are this thread's CPU time (``time.thread_time``), not wall time: the index is pure
Python under one lock, and on a machine shared with other work CPU time is what stays
comparable between cells. Each cell is the median of ``--rounds`` (5) rounds that
interleave the fractions; the ratio is the median per-round ratio to ``f = 0`` (the
same index without retention).
The eviction queue drops a retained block the first time a round meets it and takes it
back when its retention ends (``tiers.retention``), so a put's cost should not grow
with the number of retained blocks (a queue that deferred them would re-scan them all
on every put).

Writes ``benchmarks/results/retention_bench.json`` and ``retention_bench.png``.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import Panel, format_table, plot_panels, write_json
from kvstore.core.keys import BlockKey
from tiers.manager import TierManager, Watermarks
from tiers.metadata import MetadataTier
from tiers.policy import make_policy
from tiers.retention import RetainAsk, RetentionBook

RESULTS = Path(__file__).resolve().parent / "results"
B = 64
FRACTIONS = (0.0, 0.1, 0.25, 0.5)


class _Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _key(i: int) -> BlockKey:
    return BlockKey(i.to_bytes(16, "little"))


def _put(m: TierManager, key: BlockKey, ask: RetainAsk | None) -> None:
    r = m.reserve(key, B, retain=ask)
    assert r is not None
    m.commit(r)
    m.drain_evicted()


def one_round(blocks: int, puts: int, reads: int, fraction: float, seed: int
              ) -> dict[str, float]:
    clock = _Clock()
    m = TierManager(MetadataTier(blocks * B, alignment=B), make_policy("lru"), landing=0,
                    watermarks=Watermarks(high=1.0, low=1.0),
                    retention=RetentionBook(clock=clock))
    ask = RetainAsk(seconds=3600.0)
    kept = int(blocks * fraction)
    for i in range(blocks):
        _put(m, _key(i), ask if i < kept else None)
    t0 = time.thread_time()
    for i in range(blocks, blocks + puts):
        _put(m, _key(i), None)
    put_s = time.thread_time() - t0
    assert m.retention.stats()["retained_blocks"] == kept  # no retained block left
    live = m.keys()
    order = [live[j] for j in random.Random(seed).choices(range(len(live)), k=reads)]
    t0 = time.thread_time()
    for k in order:
        e = m.acquire_read(k)
        assert e is not None
        m.release_read(e)
    read_s = time.thread_time() - t0
    return {"puts_per_s": puts / put_s, "reads_per_s": reads / read_s}


def run(blocks: int, puts: int, reads: int, rounds: int) -> list[dict[str, Any]]:
    """Rounds interleave the fractions (0%, 10%, ... then again), so load from other
    processes hits every cell alike; a ratio is the median of its per-round ratios to
    the 0% cell of the same round."""
    got: dict[float, list[dict[str, float]]] = {f: [] for f in FRACTIONS}
    for r in range(rounds):
        for f in FRACTIONS:
            got[f].append(one_round(blocks, puts, reads, f, seed=r))
    base = got[FRACTIONS[0]]
    cells = []
    for f in FRACTIONS:
        g = got[f]
        cells.append({
            "retained_fraction": f,
            "puts_per_s": statistics.median(x["puts_per_s"] for x in g),
            "reads_per_s": statistics.median(x["reads_per_s"] for x in g),
            "puts_ratio": statistics.median(x["puts_per_s"] / b["puts_per_s"]
                                            for x, b in zip(g, base, strict=True)),
            "reads_ratio": statistics.median(x["reads_per_s"] / b["reads_per_s"]
                                             for x, b in zip(g, base, strict=True)),
            "rounds": g})
    return cells


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.retention_bench",
                                 description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=100_000)
    ap.add_argument("--puts", type=int, default=200_000)
    ap.add_argument("--reads", type=int, default=200_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    cells = run(a.blocks, a.puts, a.reads, a.rounds)
    rows = [[f"{c['retained_fraction']:.0%}", f"{c['puts_per_s']:,.0f}",
             f"{c['puts_ratio']:.2f}", f"{c['reads_per_s']:,.0f}", f"{c['reads_ratio']:.2f}"]
            for c in cells]
    print(format_table(["retained", "puts per CPU-s (evicting)", "vs 0%", "reads per CPU-s",
                        "vs 0%"], rows))
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "retention_bench.json",
               {"blocks": a.blocks, "puts": a.puts, "reads": a.reads, "rounds": a.rounds,
                "cells": cells})
    xs = [c["retained_fraction"] * 100 for c in cells]
    plot_panels(out / "retention_bench.png", [
        Panel(title="Puts under eviction pressure", x=xs, xlabel="retained blocks (%)",
              ylabel="puts/s", series={"puts/s": [c["puts_per_s"] for c in cells]}),
        Panel(title="Read leases", x=xs, xlabel="retained blocks (%)", ylabel="reads/s",
              series={"reads/s": [c["reads_per_s"] for c in cells]}),
    ], title=f"Retention cost in the tier index ({a.blocks:,} blocks, LRU)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
