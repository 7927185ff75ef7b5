"""The Conductor's three FAST'25 comparisons, simulated (``python -m benchmarks.conductor_bench``).

* ``policies``: average TTFT of the four prefill scheduling policies on the
  conversation trace (8 prefill + 8 decode instances, speed 1, no rejection),
  against the paper's 19.65 / 5.27 / 3.58 / 3.07 s.
* ``rejection``: rejected requests under ``baseline`` / ``load`` / ``predictive``
  at 2x speed, for several prefill/decode splits (decode must be the bottleneck
  for early rejection to act; see RESULTS.md), against the paper's Table 3.
  Rejected = at arrival (TTFT SLO, or decode overload) + by the decode instance
  after prefill; the predictions assume every request generates the running mean
  output length (``conductor.scheduling.rejection``). Two yardsticks: the trace's KV demand
  if every request decoded at the TBT SLO's pace (``decode_demand``), and a
  clairvoyant row that rejects at arrival exactly the requests ``baseline``
  rejected at decode (``ClairvoyantConductor``).
* ``rejection-sweep`` (not in the default set, ~3 min): the three modes over
  replay speed 1.5-3 x five splits x prefill MFU 0.5 / 0.3.
* ``capacity``: effective request capacity at TTFT 30 s and TBT 100/200/300 ms of
  the disaggregated cache-aware cluster vs the colocated baseline at equal
  instance count (``conductor.simulation.capacity``, what ``conductor capacity`` runs).
  Capacity = the highest replay speed at which at least ``--attainment`` (0.9) of
  the requests meet both SLOs, TBT being the tail mean (FAST'25 5.1), found by
  bisection (attainment falls with speed), reported in requests/s (speed x the
  trace's mean arrival rate).
* ``capacity-sweep`` (not in the default set): ``capacity`` again under the mean
  TBT and/or without the layer-wise KV overlap, and at prefill MFU 0.3 / 0.7: which
  assumption moves the gains.

Every run is deterministic (simulated clock); the figures depend only on the
code, the trace and the parameters printed with them. Writes
``conductor_bench.json`` and ``conductor_bench.png`` under ``--out``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conductor.scheduling.costs import (
    LLAMA2_70B_LAYERS,
    CostModel,
    PolyCostModel,
    a800_kv_capacity_tokens,
)
from conductor.scheduling.policies import POLICIES
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.types import Decision, Request, RequestId, Slo
from conductor.simulation.capacity import (
    CapacitySettings,
    base_rate,
    measure_capacity,
    threshold_key,
)
from conductor.simulation.colocated import simulate_colocated
from conductor.simulation.metrics import MEAN, TAIL_MEAN, TBT_DEFINITIONS, summarize
from conductor.simulation.sim import (
    DEFAULT_CACHE_BLOCKS,
    ClusterSpec,
    SimResult,
    build_conductor,
    requests_from_trace,
    simulate,
)
from conductor.simulation.trace import TraceRequest, load_trace

DEFAULT_TRACE = "/work/shared/traces/conversation_trace.jsonl"
DEFAULT_OUT = Path(__file__).resolve().parent / "results"
PAPER_TTFT = {"random": 19.65, "load-balancing": 5.27, "local-cache-aware": 3.58,
              "global-cache-aware": 3.07}
PAPER_REJECTED = {"baseline": 4183, "load": 3771, "predictive": 3589}
TBT_SLOS = (0.1, 0.2, 0.3)


def bench_policies(trace: Sequence[TraceRequest], *, prefill: int, decode: int,
                   speed: float) -> dict[str, Any]:
    reqs = requests_from_trace(trace, speed=speed)
    out: dict[str, Any] = {}
    for name in POLICIES:
        run = simulate(reqs, spec=ClusterSpec(prefill=prefill, decode=decode), policy=name)
        out[name] = summarize(run.records, Slo(), duration_s=run.duration_s)
    g = out["global-cache-aware"]["avg_ttft_s"]
    print(f"\n## policies: {len(reqs)} requests, speed {speed:g}, {prefill}P+{decode}D, "
          "rejection none\n")
    print("| policy | avg TTFT (s) | p90 TTFT (s) | cache hit | ratio to global | paper avg (s) "
          "| paper ratio |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for name, s in out.items():
        p = PAPER_TTFT[name]
        print(f"| {name} | {s['avg_ttft_s']:.2f} | {s['p90_ttft_s']:.2f} | "
              f"{s['cache_hit_ratio']:.3f} | {s['avg_ttft_s'] / g:.2f} | {p:.2f} | "
              f"{p / PAPER_TTFT['global-cache-aware']:.2f} |")
    return out


def decode_demand(trace: Sequence[TraceRequest], *, speed: float, tbt_s: float,
                  kv_capacity_tokens: int) -> tuple[float, float]:
    """Mean and peak KV demand of the whole trace, in decode instances' worth of KV cache,
    if every request held its reservation (prompt + output tokens) from its arrival for
    ``(output - 1) * tbt_s`` seconds: decoding at exactly the TBT SLO, the slowest pace
    that still meets it. A decode pool larger than the peak can only overload if its step
    time alone breaks the TBT SLO, so every rejection mode then behaves the same."""
    if not trace:
        return 0.0, 0.0
    deltas: list[tuple[float, int]] = []
    total = 0.0
    for t in trace:
        start = t.timestamp_ms / 1000.0 / speed
        hold = max(0, t.output_length - 1) * tbt_s
        tokens = t.input_length + t.output_length
        total += tokens * hold
        if hold > 0:
            deltas += [(start, tokens), (start + hold, -tokens)]
    deltas.sort(key=lambda e: (e[0], e[1]))  # releases before admissions at equal times
    level = peak = 0
    for _, d in deltas:
        level += d
        peak = max(peak, level)
    span = trace[-1].timestamp_ms / 1000.0 / speed
    mean = total / span if span > 0 else 0.0
    return mean / kv_capacity_tokens, peak / kv_capacity_tokens


class ClairvoyantConductor(Conductor):
    """The Conductor with a clairvoyant arrival check, a yardstick for early rejection:
    it rejects at arrival exactly the requests in ``doomed`` (those a ``baseline`` run
    rejected at decode, known only after that run) and schedules every other request
    as ``baseline`` does. A perfect early rejection could do no better than cut the
    prefill those requests wasted; whether that lowers the count shows how much an
    arrival-time decode check can gain at all in this model."""

    def __init__(self, *, doomed: set[RequestId], **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.doomed = doomed

    def schedule(self, req: Request, now: float) -> Decision:
        if req.id not in self.doomed:
            return super().schedule(req, now)
        self.observe(req)
        return Decision(request_id=req.id, reason="decode overloaded (clairvoyant)",
                        plan=None, decode=None, est_ttft_s=0.0, est_tbt_s=0.0)


def _clairvoyant_run(reqs: Sequence[Request], spec: ClusterSpec, cost: CostModel, slo: Slo,
                     baseline: SimResult) -> SimResult:
    ref = build_conductor(spec, cost, policy="global-cache-aware", rejection="baseline",
                          slo=slo)
    doomed = {r.id for r in baseline.records if r.rejected_late}
    c = ClairvoyantConductor(doomed=doomed, prefill=ref.prefill, decode=ref.decode,
                             cost=cost, policy="global-cache-aware", rejection="baseline",
                             slo=slo, pool=ref.pool)
    return simulate(reqs, conductor=c)


def _rejection_row(run: SimResult, slo: Slo) -> dict[str, Any]:
    s = summarize(run.records, slo, duration_s=run.duration_s)
    s["wasted_prefill_s"] = run.wasted_prefill_s
    s["rejected_ttft"] = sum(1 for r in run.records if r.rejected is not None
                             and r.rejected.startswith("TTFT"))
    if run.conductor is not None:
        s["expected_output_tokens"] = run.conductor.expected_output_tokens()
    return s


MODES = ("baseline", "load", "predictive")


def bench_rejection(trace: Sequence[TraceRequest], *, splits: Sequence[tuple[int, int]],
                    speed: float, slo: Slo, prefill_mfu: float = 0.5,
                    clairvoyant: bool = True, quiet: bool = False) -> dict[str, Any]:
    """Rejections per mode and split; with ``clairvoyant``, one more row per split that
    needs it (``ClairvoyantConductor``) and the decode pool's SLO-pace KV demand."""
    reqs = requests_from_trace(trace, speed=speed)
    cost = PolyCostModel.a800_llama2_70b(prefill_mfu=prefill_mfu)
    kv = a800_kv_capacity_tokens()
    out: dict[str, Any] = {}
    mean, peak = decode_demand(trace, speed=speed, tbt_s=slo.tbt_s, kv_capacity_tokens=kv)
    out["decode_demand_instances"] = {"mean": mean, "peak": peak}
    if not quiet:
        print(f"\n## rejection: {len(reqs)} requests, speed {speed:g}, global-cache-aware, "
              f"prefill MFU {prefill_mfu:g}, SLO TTFT {slo.ttft_s:g} s / TBT "
              f"{slo.tbt_s * 1000:g} ms\n")
        print(f"KV demand at the TBT SLO's pace: mean {mean:.2f}, peak {peak:.2f} decode "
              "instances' worth\n")
        print("| split | mode | rejected | at arrival: TTFT | at arrival: decode | at decode | "
              "wasted prefill (s) | meeting SLOs | avg TTFT (s) |")
        print("|---|---|---:|---:|---:|---:|---:|---:|---:|")
    for p, d in splits:
        key = f"{p}P+{d}D"
        out[key] = {}
        spec = ClusterSpec(prefill=p, decode=d)
        runs = {m: simulate(reqs, spec=spec, cost=cost, rejection=m, slo=slo) for m in MODES}
        if clairvoyant and any(r.rejected_late for r in runs["baseline"].records):
            runs["clairvoyant"] = _clairvoyant_run(reqs, spec, cost, slo, runs["baseline"])
        for mode, run in runs.items():
            s = out[key][mode] = _rejection_row(run, slo)
            if not quiet:
                print(f"| {key} | {mode} | {s['rejected']} | {s['rejected_ttft']} | "
                      f"{s['rejected_early'] - s['rejected_ttft']} | {s['rejected_late']} | "
                      f"{run.wasted_prefill_s:.0f} | {s['effective_requests']} | "
                      f"{s['avg_ttft_s']:.2f} |")
        counts = [out[key][m]["rejected"] for m in MODES]
        out[key]["paper_order"] = counts[0] > counts[1] > counts[2]
    return out


