"""``python -m benchmarks.serving_ttft``: time to first token, cold vs cached prefix,
on real worker processes.

Starts a kvstore node, a prefill and a decode worker (``--model`` preset, default
``small``: dim 512, 8 layers, 8 heads / 4 KV heads, float32) on loopback. Each
round draws a fresh shared prefix (``--cached-fraction`` of ``--prompt-tokens``,
rounded down to whole blocks) and sends, in order:

* ``cold``: prefix + suffix A, nothing stored: the whole prompt is computed and
  its blocks are written layer by layer while later layers compute;
* ``cached``: prefix + suffix B, the same length: the prefix comes from the store,
  only the suffix is computed;
* ``full hit``: prefix + suffix A again: every full block is stored.

Each request is prefilled, then decoded for ``--new-tokens`` tokens. TTFT is
measured by the client, from sending the prefill request to its reply (which
waits for the prefill's writes). Reports medians over ``--rounds`` rounds (after
one warm-up round) and writes ``benchmarks/results/serving_ttft.json``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from benchmarks.stats import format_table, write_json
from kvstore.core.ports import free_port
from workers.client import WorkerClient, generate

REPO = Path(__file__).resolve().parent.parent
RESULTS = REPO / "benchmarks" / "results"
VOCAB = {"tiny": 512, "small": 4096}


def _spawn(args: list[str], log: Path, ready: str, timeout: float = 120.0
           ) -> subprocess.Popen:
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                cwd=REPO, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    deadline = time.monotonic() + timeout
    while ready not in log.read_text():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise RuntimeError(f"{args[:3]} did not start:\n{log.read_text()}")
        time.sleep(0.05)
    return proc


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = np.random.default_rng(args.seed)
    vocab = VOCAB.get(args.model, 4096)
    B = args.block_tokens
    prefix_len = int(args.prompt_tokens * args.cached_fraction) // B * B
    suffix_len = args.prompt_tokens - prefix_len
    procs: list[subprocess.Popen] = []
    tmp = Path(tempfile.mkdtemp(prefix="serving_ttft-"))
    try:
        store = f"127.0.0.1:{free_port()}"
        procs.append(_spawn(["-m", "kvstore", "serve", "--listen", store, "--dram-bytes",
                             args.dram, "--no-prefault"], tmp / "node.log",
                            "kvstore: serving on"))
        common = ["--store", store, "--model-config", args.model, "--seed", "0",
                  "--block-tokens", str(B)]
        addrs = {}
        for role in ("prefill", "decode"):
            addrs[role] = f"127.0.0.1:{free_port()}"
            procs.append(_spawn(["-m", "workers", role, "--listen", addrs[role], *common],
                                tmp / f"{role}.log", f"workers: {role} serving on"))
        pc = WorkerClient(addrs["prefill"], timeout=600)
        dc = WorkerClient(addrs["decode"], timeout=600)
        rows: dict[str, list[dict[str, Any]]] = {"cold": [], "cached": [], "full hit": []}
        for rnd in range(args.rounds + 1):
            prefix = rng.integers(0, vocab, prefix_len).tolist()
            suffix_a = rng.integers(0, vocab, suffix_len).tolist()
            suffix_b = rng.integers(0, vocab, suffix_len).tolist()
            for case, p in (("cold", prefix + suffix_a), ("cached", prefix + suffix_b),
                            ("full hit", prefix + suffix_a)):
                r = generate(pc, dc, p, args.new_tokens)
                if rnd > 0:  # round 0 warms up allocators and kernels
                    rows[case].append(r)
        health = {"prefill": pc.health(), "decode": dc.health()}
    finally:
        for p in reversed(procs):
            _stop(p)

    def med(case: str, get: Any) -> float | None:
        vals = [get(r) for r in rows[case]]
        vals = [v for v in vals if v is not None]
        return statistics.median(vals) if vals else None

    summary: dict[str, dict[str, Any]] = {}
    for case in rows:
        summary[case] = {
            "prompt_tokens": args.prompt_tokens,
            "cached_tokens": med(case, lambda r: r["prefill"]["cached_tokens"]),
            "ttft_s": med(case, lambda r: r["ttft_s"]),
            "worker_ttft_s": med(case, lambda r: r["prefill"]["ttft_s"]),
            "lookup_s": med(case, lambda r: r["prefill"]["lookup_s"]),
            "fetch_s": med(case, lambda r: r["prefill"]["fetch_s"]),
            "compute_s": med(case, lambda r: r["prefill"]["compute_s"]),
            "store_write_s": med(case, lambda r: r["prefill"]["store_write_s"]),
            "write_tail_s": med(case, lambda r: r["prefill"]["write_tail_s"]),
            "write_overlap": med(case, lambda r: r["prefill"]["write_overlap"]),
            "fetched_mib": med(case, lambda r: r["prefill"]["fetched_bytes"] / 2**20),
            "written_mib": med(case, lambda r: r["prefill"]["written_bytes"] / 2**20),
            "decode_load_s": med(case, lambda r: r["decode"]["load_s"]),
            "mean_tbt_s": med(case, lambda r: r["decode"]["mean_tbt_s"]),
        }
    cold, cached = summary["cold"]["ttft_s"], summary["cached"]["ttft_s"]
    return {
        "benchmark": "serving_ttft",
        "params": vars(args),
        "summary": summary,
        "ttft_cold_over_cached": cold / cached if cold and cached else None,
        "health": health,
        "rounds": {case: [{k: v for k, v in r.items() if k != "tokens"} for r in rs]
                   for case, rs in rows.items()},
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.serving_ttft",
                                description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small",
                   help="model preset or config (workers --model-config)")
    p.add_argument("--prompt-tokens", type=int, default=2048)
    p.add_argument("--cached-fraction", type=float, default=0.9)
    p.add_argument("--block-tokens", type=int, default=16)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dram", default="1GiB", help="node DRAM tier size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", type=Path, default=RESULTS / "serving_ttft.json")
    args = p.parse_args(argv)
    result = run(args)
    headers = ["case", "cached", "TTFT ms", "lookup", "fetch", "compute", "write", "exposed",
               "overlap", "fetched MiB", "written MiB", "TBT ms"]
    table = []
    for case, s in result["summary"].items():
        ms = (lambda x: None if x is None else 1e3 * x)  # noqa: E731
        table.append([case, f"{s['cached_tokens']:.0f}/{s['prompt_tokens']}", ms(s["ttft_s"]),
                      ms(s["lookup_s"]), ms(s["fetch_s"]), ms(s["compute_s"]),
                      ms(s["store_write_s"]), ms(s["write_tail_s"]), s["write_overlap"],
                      s["fetched_mib"], s["written_mib"], ms(s["mean_tbt_s"])])
    print(f"model {args.model}, prompt {args.prompt_tokens} tokens, block {args.block_tokens}, "
          f"median of {args.rounds} rounds (phase times in ms; 'exposed' = write time after "
          f"compute, inside TTFT)")
    print(format_table(headers, table))
    ratio = result["ttft_cold_over_cached"]
    print(f"TTFT cold / cached: {ratio:.2f}x" if ratio else "TTFT ratio: n/a")
    print(f"wrote {write_json(args.out, result)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
