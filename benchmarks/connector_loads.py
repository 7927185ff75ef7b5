"""``python -m benchmarks.connector_loads``: what KVStoreConnector's load path costs apart
from the engine, against the bytes it moves (issue #28, part 3).

One kvstore node on 127.0.0.1; this process plays the connector's worker: for each size
(``--hit-tokens``, in blocks of 32 tokens of the random Llama ``--vllm-model``'s shape,
float32), sealed blocks are put once, then per repetition, alternating:

* ``bytes/bw``: ``get_batch_into`` of the same values into preallocated buffers (the
  node's get bandwidth as this process sees it, nothing else done);
* ``load``: ``loads.load_blocks`` as the connector's loader thread runs it: one fetch,
  every value checked (header, key, xxh3 checksum), every layer copied into cache tensors
  of the model's CPU layout.

Each in four conditions: with and without a *spinner* (a thread running Python in a loop
beside the load, as vLLM's engine loop does while a request waits for its load with
nothing else to compute), at the interpreter's default GIL switch interval (5 ms) and at
the connector's (``GIL_SWITCH_MS``). Medians of ``--reps``; the load's ratio to
``bytes/bw``. Writes ``benchmarks/results/connector_loads.{json,png}``.
The engine's part of a hit (the step that learns the load is done, the tail's compute) is
``benchmarks.connector_cost``'s.
"""

from __future__ import annotations

import argparse
import sys
import threading
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

from benchmarks.stats import Panel, format_table, median, plot_panels, write_json
from conductor.front.vllm_procs import REPO, VLLM_BLOCK, start_node
from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, BlockLayout
from kvstore.integrations.vllm.loads import Staging, load_blocks
from kvstore.integrations.vllm.threads import GIL_SWITCH_MS

RESULTS = REPO / "benchmarks" / "results"
DEFAULT_SWITCH_S = 0.005
"""The interpreter's default GIL switch interval."""