def bench_rejection_sweep(trace: Sequence[TraceRequest], *, splits: Sequence[tuple[int, int]],
                          speeds: Sequence[float], mfus: Sequence[float], slo: Slo
                          ) -> dict[str, Any]:
    """The three modes over replay speed x split x prefill MFU: where, if anywhere, the
    paper's order baseline > load > predictive holds."""
    out: dict[str, Any] = {}
    print(f"\n## rejection sweep: SLO TTFT {slo.ttft_s:g} s / TBT {slo.tbt_s * 1000:g} ms; "
          "rejected baseline / load / predictive (of which TTFT), order = paper's\n")
    print("| prefill MFU | speed | split | baseline | load | predictive | order |")
    print("|---:|---:|---|---:|---:|---:|---|")
    for mfu in mfus:
        for speed in speeds:
            res = bench_rejection(trace, splits=splits, speed=speed, slo=slo, prefill_mfu=mfu,
                                  clairvoyant=False, quiet=True)
            out[f"mfu {mfu:g}, speed {speed:g}"] = res
            for p, d in splits:
                r = res[f"{p}P+{d}D"]
                cells = [f"{r[m]['rejected']:,} ({r[m]['rejected_ttft']:,})" for m in MODES]
                print(f"| {mfu:g} | {speed:g} | {p}P+{d}D | " + " | ".join(cells)
                      + f" | {'yes' if r['paper_order'] else 'no'} |", flush=True)
    return out


