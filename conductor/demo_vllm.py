"""``make demo-vllm``: kvstore + Conductor in front of real vLLM servers, on 127.0.0.1.

Starts a kvstore node, one prefill (kv_both) and one decode (kv_consumer) vLLM OpenAI
server on a small random Llama written locally (no download), a plain colocated vLLM
without kvstore as the reference, and ``conductor serve``. Then sends a multi-turn chat
(each turn's prompt is the previous prompt, its answer and the new user tokens) and one
document asked about several times, and prints per request the prefix tokens the store
held on arrival, the TTFT seen by the client (streamed), and whether the greedy tokens
equal the reference's. Stops everything it started. Run with the vLLM environment's
Python (the Makefile target finds it).
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import httpx
import numpy as np

from conductor.front.vllm_procs import (
    VLLM_BLOCK,
    Proc,
    start_conductor,
    start_node,
    start_vllm,
    wait_ready,
    write_tiny_llama,
)

NAMESPACE = "demo-vllm"


def tokens(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def streamed(url: str, prompt: list[int], max_tokens: int, model: str | None = None
             ) -> tuple[list[int], float]:
    """Greedy tokens and the client's TTFT of one streamed completion."""
    body: dict = {"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                  "stream": True, "return_token_ids": True}
    if model:
        body["model"] = model
    t0 = time.monotonic()
    ttft = 0.0
    ids: list[int] = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {r.read().decode()[:300]}")
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(ev["error"]["message"])
            new = ev["choices"][0].get("token_ids") or []
            if new and not ids:
                ttft = time.monotonic() - t0
            ids += new
    return ids, ttft


def found_tokens(conductor: Proc) -> float:
    text = httpx.get(conductor.url + "/metrics", timeout=10).text
    for line in text.splitlines():
        if line.startswith("conductor_prefix_tokens_found_total "):
            return float(line.split()[1])
    return 0.0


def main() -> int:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-vllm-") as tmp:
        root = Path(tmp)
        try:
            print("demo-vllm: writing a random 2-layer Llama (no download)", flush=True)
            model = write_tiny_llama(root / "model")
            node = start_node(root)
            procs.append(node)
            print(f"demo-vllm: kvstore node on {node.url}; starting 3 vLLM servers "
                  f"(about a minute)", flush=True)
            p = start_vllm(sys.executable, model, root, name="prefill", store=node.url,
                           namespace=NAMESPACE, role="kv_both")
            d = start_vllm(sys.executable, model, root, name="decode", store=node.url,
                           namespace=NAMESPACE, role="kv_consumer")
            ref = start_vllm(sys.executable, model, root, name="reference", store=None)
            procs += [p, d, ref]
            for s in (p, d, ref):
                wait_ready(s, "/v1/models", 600)
            c = start_conductor(root, name="conductor", args=[
                "--store", node.url, "--vllm-prefill", p.url, "--vllm-decode", d.url,
                "--kv-namespace", NAMESPACE, "--block-tokens", str(VLLM_BLOCK),
                "--ttft-slo", "30s", "--tbt-slo", "1s"])
            procs.append(c)
            print(f"demo-vllm: conductor on {c.url} (prefill {p.url}, decode {d.url})\n")
            model_id = str(model)
            print(f"{'request':<26} {'prompt':>6} {'from store':>10} {'TTFT ms':>8} "
                  f"{'= colocated':>11}")
            all_equal = True

            def ask(label: str, prompt: list[int], n: int) -> list[int]:
                nonlocal all_equal
                before = found_tokens(c)
                got, ttft = streamed(c.url, prompt, n)
                want, _ = streamed(ref.url, prompt, n, model=model_id)
                found = int(found_tokens(c) - before)
                same = got == want
                all_equal &= same
                print(f"{label:<26} {len(prompt):>6} {found:>10} {ttft * 1000:>8.0f} "
                      f"{'yes' if same else 'NO':>11}", flush=True)
                return got

            history: list[int] = tokens(1, 40)  # system prompt + first user turn
            for turn in range(1, 5):
                answer = ask(f"chat turn {turn}", history, 24)
                history = history + answer + tokens(100 + turn, 30)
            doc = tokens(7, 480)
            for q in range(1, 5):
                ask(f"document, question {q}", doc + tokens(200 + q, 20), 16)
            print(f"\ndemo-vllm: greedy tokens {'all equal' if all_equal else 'DIFFER'} "
                  f"to a colocated vLLM without kvstore")
            return 0 if all_equal else 1
        finally:
            for proc in reversed(procs):
                proc.stop()
            print("demo-vllm: stopped everything it started", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
