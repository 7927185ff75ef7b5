"""``python -m benchmarks.connector_loads``: what KVStoreConnector's load path costs apart
from the engine, against the bytes it moves (issue #28, part 3).

One kvstore node on 127.0.0.1; this process plays the connector's worker: for each size
(``--hit-tokens``, in blocks of 32 tokens of the random Llama ``--vllm-model``'s shape,
float32), sealed blocks are put once, then per repetition, alternating:

* ``bytes/bw``: ``get_batch_into`` of the same values into preallocated buffers (the
  node's get bandwidth as this process sees it, nothing else done);
* ``one batch``: ``loads.load_blocks`` with every block in one chunk (the loader before
  chunking: fetch all, then check all, then copy all);
* ``chunked``: ``loads.load_blocks`` as the connector runs it (``CHUNK_BYTES`` chunks,
  the next chunk's fetch overlapping this one's checks and copies).

Each load fetches, checks (header, key, xxh3 checksum) and copies every layer into cache
tensors of the model's CPU layout. Medians of ``--reps``; ratios to ``bytes/bw``. Writes
``benchmarks/results/connector_loads.{json,png}``. The engine's part of a hit (the step
that learns the load is done, the tail's compute) is ``benchmarks.connector_cost``'s.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import torch

from benchmarks.stats import Panel, format_table, median, plot_panels, write_json
from conductor.front.vllm_procs import REPO, VLLM_BLOCK, start_node
from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, BlockLayout
from kvstore.integrations.vllm.loads import CHUNK_BYTES, load_blocks

RESULTS = REPO / "benchmarks" / "results"
ONE_BATCH = 1 << 62
"""A chunk size no load reaches: every block in one chunk."""


def layout_of(hidden: int, layers: int) -> BlockLayout:
    """A block of ``write_tiny_llama(hidden=, layers=)`` in vLLM's CPU cache layout: per
    layer ``[kv_heads, block, 2 * head_dim]`` of float32 (``hidden / 64`` KV heads of 32)."""
    return BlockLayout(layer_shapes=((hidden // 64, VLLM_BLOCK, 64),) * layers,
                       dtype=torch.float32)


def one_size(client: Client, fetcher: ThreadPoolExecutor, layout: BlockLayout, tokens: int,
             reps: int, tag: str) -> dict[str, Any]:
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
    times: dict[str, list[float]] = {"bytes/bw": [], "one batch": [], "chunked": []}
    for _ in range(reps):
        t0 = time.perf_counter()
        client.get_batch_into(keys, bufs)
        times["bytes/bw"].append(time.perf_counter() - t0)
        for name, chunk in (("one batch", ONE_BATCH), ("chunked", CHUNK_BYTES)):
            for kv in caches:
                kv.zero_()
            t0 = time.perf_counter()
            out = load_blocks(client, fetcher, layout, keys, list(range(n)), scatter,
                              chunk_bytes=chunk)
            times[name].append(time.perf_counter() - t0)
            if out.loaded != n:
                raise RuntimeError(f"{name}: loaded {out.loaded} of {n} blocks")
        written = caches[0][n - 1].numpy().tobytes()  # bytes: random payloads hold NaNs
        if written != layout.layer_view(rows[n - 1:], 0)[0].numpy().tobytes():
            raise RuntimeError("the last block's first layer was not written")
    med = {k: median(v) for k, v in times.items()}
    return {"tokens": tokens, "bytes": n * layout.value_bytes,
            **{f"{k}_s": v for k, v in med.items()},
            "one_batch_over_bytes": med["one batch"] / med["bytes/bw"],
            "chunked_over_bytes": med["chunked"] / med["bytes/bw"],
            "one_batch_over_chunked": med["one batch"] / med["chunked"], "samples": times}


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
                f"{args.reps} repetitions, chunks of {CHUNK_BYTES >> 20} MiB")
    print(settings, flush=True)
    rows = []
    root = Path(f"/tmp/connector-loads-{time.time_ns()}")
    root.mkdir(parents=True)
    node = start_node(root, dram="2GiB")
    try:
        with Client(node.url) as client, ThreadPoolExecutor(1) as fetcher:
            for tokens in args.hit_tokens:
                rows.append(one_size(client, fetcher, layout, tokens, args.reps,
                                     f"{tokens}-{time.time_ns()}"))
    finally:
        node.stop()
    print(format_table(
        ["cached tokens", "MiB", "bytes/bw ms", "one batch ms", "chunked ms",
         "one batch / bytes", "chunked / bytes", "one batch / chunked"],
        [[r["tokens"], r["bytes"] / 2**20, r["bytes/bw_s"] * 1e3, r["one batch_s"] * 1e3,
          r["chunked_s"] * 1e3, r["one_batch_over_bytes"], r["chunked_over_bytes"],
          r["one_batch_over_chunked"]] for r in rows]))
    path = write_json(args.out / "connector_loads.json", {
        "settings": settings, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rows": rows})
    try:
        plot_panels(args.out / "connector_loads.png", [Panel(
            "a load apart from the engine", [r["tokens"] for r in rows],
            {k: [r[f"{k}_s"] for r in rows] for k in ("bytes/bw", "one batch", "chunked")},
            xlabel="cached tokens", ylabel="seconds", logy=True)], title=settings)
    except ImportError:
        print("matplotlib missing: no plot")
    print(f"wrote {path} and .png")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