def bench_capacity(trace: Sequence[TraceRequest], *, instances: int, attainment: float,
                   chunk_tokens: int, tol: float, colocated_cache_blocks: int,
                   tbt_statistic: str = TAIL_MEAN, kv_stream_layers: int = LLAMA2_70B_LAYERS,
                   prefill_mfu: float = 0.5, splits: Sequence[int] | None = None,
                   diagnostic: bool = True) -> dict[str, Any]:
    """``conductor.simulation.capacity.measure_capacity`` (what ``conductor capacity``
    runs), printed as a table; ``contract`` holds the ``conductor capacity --json`` object."""
    cost = PolyCostModel.a800_llama2_70b(prefill_mfu=prefill_mfu)
    kv = a800_kv_capacity_tokens()
    settings = CapacitySettings(instances=instances, tbt_slos_s=TBT_SLOS, attainment=attainment,
                                tol=tol, chunk_tokens=chunk_tokens,
                                colocated_cache_blocks=colocated_cache_blocks,
                                kv_capacity_tokens=kv, kv_stream_layers=kv_stream_layers,
                                tbt_statistic=tbt_statistic,
                                splits=tuple(splits) if splits is not None else None)
    rate = base_rate(trace)
    print(f"\n## capacity: {instances} instances, capacity = max speed with >= "
          f"{attainment:.0%} of requests meeting TTFT 30 s and the TBT SLO (1x = {rate:.2f} "
          f"req/s); TBT = {TBT_DEFINITIONS[tbt_statistic]}; KV streamed in "
          f"{kv_stream_layers} layers; prefill MFU {prefill_mfu:g}\n")
    print("| system | TBT 100 ms | TBT 200 ms | TBT 300 ms |")
    print("|---|---:|---:|---:|", flush=True)

    def row(name: str, speeds: dict[str, float]) -> None:
        print(f"| {name} | " + " | ".join(
            f"{speeds[threshold_key(t)]:.2f}x = {speeds[threshold_key(t)] * rate:.2f} req/s"
            for t in TBT_SLOS) + " |", flush=True)

    result = measure_capacity(trace, cost, settings, progress=row)
    contract = result.contract()
    out: dict[str, Any] = {
        "base_rps": rate, "attainment": attainment, "tbt_statistic": tbt_statistic,
        "kv_stream_layers": kv_stream_layers, "prefill_mfu": prefill_mfu,
        "systems": {name: {str(t): v[threshold_key(t)] for t in TBT_SLOS}
                    for name, v in result.speeds.items()},
        "contract": contract,
        "gain_best_split_vs_colocated": {
            str(t): contract["thresholds"][threshold_key(t)]["gain"] for t in TBT_SLOS},
    }
    print("\nbest disaggregated split vs the better colocated variant: "
          + ", ".join(f"TBT {k} {v['best_split']} "
                      + ("n/a" if v["gain"] is None else f"{v['gain']:+.0%}")
                      for k, v in contract["thresholds"].items()))
    out["colocated_cache_blocks"] = colocated_cache_blocks
    if diagnostic:
        out["max_gap_attainment_1x"] = _gap_diagnostic(trace, instances=instances, cost=cost,
                                                       kv=kv, chunk_tokens=chunk_tokens,
                                                       cache_blocks=colocated_cache_blocks)
    return out


