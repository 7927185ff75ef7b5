"""``python -m benchmarks.soak --minutes N``: a 3-node cluster under mixed load and faults.

A real etcd and three ``kvstore serve`` processes on 127.0.0.1 (``LocalCluster``), with an
auth file: two tenants with quotas and the cluster role (the nodes' peer token). For
``--minutes`` three traffic classes (``tenant-a``, ``tenant-b`` and ``cluster``, each one
thread and one cluster client with ``replicas=2, write_quorum=2``) first fill 80% of
their share in batches, then run a seeded mix of puts, puts with ``retain_s``, gets,
batch gets and removes at ``--rate`` operations per second in all (a class at its share
removes instead of putting). Meanwhile a chaos thread, one fault at a time, SIGKILLs a
node or etcd, waits a random down time and starts it again (a node at a new port, as a
rescheduled container would be); a node is killed only when every acknowledged block has
two copies again (else the kill is skipped and reported), so a block is lost only if the
cluster lost it. ``--spare`` nodes (node-1) are never killed: a process that lives the
whole run, through every fault of its peers, for the memory verdict. Every random choice
comes from ``--seed``.

Then the load stops, repair settles, and every block ever written is read back
(``benchmarks/soak_check.py``: acknowledged blocks must come back byte for byte; no block
may come back with another's bytes). The data are sized so that no node ever needs to
evict: every class keeps at most ``--fill`` / 3 of a node's DRAM, so even a node holding a
copy of every block stays below its watermarks; the nodes' eviction counters are reported
and must stay 0, so "nothing acknowledged lost" is exact.

Memory, from ``/proc/PID/status`` every ``--sample-s`` seconds: VmRSS, RssAnon (private:
the heap, where leaked objects live) and RssShmem (a node's own DRAM region, prefaulted,
plus the pages it touched of its peers' regions, which it maps for same-host copies; so
VmRSS moves with the traffic between nodes and is reported, not judged). And the
shared-memory regions each node maps (``/proc/PID/fd``): more regions than live nodes
means a node still maps the region of a node that died, which keeps that memory
allocated. **Verdict**: for every spared node (every node if none is spared) whose process
lived ``--judge-min-s`` into the run's second half past ``--warmup-s`` of its life, the
least-squares slope of RssAnon over time (one intercept per process) is at most
``--max-slope`` MiB/min; no region of a dead node is mapped at the end; nothing
acknowledged lost; no wrong byte. The killed nodes' slopes are reported, not judged: each
of their processes comes back empty and gains blocks all its short life, so its memory
follows its data.

Diagnosis, ``--tracemalloc`` (``benchmarks/soak_memory.py``): node-1 dumps its heap every
``--tracemalloc-every-s`` (objects by type, its allocators' figures, and with
``--tracemalloc-frames`` > 0 a tracemalloc snapshot), trims glibc's heap at the last dump,
and the report adds the growth between the first dump after ``--tracemalloc-from-s`` and
the last, with the node restarts by each dump.

Writes ``benchmarks/results/soak.json`` and ``soak.png``; exits 1 if the verdict fails.
With ``--dir`` the cluster's logs stay there.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
import tempfile
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from benchmarks.soak_check import MIN_SAMPLES, check, judged, memory_verdict, pooled_slope
from benchmarks.soak_load import (
    CLASSES,
    LEASE_TTL,
    MIB,
    NODES,
    REPLICAS,
    STATUS_FIELDS,
    WINDOW_S,
    Chaos,
    Sampler,
    Soak,
    SoakConfig,
    Worker,
    wait_two_copies,
)
from benchmarks.soak_memory import Dumper, analyse, print_analysis
from benchmarks.stats import Panel, format_table, plot_panels, write_json

RESULTS = Path(__file__).resolve().parent / "results"


# ---- the run ------------------------------------------------------------------------------


def run(cfg: SoakConfig, directory: Path, log: Callable[[str], None] = print
        ) -> dict[str, Any]:
    soak = Soak(cfg, directory)
    stop_load, stop_chaos, stop_sampling = threading.Event(), threading.Event(), threading.Event()
    stop_dumps = threading.Event()
    try:
        soak.up()
        log(f"soak: cluster up (etcd {soak.etcd.endpoint}, nodes {soak.addrs()})")
        sampler = Sampler(soak, stop_sampling)
        sampler.start()
        dumper = None
        if soak.traced is not None:
            dumper = Dumper(soak, soak.traced, soak.dumps, cfg.tracemalloc_every_s,
                            stop_dumps)
            dumper.start()
        workers = [Worker(soak, c, cfg.rate / len(CLASSES), stop_load) for c in CLASSES]
        for w in workers:
            w.start()
        chaos = Chaos(soak, workers, stop_chaos)
        chaos.start()
        load_s = cfg.minutes * 60.0
        stop_load.wait(load_s)
        stop_chaos.set()
        chaos.join()  # finishes the fault under way: everything it killed runs again
        stop_load.set()
        for w in workers:
            w.join()
        if dumper is not None:
            stop_dumps.set()
            dumper.join()  # its last dump: the load has stopped
        run_s = soak.clock()
        log(f"soak: load stopped at {run_s:.0f} s; waiting for two copies of every block")
        settled = wait_two_copies(soak, workers, cfg.settle_timeout_s)
        stop_sampling.set()
        sampler.join()
        with soak.client("cluster", timeout=5.0) as stats_client:
            sampler.tick(stats_client)  # the state the verdict on mappings reads
        checks = {}
        for w in workers:
            with soak.client(w.cls) as c:
                checks[w.cls] = check(w.ledger, c.get_batch).summary(w.ledger)
        failures = [f"{t.name}: {t.failure!r}" for t in workers if t.failure is not None]
        if chaos.failure is not None:
            failures.append(f"{chaos.name}: {chaos.failure!r}")
        r = report(cfg, soak, workers, chaos, sampler, checks, run_s=run_s,
                   settled=settled, failures=failures)
        if dumper is not None:
            log("soak: comparing node-1's memory dumps")
            r["tracemalloc"] = {"node": dumper.node, "failures": dumper.failures,
                                **analyse(dumper.dumps, chaos.faults,
                                          from_s=cfg.tracemalloc_from_s)}
        return r
    finally:
        stop_dumps.set()
        stop_load.set()
        stop_chaos.set()
        stop_sampling.set()
        soak.down()


def _memory(cfg: SoakConfig, sampler: Sampler, run_s: float, started: dict[int, float]
            ) -> dict[str, dict[str, Any]]:
    """Per process: the verdict on RssAnon (``memory_verdict``), the same slope of VmRSS
    and RssShmem for information, and first / last / max of each."""
    out: dict[str, dict[str, Any]] = {}
    for name in (*NODES, "etcd"):
        by_field = {f: sampler.samples[f][name] for f in STATUS_FIELDS}
        m = memory_verdict({name: by_field["RssAnon"]}, run_s=run_s, started=started,
                           warmup_s=cfg.warmup_s, max_slope=cfg.max_slope,
                           min_span_s=cfg.judge_min_s)[name]
        for f in ("VmRSS", "RssShmem"):
            window = judged(by_field[f], run_s=run_s, started=started, warmup_s=cfg.warmup_s,
                            min_span_s=cfg.judge_min_s)
            m[f"{f}_slope_mib_per_min"] = pooled_slope(window)
        m["processes"] = len({pid for _, pid, _ in by_field["VmRSS"]})
        for f, samples in by_field.items():
            m[f] = {"first": samples[0][2] if samples else None,
                    "last": samples[-1][2] if samples else None,
                    "max": max((x[2] for x in samples), default=None)}
        out[name] = m
    return out


def report(cfg: SoakConfig, soak: Soak, workers: Sequence[Worker], chaos: Chaos,
           sampler: Sampler, checks: dict[str, dict[str, Any]], *, run_s: float,
           settled: float | None, failures: list[str]) -> dict[str, Any]:
    with soak.lock:
        started = dict(soak.started)
    memory = _memory(cfg, sampler, run_s, started)
    evictions = sum(sampler.evictions.values())
    lost = sum(c["lost"] for c in checks.values())
    wrong = (sum(c["wrong_bytes"] for c in checks.values())
             + sum(len(w.stats.wrong_reads) for w in workers))
    stale_end = sampler.stale[-1] if sampler.stale else None
    # The spared nodes' processes live the whole run with a steady share of the data. A
    # killed node's process comes back empty and gains blocks all its short life (repair,
    # and copies it takes over when the other one dies): its memory follows its data, so
    # it is reported, not judged (unless nothing is spared).
    judged_nodes = [n for n in NODES if n in cfg.spare] or list(NODES)
    flat = [f for n in judged_nodes if (f := memory[n]["flat"]) is not None]
    reasons = list(failures)
    if evictions:
        reasons.append(f"{evictions} evictions: the data did not fit, so a missing block "
                       f"cannot be told from an evicted one")
    if lost:
        reasons.append(f"{lost} acknowledged blocks lost")
    if wrong:
        reasons.append(f"{wrong} reads with wrong bytes")
    if not flat:
        reasons.append(f"no judged node process lived long enough to judge its memory ("
                       f"{cfg.judge_min_s:g} s of samples in the second half after "
                       f"{cfg.warmup_s:g} s of warm-up, at least {MIN_SAMPLES} of them)")
    for n in judged_nodes:
        m = memory[n]
        if m["flat"] is False:
            reasons.append(f"{n}: private memory (RssAnon) grows "
                           f"{m['slope_mib_per_min']:.2f} MiB/min > {cfg.max_slope:g}")
    if stale_end:
        reasons.append(f"live nodes still map {stale_end} shared-memory regions of nodes "
                       f"that died: {stale_end} x {cfg.dram_bytes // MIB} MiB kept allocated")
    verdict = {"memory_flat": all(flat) if flat else None,
               "memory_judged": [n for n in judged_nodes if memory[n]["flat"] is not None],
               "no_stale_regions": stale_end == 0,
               "nothing_lost": lost == 0 and not evictions,
               "no_wrong_byte": wrong == 0,
               "max_slope_mib_per_min": cfg.max_slope, "reasons": reasons}
    verdict["pass"] = (verdict["memory_flat"] is True and verdict["no_stale_regions"]
                       and verdict["nothing_lost"] and verdict["no_wrong_byte"]
                       and not failures)
    classes = {}
    for w in workers:
        classes[w.cls] = {"ops": w.stats.ops, "errors": w.stats.errors,
                          "error_messages": w.stats.error_messages,
                          "live_misses": len(w.stats.live_misses),
                          "live_miss_keys": w.stats.live_misses[:20],
                          "wrong_reads": len(w.stats.wrong_reads),
                          "check": checks[w.cls]}
    windows = max((max(w.stats.windows, default=0) for w in workers), default=0) + 1
    return {
        "config": {**dataclasses.asdict(cfg),
                   "nodes": list(NODES), "replicas": REPLICAS, "write_quorum": REPLICAS,
                   "lease_ttl_s": LEASE_TTL, "class_budget_bytes": soak.class_budget},
        "run_s": round(run_s, 1),
        "settle_s": None if settled is None else round(settled, 1),
        "classes": classes,
        "faults": [dataclasses.asdict(f) for f in chaos.faults],
        "evictions": evictions,
        "memory": memory,
        "stale_regions": {"end": stale_end, "max": max(sampler.stale, default=None)},
        "samples": {"t_s": sampler.ticks, **{f"{f}_mib": sampler.series[f]
                                              for f in STATUS_FIELDS},
                    "regions_mapped": sampler.regions, "stale_regions": sampler.stale,
                    "dram_used_mib": sampler.used},
        "ops_per_s": {"window_s": WINDOW_S,
                      **{w.cls: [w.stats.windows.get(i, 0) / WINDOW_S for i in range(windows)]
                         for w in workers}},
        "verdict": verdict,
    }


# ---- output -------------------------------------------------------------------------------


def print_report(r: dict[str, Any], out: Callable[[str], None] = print) -> None:
    rows = []
    for cls, c in r["classes"].items():
        ops = c["ops"]
        rows.append([cls, sum(ops.values()), ops.get("fill", 0),
                     ops.get("put", 0) + ops.get("put_retain", 0),
                     ops.get("get", 0) + ops.get("get_batch", 0), ops.get("remove", 0),
                     sum(c["errors"].values()), c["live_misses"], c["check"]["live"],
                     c["check"]["lost"], c["check"]["wrong_bytes"] + c["wrong_reads"]])
    out(format_table(["class", "ops", "fill batches", "puts", "gets", "removes", "errors",
                      "live misses", "acked at end", "lost", "wrong bytes"], rows))
    for cls, c in r["classes"].items():
        for kind, n in c["errors"].items():
            out(f"  {cls} {kind} x{n}: {c['error_messages'][kind]}")
    out("")
    rows = [[f["t"], f["what"], f["down_s"], f["recovered_s"], f["settle_s"],
             f["skipped"] or "-"] for f in r["faults"]]
    out(format_table(["t (s)", "fault", "down (s)", "back after (s)", "settle wait (s)",
                      "skipped"], rows) if rows else "no faults")
    out("")
    rows = [[n, m["processes"], m["VmRSS"]["first"], m["VmRSS"]["last"], m["VmRSS"]["max"],
             m["VmRSS_slope_mib_per_min"], m["RssShmem_slope_mib_per_min"],
             m["RssAnon"]["first"], m["RssAnon"]["last"], m["judged_samples"],
             m["slope_mib_per_min"], {True: "flat", False: "GROWS", None: "n/a"}[m["flat"]]]
            for n, m in r["memory"].items()]
    out(format_table(["process", "processes", "RSS first", "RSS last", "RSS max",
                      "RSS slope", "shmem slope", "anon first", "anon last", "judged",
                      "anon slope", "memory"], rows))
    judged_by = ", ".join(r["verdict"]["memory_judged"]) or "no node"
    out("(MiB; slopes in MiB/min over the second half, after each process's warm-up; "
        f"the verdict reads the private memory, RssAnon, of {judged_by})")
    v = r["verdict"]
    out("")
    out(f"evictions: {r['evictions']}; settled to two copies in "
        f"{r['settle_s'] if r['settle_s'] is not None else 'NOT (timeout)'} s; "
        f"regions of dead nodes still mapped: {r['stale_regions']['end']} at the end, "
        f"{r['stale_regions']['max']} at most")
    out(f"verdict: {'PASS' if v['pass'] else 'FAIL'} (memory flat: {v['memory_flat']}, "
        f"no stale regions: {v['no_stale_regions']}, nothing lost: {v['nothing_lost']}, "
        f"no wrong byte: {v['no_wrong_byte']})")
    for reason in v["reasons"]:
        out(f"  - {reason}")
    if "tracemalloc" in r:
        out("")
        for failure in r["tracemalloc"]["failures"]:
            out(f"tracemalloc: {failure}")
        print_analysis(r["tracemalloc"], out)


def plot(r: dict[str, Any], path: Path) -> None:
    sm = r["samples"]
    xs = [t / 60 for t in sm["t_s"]]
    win = r["ops_per_s"]["window_s"]
    ops = {c: r["ops_per_s"][c] for c in r["classes"]}
    wx = [(i + 0.5) * win / 60 for i in range(len(next(iter(ops.values()), [])))]
    kills = "; ".join(f"{f['what'].split()[-1]}@{f['t'] / 60:.1f}" for f in r["faults"]
                      if not f["skipped"])
    nodes = list(r["config"]["nodes"])
    plot_panels(path, [
        Panel(title="RSS (VmRSS) per process", x=xs, series=sm["VmRSS_mib"],
              xlabel="minutes", ylabel="MiB"),
        Panel(title="Private memory (RssAnon): the verdict", x=xs,
              series={n: sm["RssAnon_mib"][n] for n in nodes}, xlabel="minutes",
              ylabel="MiB"),
        Panel(title="Shared memory (RssShmem): own region + peers' pages", x=xs,
              series={n: sm["RssShmem_mib"][n] for n in nodes}, xlabel="minutes",
              ylabel="MiB"),
        Panel(title="Shared-memory regions mapped", x=xs,
              series={**sm["regions_mapped"], "of dead nodes (all)": sm["stale_regions"]},
              xlabel="minutes", ylabel="regions"),
        Panel(title="DRAM tier use per node", x=xs, series=sm["dram_used_mib"],
              xlabel="minutes", ylabel="MiB"),
        Panel(title=f"Operations per second ({win:g} s windows)", x=wx, series=ops,
              xlabel="minutes", ylabel="ops/s"),
    ], title=f"Soak: {r['config']['minutes']:g} min, seed {r['config']['seed']}; "
             f"faults (process@min): {kills or 'none'}"[:200], ncols=3)


def _pair(text: str) -> tuple[float, float]:
    lo, _, hi = text.partition(",")
    try:
        a, b = float(lo), float(hi or lo)
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LO,HI seconds, got {text!r}") from None
    if not 0 <= a <= b:
        raise argparse.ArgumentTypeError(f"want 0 <= LO <= HI, got {text!r}")
    return a, b


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.soak",
                                 description=__doc__.split("\n")[0])
    d = SoakConfig(minutes=0)
    ap.add_argument("--minutes", type=float, required=True, help="minutes of load and faults")
    ap.add_argument("--seed", type=int, default=d.seed)
    ap.add_argument("--rate", type=float, default=d.rate, help="operations per second in all")
    ap.add_argument("--dram-mib", type=int, default=d.dram_bytes // MIB,
                    help="each node's DRAM tier")
    ap.add_argument("--fill", type=float, default=d.fill,
                    help="share of one node's DRAM all classes together may hold")
    ap.add_argument("--value-kib", type=_pair, default=(d.value_min / 1024, d.value_max / 1024),
                    metavar="LO,HI", help="block sizes, KiB (uniform)")
    ap.add_argument("--sample-s", type=float, default=d.sample_s)
    ap.add_argument("--fault-gap-s", type=_pair, default=d.fault_gap_s, metavar="LO,HI")
    ap.add_argument("--node-down-s", type=_pair, default=d.node_down_s, metavar="LO,HI")
    ap.add_argument("--etcd-down-s", type=_pair, default=d.etcd_down_s, metavar="LO,HI")
    ap.add_argument("--no-faults", action="store_true", help="load only (a baseline)")
    ap.add_argument("--spare", default=",".join(d.spare), metavar="NODE,...",
                    help="nodes never killed, whose processes live the whole run (default "
                    "node-1; '' kills any)")
    ap.add_argument("--judge-min-s", type=float, default=d.judge_min_s,
                    help="a process counts in the memory verdict when its judged samples "
                    "span this long")
    ap.add_argument("--warmup-s", type=float, default=d.warmup_s,
                    help="seconds of each process's life left out of the memory verdict")
    ap.add_argument("--max-slope", type=float, default=d.max_slope,
                    help="MiB/min of RSS growth a node may show after warm-up")
    ap.add_argument("--tracemalloc", action="store_true",
                    help="diagnosis: trace node-1's allocations (KVSTORE_TRACEMALLOC_DIR) and "
                    "compare its heap dumps (benchmarks/soak_memory.py); slows node-1")
    ap.add_argument("--tracemalloc-frames", type=int, default=d.tracemalloc_frames,
                    help="frames traced per allocation; 0: no tracing, node-1's dumps count "
                    "its objects and read its allocators' statistics only")
    ap.add_argument("--tracemalloc-every-s", type=float, default=d.tracemalloc_every_s,
                    help="seconds between node-1's dumps")
    ap.add_argument("--tracemalloc-from-s", type=float, default=d.tracemalloc_from_s,
                    help="the first dump at or after this compared with the last")
    ap.add_argument("--dir", help="keep the cluster's files and logs here (default: a "
                    "temporary directory, removed)")
    ap.add_argument("--out", default=str(RESULTS))
    a = ap.parse_args(argv)
    if not a.minutes > 0:
        ap.error("--minutes must be positive")
    if a.tracemalloc_frames < 0 or not a.tracemalloc_every_s > 0:
        ap.error("--tracemalloc-frames must be >= 0 and --tracemalloc-every-s positive")
    lo, hi = a.value_kib
    cfg = SoakConfig(minutes=a.minutes, seed=a.seed, rate=a.rate, dram_bytes=a.dram_mib * MIB,
                     fill=a.fill, value_min=max(1, int(lo * 1024)), value_max=int(hi * 1024),
                     sample_s=a.sample_s, faults=not a.no_faults, fault_gap_s=a.fault_gap_s,
                     node_down_s=a.node_down_s, etcd_down_s=a.etcd_down_s,
                     warmup_s=a.warmup_s, max_slope=a.max_slope,
                     judge_min_s=a.judge_min_s, tracemalloc=a.tracemalloc,
                     tracemalloc_every_s=a.tracemalloc_every_s,
                     tracemalloc_frames=a.tracemalloc_frames,
                     tracemalloc_from_s=a.tracemalloc_from_s,
                     spare=tuple(n for n in a.spare.split(",") if n))
    with contextlib.ExitStack() as stack:
        directory = (Path(a.dir) if a.dir else Path(stack.enter_context(
            tempfile.TemporaryDirectory(prefix="kvstore-soak-"))))
        r = run(cfg, directory.resolve(), log=lambda s: print(s, file=sys.stderr))
    print_report(r)
    out = Path(a.out)
    write_json(out / "soak.json", r)
    plot(r, out / "soak.png")
    print(f"\nwrote {out / 'soak.json'} and {out / 'soak.png'}")
    return 0 if r["verdict"]["pass"] else 1


if __name__ == "__main__":
    sys.exit(main())
