"""``make demo-vllm``: kvstore + Conductor in front of real vLLM servers, on 127.0.0.1.

Starts a kvstore node, one prefill (kv_both) and one decode (kv_consumer) vLLM OpenAI
server on a random Llama written locally (no download; 512 wide and 4 layers, so a
prompt's prefill costs real compute on a CPU), a plain vLLM without kvstore as the
reference, and ``conductor serve``. Every vLLM server's own KV cache holds one and a half
of the demo's documents. Then asks the same questions of both: a multi-turn chat (each turn's
prompt is the previous prompt, its answer and the new user tokens) and four documents
asked about three times each, in turns, so a document comes back after the instances'
own caches have moved on to others. It prints per request the prefix tokens the store
held on arrival, the TTFT seen by the client (streamed) with the store and without it,
side by side, and whether the greedy tokens are equal; then the TTFT medians. Stops
everything it started. Run with the vLLM environment's Python (the Makefile target finds
it).
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
HIDDEN, LAYERS = 512, 4
KV_BYTES_PER_TOKEN = 2 * LAYERS * (HIDDEN // 64) * 32 * 4
"""K and V, per layer, of ``HIDDEN // 64`` KV heads of 32 float32 values."""
DOC_TOKENS = 1200
MAX_MODEL_LEN = 2048
INSTANCE_CACHE_BYTES = (3 * DOC_TOKENS // 2 + 400) * KV_BYTES_PER_TOKEN
"""Each instance's own KV cache: one and a half documents and the chat."""


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


def median(xs: list[float]) -> float:
    return sorted(xs)[len(xs) // 2]


def main() -> int:
    procs: list[Proc] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-vllm-") as tmp:
        root = Path(tmp)
        try:
            print(f"demo-vllm: writing a random Llama ({HIDDEN} wide, {LAYERS} layers, "
                  f"{KV_BYTES_PER_TOKEN // 1024} KiB of KV per token; no download)",
                  flush=True)
            model = write_tiny_llama(root / "model", hidden=HIDDEN, layers=LAYERS)
            node = start_node(root, kv_events=True)
            procs.append(node)
            print(f"demo-vllm: kvstore node on {node.url}; starting 3 vLLM servers, each "
                  f"with {INSTANCE_CACHE_BYTES >> 20} MiB of KV cache (a minute or two)",
                  flush=True)
            def vllm(name: str, role: str | None) -> Proc:
                return start_vllm(sys.executable, model, root, name=name,
                                  store=node.url if role else None, namespace=NAMESPACE,
                                  role=role or "kv_both", max_model_len=MAX_MODEL_LEN,
                                  kv_cache_bytes=INSTANCE_CACHE_BYTES)

            p, d, ref = vllm("prefill", "kv_both"), vllm("decode", "kv_consumer"), vllm(
                "reference", None)
            procs += [p, d, ref]
            for s in (p, d, ref):
                wait_ready(s, "/v1/models", 600)
            c = start_conductor(root, name="conductor", args=[
                "--store", node.url, "--vllm-prefill", p.url, "--vllm-decode", d.url,
                "--kv-namespace", NAMESPACE, "--block-tokens", str(VLLM_BLOCK),
                "--ttft-slo", "60s", "--tbt-slo", "5s"])
            procs.append(c)
            print(f"demo-vllm: conductor on {c.url} (prefill {p.url}, decode {d.url}); "
                  f"without the store: the plain vLLM on {ref.url}\n")
            model_id = str(model)
            print(f"{'request':<22} {'prompt':>6} {'from store':>10} "
                  f"{'TTFT with store':>15} {'without':>8} {'same tokens':>11}")
            all_equal = True
            with_store: list[float] = []
            without: list[float] = []
            revisits: list[int] = []  # indexes of a document's later questions

            def ask(label: str, prompt: list[int], n: int) -> list[int]:
                nonlocal all_equal
                before = found_tokens(c)
                got, ttft = streamed(c.url, prompt, n)
                want, ttft_ref = streamed(ref.url, prompt, n, model=model_id)
                found = int(found_tokens(c) - before)
                same = got == want
                all_equal &= same
                with_store.append(ttft)
                without.append(ttft_ref)
                print(f"{label:<22} {len(prompt):>6} {found:>10} {ttft * 1000:>12.0f} ms "
                      f"{ttft_ref * 1000:>5.0f} ms {'yes' if same else 'NO':>11}",
                      flush=True)
                return got

            history: list[int] = tokens(1, 40)  # system prompt + first user turn
            for turn in range(1, 5):
                answer = ask(f"chat turn {turn}", history, 24)
                history = history + answer + tokens(100 + turn, 30)
            docs = [tokens(7 + i, DOC_TOKENS) for i in range(4)]
            for q in range(1, 4):
                for i, doc in enumerate(docs):
                    if q > 1:
                        revisits.append(len(with_store))
                    ask(f"document {i + 1}, question {q}", doc + tokens(200 + 10 * q + i, 20),
                        16)
            print(f"\ndemo-vllm: TTFT median {median(with_store) * 1000:.0f} ms with the "
                  f"store (prefill + decode through the Conductor), "
                  f"{median(without) * 1000:.0f} ms without (one plain vLLM): "
                  f"{median(without) / median(with_store):.2f}x")
            again = (median([with_store[i] for i in revisits]),
                     median([without[i] for i in revisits]))
            print(f"demo-vllm: a document's later questions: {again[0] * 1000:.0f} ms with "
                  f"the store, {again[1] * 1000:.0f} ms without: {again[1] / again[0]:.2f}x")
            print(f"demo-vllm: greedy tokens {'all equal' if all_equal else 'DIFFER'} "
                  f"to a vLLM without kvstore")
            return 0 if all_equal else 1
        finally:
            for proc in reversed(procs):
                proc.stop()
            print("demo-vllm: stopped everything it started", flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
