"""``python -m workers prefill|decode``: run one worker process.

    python -m workers prefill --store 127.0.0.1:7600 --listen 127.0.0.1:7700 \\
        [--model-config small|tiny|PATH] [--seed 0] [--block-tokens 16]
    python -m workers decode  --store 127.0.0.1:7600 --listen 127.0.0.1:7701 [--max-batch 8]

Prefill and decode workers of one deployment must agree on the model (config,
seed or checkpoint, dtype) and ``--block-tokens``: those name the store namespace.
Exit codes: 0 after SIGTERM/SIGINT, 2 bad arguments or an unusable model or store.
"""

from __future__ import annotations

import argparse
import logging
import sys
from typing import Any


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m workers", description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="role", required=True)
    for role in ("prefill", "decode"):
        s = sub.add_parser(role, help=f"run a {role} worker")
        s.add_argument("--store", required=True, help="kvstore node HOST:PORT")
        s.add_argument("--listen", default="127.0.0.1:0",
                       help="HOST:PORT to serve on (port 0: any free port)")
        s.add_argument("--model-config", default="tiny",
                       help="preset (tiny, small), a Hugging Face checkpoint directory, "
                            "or a JSON file of ModelConfig fields")
        s.add_argument("--seed", type=int, default=0, help="weights seed for random models")
        s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                       help="override the model dtype")
        s.add_argument("--device", default="cpu", help="torch device (cpu, cuda, cuda:1, ...)")
        s.add_argument("--block-tokens", type=int, default=16, help="tokens per KV block")
        s.add_argument("--namespace", default=None,
                       help="store namespace (default: from the model, dtype and layout)")
        s.add_argument("--threads", type=int, default=0,
                       help="torch intra-op threads (0: torch's default)")
        s.add_argument("--transport", choices=["auto", "grpc", "tcp", "shm"], default="auto",
                       help="kvstore client transport")
        s.add_argument("--log-level", default="info",
                       choices=["debug", "info", "warning", "error"])
        if role == "decode":
            s.add_argument("--max-batch", type=int, default=8,
                           help="most requests decoded together (continuous batching)")
            s.add_argument("--keep-tail", action="store_true",
                           help="leave the prefill's request-scoped tail objects in the store")
    return p


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    if args.block_tokens <= 0:
        print("error: --block-tokens must be positive", file=sys.stderr)
        return 2
    from kvstore import Client, KVStoreError
    from workers.server import Service, parse_listen, serve

    try:
        parse_listen(args.listen)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    # The store first: it needs no torch, so a wrong address fails in a fraction of a second.
    store = Client(args.store, transport=args.transport)
    try:
        store.exists([bytes(16)])
    except KVStoreError as exc:
        print(f"error: store {args.store}: {exc}", file=sys.stderr)
        store.close()
        return 2
    import torch

    from workers.model import load_model

    if args.threads > 0:
        torch.set_num_threads(args.threads)
    try:
        model = load_model(args.model_config, seed=args.seed, device=args.device,
                           dtype=args.dtype)
    except (OSError, ValueError, KeyError) as exc:
        print(f"error: model {args.model_config!r}: {exc}", file=sys.stderr)
        store.close()
        return 2
    if args.role == "prefill":
        from workers.prefill import PrefillWorker

        # A PrefillWorker or a DecodeWorker, as Service.worker takes it.
        worker: Any = PrefillWorker(model, store, block_tokens=args.block_tokens,
                                    namespace=args.namespace)
        close = store.close
    else:
        from workers.decode import DecodeWorker

        dworker = DecodeWorker(model, store, block_tokens=args.block_tokens,
                               namespace=args.namespace, max_batch=args.max_batch,
                               remove_tail=not args.keep_tail)
        worker = dworker

        def close() -> None:
            dworker.close()
            store.close()

    logging.getLogger("workers").info("%s worker: model %s, namespace %s, store %s via %s",
                                      args.role, model.name, worker.namespace,
                                      args.store, store.transport)
    try:
        return serve(Service(role=args.role, worker=worker), args.listen, on_stop=close)
    except OSError as exc:
        print(f"error: cannot serve on {args.listen}: {exc}", file=sys.stderr)
        close()
        return 2


if __name__ == "__main__":
    sys.exit(main())