def bench_capacity_sweep(trace: Sequence[TraceRequest], *, instances: int, attainment: float,
                         chunk_tokens: int, tol: float, colocated_cache_blocks: int
                         ) -> dict[str, Any]:
    """Which assumption moves the capacity gains, one at a time from ``capacity``'s
    (tail mean, 80 layers, MFU 0.5): the mean TBT instead, no layer-wise KV overlap
    (1 layer), and prefill MFU 0.3 / 0.7. (Mean TBT without overlap is the pre-issue-16
    model, RESULTS.md's old figures.)"""
    cells = [(MEAN, LLAMA2_70B_LAYERS, 0.5), (TAIL_MEAN, 1, 0.5),
             (TAIL_MEAN, LLAMA2_70B_LAYERS, 0.3), (TAIL_MEAN, LLAMA2_70B_LAYERS, 0.7)]
    out: dict[str, Any] = {}
    for stat, layers, mfu in cells:
        out[f"{stat}, {layers} layers, MFU {mfu:g}"] = bench_capacity(
            trace, instances=instances, attainment=attainment, chunk_tokens=chunk_tokens,
            tol=tol, colocated_cache_blocks=colocated_cache_blocks, tbt_statistic=stat,
            kv_stream_layers=layers, prefill_mfu=mfu, diagnostic=False)
    return out


