"""``conductor``: run the KV-cache-aware scheduler, simulated or in front of live workers.

Every failure a user can cause ends in one line on stderr and a non-zero exit,
never a traceback: 1 for a run that failed (unreadable or malformed trace), 2 for
bad usage (argparse's own message).

Subcommands register themselves in ``SUBCOMMANDS``: a function that adds its
parser to the subparsers and sets ``func`` (a ``Namespace -> int``) as a default.
Adding one is a new ``add_*`` function and a line in that list.

``conductor simulate`` output: a table of TTFT/TBT percentiles, SLO attainment,
effective request capacity (requests meeting both SLOs) and rejections per
policy. With ``--json`` the last line printed is one JSON object keyed by policy
name, each value holding at least ``avg_ttft_s``, ``p90_ttft_s``, ``p90_tbt_s``,
``tail_tbt_s``, ``slo_attainment`` and ``rejected`` (a contract; see
``conductor.simulation.metrics``). The TBT SLO is checked on each request's tail-mean TBT (the
mean of its longest 10% token intervals, FAST'25 section 5.1) unless
``--tbt-statistic mean``.

``conductor capacity`` output: a table of each system's capacity, then with
``--json`` one JSON object as the last line, ``{"tbt_definition": ..., "thresholds":
{"100ms": {"colocated_req_s", "colocated_chunked_req_s", "disaggregated_req_s",
"best_split", "gain"}, ...}}`` (a contract; see ``conductor.simulation.capacity``).
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from conductor.front.session_cache import DEFAULT_SESSION_TTL_S, check_session_ttl
from conductor.scheduling.costs import LLAMA2_70B_LAYERS, PolyCostModel, a800_kv_capacity_tokens
from conductor.scheduling.policies import POLICIES
from conductor.scheduling.rejection import REJECTION_MODES
from conductor.scheduling.types import Slo
from conductor.simulation.metrics import TAIL_MEAN, TBT_DEFINITIONS, TBT_STATISTICS, summarize
from conductor.simulation.sim import (
    DEFAULT_CACHE_BLOCKS,
    ClusterSpec,
    requests_from_trace,
    simulate,
)
from conductor.simulation.trace import load_trace

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "benchmarks" / "results"

_DURATION = re.compile(r"^\s*([0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?)\s*(us|ms|s|m|)\s*$")
_UNITS = {"us": 1e-6, "ms": 1e-3, "s": 1.0, "": 1.0, "m": 60.0}


def parse_duration(text: str) -> float:
    """Seconds from ``2s``, ``100ms``, ``250us``, ``1.5m`` or a bare number of seconds."""
    m = _DURATION.match(text)
    if m is None:
        raise ValueError(f"invalid duration {text!r} (use e.g. 30s, 100ms)")
    value = float(m.group(1)) * _UNITS[m.group(2)]
    if value <= 0:
        raise ValueError(f"duration must be > 0, got {text!r}")
    return value


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _session_ttl(text: str) -> float:
    """``--session-ttl``: a duration, or 0 (sessions keep no cache)."""
    try:
        if re.fullmatch(r"0+(\.0*)?(s|ms|us|m)?", text.strip()):
            return 0.0
        return check_session_ttl(parse_duration(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {v}")
    return v


def _positive_float(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
    return v


_TBT_HELP = ("which per-request TBT the TBT SLO is checked on: tail-mean = the mean of the "
             "longest max(1, ceil(n/10)) of its n token intervals (FAST'25 5.1); mean = "
             "(last token - first token) / (output - 1) (default tail-mean)")
_LAYERS_HELP = (f"layers the prompt's KV streams to decode in during prefill "
                f"({LLAMA2_70B_LAYERS}, LLaMA2-70B's; 1 = transfer after prefill)")


def _add_model_args(s: argparse.ArgumentParser) -> None:
    s.add_argument("--ttft-slo", type=_duration, default=30.0, help="TTFT SLO (30s)")
    s.add_argument("--cache-blocks", type=_positive_int, default=DEFAULT_CACHE_BLOCKS,
                   help=f"local prefix cache per prefill instance, in 512-token blocks "
                   f"({DEFAULT_CACHE_BLOCKS})")
    s.add_argument("--kv-capacity-tokens", type=_positive_int,
                   help="KV tokens per decode instance (default: 8 x A800-80GB next to "
                   "LLaMA2-70B)")
    s.add_argument("--prefill-mfu", type=_positive_float, default=0.5,
                   help="prefill model-FLOPs utilization of the A800 cost model (0.5)")
    s.add_argument("--kv-stream-layers", type=_positive_int, default=LLAMA2_70B_LAYERS,
                   help=_LAYERS_HELP)
    s.add_argument("--tbt-statistic", choices=list(TBT_STATISTICS), default=TAIL_MEAN,
                   help=_TBT_HELP)


def _cost(args: argparse.Namespace) -> PolyCostModel:
    if args.prefill_mfu > 1:
        raise CliError(f"--prefill-mfu must be <= 1, got {args.prefill_mfu:g}")
    return PolyCostModel.a800_llama2_70b(prefill_mfu=args.prefill_mfu)


# ---- simulate -------------------------------------------------------------------------------

def add_simulate(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("simulate", help="replay a trace through a simulated cluster",
                       description="Replay a Mooncake trace through a simulated disaggregated "
                       "cluster driven by the Conductor (LLaMA2-70B on 8 x A800 per instance). "
                       "A request meets the SLOs if TTFT <= --ttft-slo and its TBT <= "
                       "--tbt-slo, TBT being by default its tail-mean TBT: the mean of the "
                       "longest 10% (at least one) of its token intervals, FAST'25's "
                       "definition (--tbt-statistic mean: its mean interval). The JSON keeps "
                       "avg_tbt_s / p90_tbt_s (mean interval) and adds tail_tbt_s (mean over "
                       "requests of the tail-mean TBT).")
    s.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    s.add_argument("--prefill", type=_positive_int, default=8, help="prefill instances (8)")
    s.add_argument("--decode", type=_positive_int, default=8, help="decode instances (8)")
    s.add_argument("--policy", choices=list(POLICIES), default="global-cache-aware",
                   help="prefill scheduling policy (global-cache-aware)")
    s.add_argument("--rejection", choices=list(REJECTION_MODES), default="none",
                   help="overload rejection mode (none)")
    s.add_argument("--tbt-slo", type=_duration, default=0.1,
                   help="TBT SLO (100ms), on the --tbt-statistic")
    s.add_argument("--speed", type=_positive_float, default=1.0,
                   help="replay speed: arrivals at timestamp / speed (1.0)")
    s.add_argument("--limit", type=_positive_int, help="replay only the first N requests")
    _add_model_args(s)
    s.add_argument("--seed", type=int, default=0, help="RNG seed of the random policy (0)")
    s.add_argument("--compare", action="store_true",
                   help="run every policy; write a table, JSON and PNG under --out")
    s.add_argument("--json", action="store_true",
                   help="print one JSON object keyed by policy as the last line")
    s.add_argument("--out", type=Path, help=f"results directory (default {DEFAULT_OUT})")
    s.set_defaults(func=cmd_simulate)


_COLUMNS = [("avg_ttft_s", "TTFT avg", 1.0), ("p50_ttft_s", "p50", 1.0),
            ("p90_ttft_s", "p90", 1.0), ("p99_ttft_s", "p99", 1.0),
            ("p50_tbt_s", "TBT p50 ms", 1000.0), ("p90_tbt_s", "p90 ms", 1000.0),
            ("p99_tbt_s", "p99 ms", 1000.0), ("tail_tbt_s", "tail TBT avg ms", 1000.0),
            ("p90_tail_tbt_s", "p90 ms", 1000.0)]


def _fmt(v: Any, scale: float = 1.0) -> str:
    if v is None:
        return "-"
    return f"{v * scale:.2f}" if scale == 1.0 else f"{v * scale:.1f}"


def format_table(results: dict[str, dict[str, Any]]) -> str:
    """A markdown table, one row per policy (seconds unless the header says ms)."""
    head = (["policy"] + [c[1] for c in _COLUMNS]
            + ["SLO attainment", "effective", "rejected (early/late)", "cache hit"])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, s in results.items():
        row = [name] + [_fmt(s[k], scale) for k, _, scale in _COLUMNS]
        row += [f"{s['slo_attainment']:.3f}", str(s["effective_requests"]),
                f"{s['rejected']} ({s['rejected_early']}/{s['rejected_late']})",
                f"{s['cache_hit_ratio']:.3f}"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def _plot(results: dict[str, dict[str, Any]], ttfts: dict[str, list[float]], path: Path,
          title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    x = np.arange(len(names))
    ax1.bar(x - 0.2, [results[n]["avg_ttft_s"] or 0 for n in names], 0.4, label="average")
    ax1.bar(x + 0.2, [results[n]["p90_ttft_s"] or 0 for n in names], 0.4, label="p90")
    ax1.set_xticks(x, names, rotation=15)
    ax1.set_ylabel("TTFT (s)")
    ax1.legend()
    for n in names:
        v = np.sort(np.array(ttfts[n]))
        if v.size:
            ax2.plot(v, np.arange(1, v.size + 1) / v.size, label=n)
    ax2.set_xscale("log")
    ax2.set_xlabel("TTFT (s)")
    ax2.set_ylabel("fraction of requests")
    ax2.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def cmd_simulate(args: argparse.Namespace) -> int:
    trace = load_trace(args.trace)
    if not trace:
        raise CliError(f"{args.trace}: no requests")
    requests = requests_from_trace(trace, speed=args.speed, limit=args.limit)
    slo = Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo)
    spec = ClusterSpec(prefill=args.prefill, decode=args.decode, cache_blocks=args.cache_blocks,
                       kv_capacity_tokens=args.kv_capacity_tokens or a800_kv_capacity_tokens())
    cost = _cost(args)
    policies = list(POLICIES) if args.compare else [args.policy]
    results: dict[str, dict[str, Any]] = {}
    ttfts: dict[str, list[float]] = {}
    started = time.monotonic()
    for name in policies:
        run = simulate(requests, spec=spec, cost=cost, policy=name, rejection=args.rejection,
                       slo=slo, seed=args.seed, kv_stream_layers=args.kv_stream_layers)
        s = summarize(run.records, slo, duration_s=run.duration_s,
                      tbt_statistic=args.tbt_statistic)
        s["wasted_prefill_s"] = run.wasted_prefill_s
        results[name] = s
        ttfts[name] = [r.ttft_s for r in run.records if r.served and r.ttft_s is not None]
    wall = time.monotonic() - started
    settings = (f"{len(requests)} requests of {args.trace}, speed {args.speed:g}, "
                f"{args.prefill} prefill + {args.decode} decode, rejection {args.rejection}, "
                f"SLO TTFT {args.ttft_slo:g} s / TBT {args.tbt_slo * 1000:g} ms "
                f"({args.tbt_statistic} TBT), KV streamed in {args.kv_stream_layers} layers")
    table = format_table(results)
    print(settings)
    print(table)
    print(f"simulated in {wall:.1f} s wall")
    if args.compare or args.out is not None:
        out = args.out if args.out is not None else DEFAULT_OUT
        out.mkdir(parents=True, exist_ok=True)
        stem = out / ("conductor_compare" if args.compare else f"conductor_{args.policy}")
        stem.with_suffix(".md").write_text(settings + "\n\n" + table + "\n")
        stem.with_suffix(".json").write_text(json.dumps(
            {"settings": vars_json(args), "results": results}, indent=2) + "\n")
        _plot(results, ttfts, stem.with_suffix(".png"), settings)
        print(f"wrote {stem}.md, .json and .png")
    if args.json:
        print(json.dumps(results, separators=(",", ":")))
    return 0


# ---- capacity -------------------------------------------------------------------------------

def _durations(text: str) -> tuple[float, ...]:
    parts = [p for p in text.split(",") if p.strip()]
    if not parts:
        raise argparse.ArgumentTypeError(f"need at least one duration, got {text!r}")
    return tuple(_duration(p) for p in parts)


def add_capacity(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("capacity", help="effective request capacity: disaggregated vs colocated",
                       description="Find each system's effective request capacity on a "
                       "trace: the highest replay speed at which >= --attainment of all "
                       "requests meet TTFT <= --ttft-slo and TBT <= each --tbt-slo (tail-mean "
                       "TBT by default, FAST'25 5.1), in requests/s. Systems: --instances "
                       "colocated instances (whole-prompt and chunked prefill) and the "
                       "Conductor's disaggregated cluster at each prefill/decode split. With "
                       "--json the last line is {\"tbt_definition\": ..., \"thresholds\": "
                       "{\"100ms\": {\"colocated_req_s\", \"colocated_chunked_req_s\", "
                       "\"disaggregated_req_s\", \"best_split\", \"gain\"}, ...}}; gain = "
                       "best split over the better colocated variant, minus 1.")
    s.add_argument("--trace", required=True, help="Mooncake JSONL trace")
    s.add_argument("--tbt-slo", type=_durations, default=(0.1, 0.2, 0.3),
                   help="TBT SLOs, comma-separated (100ms,200ms,300ms)")
    s.add_argument("--instances", type=_positive_int, default=16,
                   help="instances per system (16)")
    s.add_argument("--splits", help="disaggregated splits, e.g. 8P+8D,12P+4D (default: every "
                   "second split from half prefill, instances/8 apart)")
    s.add_argument("--attainment", type=_positive_float, default=0.9,
                   help="share of requests that must meet the SLOs (0.9)")
    s.add_argument("--tol", type=_positive_float, default=0.05,
                   help="bisection resolution in replay speed (0.05)")
    s.add_argument("--chunk-tokens", type=_positive_int, default=2048,
                   help="colocated chunked-prefill chunk (2048)")
    s.add_argument("--colocated-cache-blocks", type=_positive_int,
                   help="prefix cache per colocated instance (default --cache-blocks)")
    s.add_argument("--limit", type=_positive_int, help="use only the first N requests")
    _add_model_args(s)
    s.add_argument("--json", action="store_true",
                   help="print the JSON object above as the last line")
    s.set_defaults(func=cmd_capacity)


def cmd_capacity(args: argparse.Namespace) -> int:
    from conductor.simulation.capacity import (
        COLOCATED,
        COLOCATED_CHUNKED,
        CapacitySettings,
        base_rate,
        measure_capacity,
        parse_split,
        threshold_key,
    )

    trace = load_trace(args.trace)
    if args.limit is not None:
        trace = trace[:args.limit]
    if not trace:
        raise CliError(f"{args.trace}: no requests")
    splits = None
    if args.splits is not None:
        splits = []
        for text in args.splits.split(","):
            p, d = parse_split(text)
            if p + d != args.instances:
                raise CliError(f"split {text.strip()} is not {args.instances} instances")
            splits.append(p)
    if args.attainment > 1:
        raise CliError(f"--attainment must be <= 1, got {args.attainment:g}")
    settings = CapacitySettings(
        instances=args.instances, tbt_slos_s=args.tbt_slo, ttft_slo_s=args.ttft_slo,
        attainment=args.attainment, tol=args.tol, chunk_tokens=args.chunk_tokens,
        splits=tuple(splits) if splits is not None else None, cache_blocks=args.cache_blocks,
        colocated_cache_blocks=args.colocated_cache_blocks or args.cache_blocks,
        kv_capacity_tokens=args.kv_capacity_tokens or a800_kv_capacity_tokens(),
        kv_stream_layers=args.kv_stream_layers, tbt_statistic=args.tbt_statistic)
    keys = [threshold_key(t) for t in args.tbt_slo]
    print(f"{len(trace)} requests of {args.trace}, {args.instances} instances, capacity = max "
          f"speed with >= {args.attainment:.0%} meeting TTFT {args.ttft_slo:g} s and TBT "
          f"({TBT_DEFINITIONS[args.tbt_statistic]})", flush=True)
    print("| system | " + " | ".join(f"TBT {k} (speed, req/s)" for k in keys) + " |")
    print("|---|" + "---:|" * len(keys), flush=True)
    started = time.monotonic()
    rate = base_rate(trace)

    def row(name: str, speeds: dict[str, float]) -> None:
        print(f"| {name} | " + " | ".join(f"{speeds[k]:.2f}x = {speeds[k] * rate:.2f}"
                                          for k in keys) + " |", flush=True)

    result = measure_capacity(trace, _cost(args), settings, progress=row)
    contract = result.contract()
    print(f"1x = {result.base_rps:.3f} req/s; simulated in {time.monotonic() - started:.0f} s "
          "wall")
    for k, v in contract["thresholds"].items():
        colo = max(v["colocated_req_s"], v["colocated_chunked_req_s"])
        best = COLOCATED if v["colocated_req_s"] >= v["colocated_chunked_req_s"] else (
            COLOCATED_CHUNKED)
        gain = "n/a" if v["gain"] is None else f"{v['gain']:+.0%}"
        print(f"TBT {k}: {v['best_split']} {v['disaggregated_req_s']:.2f} req/s vs {best} "
              f"{colo:.2f} req/s: {gain}")
    if args.json:
        print(json.dumps(contract, separators=(",", ":")))
    return 0


def vars_json(args: argparse.Namespace) -> dict[str, Any]:
    return {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()
            if k != "func"}


# ---- entry point ----------------------------------------------------------------------------

class CliError(Exception):
    """A failure to report in one line."""


def add_serve(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    s = sub.add_parser("serve", help="schedule requests onto vLLM instances or live workers",
                       description="Run the Conductor as an OpenAI-compatible HTTP service "
                       "in front of vLLM OpenAI servers using KVStoreConnector "
                       "(--vllm-prefill/--vllm-decode, or --vllm for colocated instances), "
                       "or in front of the toy workers (--prefill/--decode).")
    s.add_argument("--store", help="kvstore node HOST:PORT (the global cache)")
    s.add_argument("--etcd", help="cluster etcd HOST:PORT instead of --store (vLLM mode)")
    s.add_argument("--replicas", type=_positive_int, default=1,
                   help="copies per block on the cluster (--etcd; default 1)")
    s.add_argument("--write-quorum", type=_positive_int,
                   help="copies that make a block durable on the cluster (--etcd; "
                   "default --replicas)")
    s.add_argument("--prefill", help="toy prefill workers, HOST:PORT,HOST:PORT")
    s.add_argument("--decode", help="toy decode workers, HOST:PORT,HOST:PORT")
    s.add_argument("--vllm-prefill", help="vLLM prefill instances (kv_both), URL[,URL...]")
    s.add_argument("--vllm-decode", help="vLLM decode instances (kv_consumer), URL[,URL...]")
    s.add_argument("--vllm", help="colocated vLLM instances (kv_both), URL[,URL...]")
    s.add_argument("--kv-namespace", help="the connectors' namespace (vLLM mode; optional: "
                   "the instances say theirs, and a given one must equal it)")
    s.add_argument("--block-tokens", type=_positive_int,
                   help="vLLM's block size, in tokens (vLLM mode; optional, as "
                   "--kv-namespace)")
    s.add_argument("--tokenizer", type=Path, help="tokenizer directory for text prompts to "
                   "instances run with --skip-tokenizer-init (instances that tokenize get "
                   "text and chat unchanged)")
    s.add_argument("--upstream-timeout", type=_duration, default=600.0,
                   help="bound on one instance call (default 600s)")
    s.add_argument("--durable-timeout", type=_duration, default=30.0,
                   help="bound on the wait for the prefill's blocks in the store "
                   "(default 30s)")
    s.add_argument("--ttft-slo", type=_duration, default=2.0, help="e.g. 2s (default 2s)")
    s.add_argument("--tbt-slo", type=_duration, default=0.1, help="e.g. 100ms (default 100ms)")
    s.add_argument("--policy", choices=sorted(POLICIES), default="global-cache-aware")
    s.add_argument("--rejection", choices=sorted(REJECTION_MODES), default="predictive")
    s.add_argument("--session-ttl", type=_session_ttl, default=DEFAULT_SESSION_TTL_S,
                   metavar="DURATION",
                   help="keep a session's blocks (X-Session-Affinity or session_id) retained "
                   "in the store this long after its last turn, prefetched when its next "
                   f"turn arrives; 0 turns sessions off (default {DEFAULT_SESSION_TTL_S:g}s; "
                   "docs/conductor.md, Sessions)")
    s.add_argument("--listen", default="127.0.0.1:7700", help="HOST:PORT (default "
                   "127.0.0.1:7700; port 0 picks one)")
    s.set_defaults(func=run_serve)


def _addrs(text: str) -> list[str]:
    out = [a.strip() for a in text.split(",") if a.strip()]
    if not out:
        raise CliError(f"need at least one address, got {text!r}")
    return out


def run_serve(args: argparse.Namespace) -> int:
    vllm_mode = bool(args.vllm or args.vllm_prefill or args.vllm_decode)
    if vllm_mode:
        if args.prefill or args.decode:
            raise CliError("--prefill/--decode (toy workers) cannot be combined with --vllm*")
        from conductor.front.serve_vllm import run_serve_vllm

        return run_serve_vllm(args, _addrs, CliError)
    if not (args.prefill and args.decode):
        raise CliError("need --vllm-prefill and --vllm-decode, --vllm, or (toy workers) "
                       "--prefill and --decode")
    if not args.store:
        raise CliError("--store HOST:PORT is required with toy workers")
    import signal
    import threading

    from conductor.live.runner import LiveConductor
    from conductor.live.service import ConductorService
    from kvstore.client import Client

    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    with Client(args.store) as store:
        live = LiveConductor(store=store, prefill=_addrs(args.prefill),
                             decode=_addrs(args.decode),
                             slo=Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo),
                             policy=args.policy, rejection=args.rejection,
                             session_ttl_s=args.session_ttl)
        service = ConductorService(live, listen=args.listen)
        service.start()
        print(f"conductor: serving on {service.addr} (policy {args.policy}, rejection "
              f"{args.rejection}, TTFT SLO {args.ttft_slo:g}s, TBT SLO {args.tbt_slo:g}s, "
              f"session TTL {args.session_ttl:g}s)", flush=True)
        while not stop.wait(0.5):
            pass
        service.stop()
    print("conductor: stopped", flush=True)
    return 0


SUBCOMMANDS: list[Callable[[argparse._SubParsersAction[argparse.ArgumentParser]], None]] = [
    add_simulate,
    add_capacity,
    add_serve,
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="conductor",
                                description="Mooncake-style KV-cache-aware scheduler.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in SUBCOMMANDS:
        add(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from kvstore.core.errors import KVStoreError
    from workers.client import WorkerError

    try:
        return int(args.func(args))
    except (CliError, ValueError, KVStoreError, WorkerError) as exc:
        print(f"conductor {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        where = f": {exc.filename}" if getattr(exc, "filename", None) else ""
        print(f"conductor {args.command}: error: {exc.strerror or exc}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