def layout_of(hidden: int, layers: int) -> BlockLayout:
    """A block of ``write_tiny_llama(hidden=, layers=)`` in vLLM's CPU cache layout: per
    layer ``[kv_heads, block, 2 * head_dim]`` of float32 (``hidden / 64`` KV heads of 32)."""
    return BlockLayout(layer_shapes=((hidden // 64, VLLM_BLOCK, 64),) * layers,
                       dtype=torch.float32)


@contextmanager
def condition(*, spinner: bool, switch_s: float) -> Iterator[None]:
    """The GIL switch interval at ``switch_s`` and, with ``spinner``, a thread running Python
    in a loop (vLLM's engine loop while its only request waits for a load)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(switch_s)
    stop = threading.Event()

    def spin() -> None:
        x = 0
        while not stop.is_set():
            for i in range(1000):
                x += i

    th = threading.Thread(target=spin, name="spinner")
    if spinner:
        th.start()
    try:
        yield
    finally:
        stop.set()
        if spinner:
            th.join()
        sys.setswitchinterval(before)


def one_size(client: Client, layout: BlockLayout, tokens: int,
             reps: int, tag: str, *, spinner: bool, switch_s: float) -> dict[str, Any]:
    n = tokens // VLLM_BLOCK
    keys = list(block_keys(list(range(tokens)), VLLM_BLOCK, f"connector-loads-{tag}"))
    rows = layout.new_staging(n)
    rows[:, HEADER_BYTES:] = torch.randint(0, 255, (n, layout.value_bytes - HEADER_BYTES),
                                           dtype=torch.uint8)
    layout.seal(rows, keys)
    client.put_batch(keys, [bytes(rows[i].numpy()) for i in range(n)])
    caches = [torch.zeros((n + 8, *shape)) for shape in layout.layer_shapes]

    def scatter(staging: torch.Tensor, ids: Sequence[int]) -> None:
        t = torch.tensor(list(ids), dtype=torch.long)
        for layer, kv in enumerate(caches):
            layout.scatter_layer(staging, layer, kv, t)

    bufs = [bytearray(layout.value_bytes) for _ in range(n)]
    staging = Staging()  # as the connector's loader thread keeps one
    times: dict[str, list[float]] = {"bytes/bw": [], "load": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        client.get_batch_into(keys, bufs)
        times["bytes/bw"].append(time.perf_counter() - t0)
        for kv in caches:
            kv.zero_()
        with condition(spinner=spinner, switch_s=switch_s):
            t0 = time.perf_counter()
            out = load_blocks(client, layout, keys, list(range(n)), scatter, staging)
            times["load"].append(time.perf_counter() - t0)
        if out.loaded != n:
            raise RuntimeError(f"loaded {out.loaded} of {n} blocks")
        written = caches[0][n - 1].numpy().tobytes()  # bytes: random payloads hold NaNs
        if written != layout.layer_view(rows[n - 1:], 0)[0].numpy().tobytes():
            raise RuntimeError("the last block's first layer was not written")
    med = {k: median(v) for k, v in times.items()}
    return {"tokens": tokens, "bytes": n * layout.value_bytes, "spinner": spinner,
            "switch_ms": switch_s * 1e3,
            "median_s": med, "over_bytes": {k: v / med["bytes/bw"] for k, v in med.items()},
            "samples": times}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.connector_loads",
                                 description=__doc__.split("\n\n")[0])
    ap.add_argument("--vllm-model", default="512,4", help="HIDDEN,LAYERS of the random Llama")
    ap.add_argument("--hit-tokens", default="256,1024,1920",
                    type=lambda s: [int(x) for x in s.split(",") if x])
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--out", type=Path, default=RESULTS)
    args = ap.parse_args(argv)
    if any(n % VLLM_BLOCK or n <= 0 for n in args.hit_tokens):
        ap.error(f"--hit-tokens must be positive multiples of {VLLM_BLOCK}")
    hidden, layers = (int(x) for x in args.vllm_model.split(","))
    layout = layout_of(hidden, layers)
    settings = (f"blocks of a random Llama {hidden} wide, {layers} layers "
                f"({layout.value_bytes} bytes per stored block of {VLLM_BLOCK} tokens), "
                f"{args.reps} repetitions")
    print(settings, flush=True)
    rows = []
    root = Path(f"/tmp/connector-loads-{time.time_ns()}")
    root.mkdir(parents=True)
    node = start_node(root, dram="2GiB")
    try:
        with Client(node.url) as client:
            for spinner in (False, True):
                for switch_s in (DEFAULT_SWITCH_S, GIL_SWITCH_MS / 1e3):
                    for tokens in args.hit_tokens:
                        rows.append(one_size(client, layout, tokens, args.reps,
                                             f"{tokens}-{time.time_ns()}", spinner=spinner,
                                             switch_s=switch_s))
    finally:
        node.stop()
    names = list(rows[0]["median_s"]) if rows else []
    print(format_table(
        ["spinner", "switch ms", "cached tokens", "MiB", *(f"{k} ms" for k in names),
         *(f"{k} / bytes" for k in names[1:])],
        [["yes" if r["spinner"] else "no", r["switch_ms"], r["tokens"], r["bytes"] / 2**20,
          *(r["median_s"][k] * 1e3 for k in names), *(r["over_bytes"][k] for k in names[1:])]
         for r in rows]))
    path = write_json(args.out / "connector_loads.json", {
        "settings": settings, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows})
    try:
        panels = []
        for spinner in (False, True):
            for switch_ms in sorted({r["switch_ms"] for r in rows}, reverse=True):
                sel = [r for r in rows if r["spinner"] == spinner and r["switch_ms"] == switch_ms]
                panels.append(Panel(
                    f"{'with' if spinner else 'no'} spinner, switch {switch_ms:g} ms",
                    [r["tokens"] for r in sel],
                    {k: [r["median_s"][k] for r in sel] for k in names},
                    xlabel="cached tokens", ylabel="seconds", logy=True))
        plot_panels(args.out / "connector_loads.png", panels, title=settings)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