def _gap_diagnostic(trace: Sequence[TraceRequest], *, instances: int, cost: PolyCostModel,
                    kv: int, chunk_tokens: int, cache_blocks: int
                    ) -> dict[str, dict[str, float]]:
    """At speed 1, the share of colocated requests meeting TTFT 30 s and the TBT SLO
    under the mean TBT, the tail-mean TBT and every token interval (the longest one,
    ``RequestRecord.max_tbt_s``)."""
    reqs = requests_from_trace(trace)
    out: dict[str, dict[str, float]] = {}
    print("\ncolocated at 1x, share meeting TTFT 30 s and TBT as mean gap / tail mean / "
          "every gap:")
    for label, chunk in (("whole prefill", None), (f"chunked {chunk_tokens}", chunk_tokens)):
        run = simulate_colocated(reqs, instances=instances, cost=cost,
                                 cache_blocks=cache_blocks, kv_capacity_tokens=kv,
                                 chunk_tokens=chunk)
        n = len(run.records)
        row = {}
        for tbt in TBT_SLOS:
            slo = Slo(ttft_s=30.0, tbt_s=tbt)
            mean_ok = sum(1 for r in run.records if r.meets(slo, MEAN))
            tail_ok = sum(1 for r in run.records if r.meets(slo, TAIL_MEAN))
            gap_ok = sum(1 for r in run.records if r.meets(Slo(ttft_s=30.0, tbt_s=1e9))
                         and (r.max_tbt_s or 0.0) <= tbt)
            row[f"mean_{tbt}"] = mean_ok / n
            row[f"tail_{tbt}"] = tail_ok / n
            row[f"gap_{tbt}"] = gap_ok / n
        out[label] = row
        print(f"  {label}: " + ", ".join(
            f"TBT {t * 1000:.0f} ms {row[f'mean_{t}']:.3f} / {row[f'tail_{t}']:.3f} / "
            f"{row[f'gap_{t}']:.3f}"
            for t in TBT_SLOS))
    full = cost.decode_step_s(256, kv)
    print(f"disaggregated decode step with a full KV cache (1.47M tokens): {full * 1000:.0f} ms")
    return out


def _plot(results: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    panels = [k for k in ("policies", "rejection", "capacity") if k in results]
    fig, axes = plt.subplots(1, len(panels), figsize=(5.5 * len(panels), 4), squeeze=False)
    for ax, key in zip(axes[0], panels, strict=True):
        if key == "policies":
            names = list(PAPER_TTFT)
            x = np.arange(len(names))
            ax.bar(x - 0.2, [results[key][n]["avg_ttft_s"] for n in names], 0.4, label="sim")
            ax.bar(x + 0.2, [PAPER_TTFT[n] for n in names], 0.4, label="FAST'25")
            ax.set_xticks(x, [n.replace("-", "-\n", 1) for n in names], fontsize=8)
            ax.set_ylabel("average TTFT (s)")
            ax.legend()
        elif key == "rejection":
            splits = [k for k in results[key] if k.endswith("D")]
            x = np.arange(len(splits))
            for i, mode in enumerate(("baseline", "load", "predictive")):
                ax.bar(x + (i - 1) * 0.27, [results[key][s][mode]["rejected"] for s in splits],
                       0.27, label=mode)
            ax.set_xticks(x, splits)
            ax.set_ylabel("rejected requests (2x speed)")
            ax.legend()
        else:
            systems = results[key]["systems"]
            x = np.arange(len(TBT_SLOS))
            w = 0.8 / len(systems)
            for i, (name, caps) in enumerate(systems.items()):
                ax.bar(x + i * w - 0.4 + w / 2,
                       [caps[str(t)] * results[key]["base_rps"] for t in TBT_SLOS], w,
                       label=name)
            ax.set_xticks(x, [f"TBT {t * 1000:.0f} ms" for t in TBT_SLOS])
            ax.set_ylabel("effective capacity (req/s)")
            ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="conductor_bench", description=__doc__.split("\n")[0])
    ap.add_argument("which", nargs="*", metavar="EXPERIMENT",
                    help="policies, rejection, rejection-sweep, capacity and/or "
                    "capacity-sweep (default: policies, rejection, capacity)")
    ap.add_argument("--trace", default=DEFAULT_TRACE)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--instances", type=int, default=16, help="capacity: total instances (16)")
    ap.add_argument("--attainment", type=float, default=0.9, help="capacity: SLO attainment")
    ap.add_argument("--chunk-tokens", type=int, default=2048, help="colocated chunked prefill")
    ap.add_argument("--tol", type=float, default=0.05, help="capacity: speed resolution")
    ap.add_argument("--colocated-cache-blocks", type=int, default=DEFAULT_CACHE_BLOCKS,
                    help=f"capacity: prefix cache per colocated instance ({DEFAULT_CACHE_BLOCKS})")
    args = ap.parse_args(argv)
    known = ["policies", "rejection", "rejection-sweep", "capacity", "capacity-sweep"]
    which = args.which or ["policies", "rejection", "capacity"]
    if unknown := [w for w in which if w not in known]:
        ap.error(f"unknown experiment {unknown[0]!r} (known: {', '.join(known)})")
    try:
        trace = load_trace(args.trace)
    except (OSError, ValueError) as exc:
        print(f"conductor_bench: error: {exc}", file=sys.stderr)
        return 1
    started = time.monotonic()
    results: dict[str, Any] = {"trace": args.trace}
    if "policies" in which:
        results["policies"] = bench_policies(trace, prefill=8, decode=8, speed=1.0)
    if "rejection" in which:
        results["rejection"] = bench_rejection(
            trace, splits=[(8, 8), (8, 2), (8, 1), (7, 1), (6, 1), (5, 1)], speed=2.0,
            slo=Slo())
    if "rejection-sweep" in which:
        results["rejection_sweep"] = bench_rejection_sweep(
            trace, splits=[(8, 8), (12, 2), (8, 1), (6, 1), (4, 1)],
            speeds=(1.5, 2.0, 2.5, 3.0), mfus=(0.5, 0.3), slo=Slo())
    if "capacity" in which:
        results["capacity"] = bench_capacity(trace, instances=args.instances,
                                             attainment=args.attainment,
                                             chunk_tokens=args.chunk_tokens, tol=args.tol,
                                             colocated_cache_blocks=args.colocated_cache_blocks)
    if "capacity-sweep" in which:
        results["capacity_sweep"] = bench_capacity_sweep(
            trace, instances=args.instances, attainment=args.attainment,
            chunk_tokens=args.chunk_tokens, tol=args.tol,
            colocated_cache_blocks=args.colocated_cache_blocks)
    args.out.mkdir(parents=True, exist_ok=True)
    results["args"] = {k: str(v) for k, v in vars(args).items()}
    (args.out / "conductor_bench.json").write_text(json.dumps(results, indent=2) + "\n")
    _plot(results, args.out / "conductor_bench.png")
    print(f"\n{time.monotonic() - started:.0f} s; wrote {args.out}/conductor_bench.json, .png")
    return 0


if __name__ == "__main__":
    sys.exit(main())
