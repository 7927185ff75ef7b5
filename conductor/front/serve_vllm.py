"""``conductor serve`` in front of vLLM instances: arguments -> store, front, event loop.

Prints ``conductor: serving on HOST:PORT ...`` once what the instances told it was
checked (``conductor.front.vllm_startup``: model, namespace, block size, roles, tokenizer)
and the probe passed; stops on SIGTERM / SIGINT. ``--kv-namespace`` and ``--block-tokens``
are optional: the instances' connectors say theirs, and the flags, when given, must
agree. The durability wait follows the store nodes' KV events when they publish them
(``conductor.front.store_events``), and polls the store otherwise.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
from collections.abc import Callable
from typing import Any

from conductor.scheduling.types import Slo


def run_serve_vllm(args: argparse.Namespace, addrs: Callable[[str], list[str]],
                   cli_error: type[Exception]) -> int:
    if args.vllm and (args.vllm_prefill or args.vllm_decode):
        raise cli_error("--vllm (colocated) cannot be combined with "
                        "--vllm-prefill/--vllm-decode")
    if not args.vllm and not (args.vllm_prefill and args.vllm_decode):
        raise cli_error("disaggregated serving needs both --vllm-prefill and --vllm-decode")
    if bool(args.store) == bool(args.etcd):
        raise cli_error("give exactly one of --store HOST:PORT and --etcd HOST:PORT")
    host, _, port = args.listen.rpartition(":")
    if not host or not port.isdigit():
        raise cli_error(f"--listen must be HOST:PORT, got {args.listen!r}")
    codec = None
    if args.tokenizer is not None:
        from conductor.front.text_prompts import TextCodec

        codec = TextCodec.load(args.tokenizer)

    from conductor.front.http_front import serve
    from conductor.front.store_events import BlockEvents, NoEvents, event_sources
    from conductor.front.store_view import StoreView
    from conductor.front.vllm_front import FrontConfig, VllmFront
    from kvstore.client import Client

    store: Any
    if args.etcd:
        quorum = args.write_quorum or args.replicas
        store = Client(etcd=args.etcd, replicas=args.replicas, write_quorum=quorum)
    else:
        quorum = 1
        store = Client(args.store)
    config = FrontConfig(namespace=args.kv_namespace or "",
                         block_tokens=args.block_tokens or 0,
                         slo=Slo(ttft_s=args.ttft_slo, tbt_s=args.tbt_slo),
                         policy=args.policy, rejection=args.rejection,
                         upstream_timeout_s=args.upstream_timeout,
                         durable_timeout_s=args.durable_timeout,
                         session_retain_s=args.session_ttl)
    view = StoreView(store, write_quorum=quorum)
    front = VllmFront(config=config, store=view,
                      prefill=addrs(args.vllm_prefill) if args.vllm_prefill else (),
                      decode=addrs(args.vllm_decode) if args.vllm_decode else (),
                      colocated=addrs(args.vllm) if args.vllm else ())
    mode = ("colocated" if args.vllm else
            f"{len(front.prefill)} prefill + {len(front.decode)} decode")

    def ready(addr: str) -> None:
        text = ("forwarded to the instances" if front.instances_tokenize else
                "--tokenizer" if codec is not None else "token ids only")
        durability = (f"KV events from {view.events.describe()}" if view.events is not None
                      else "polling the store")
        print(f"conductor: serving on {addr} ({mode} vLLM, model {front.model}, namespace "
              f"{front.namespace!r}, block {front.block_tokens}, policy {args.policy}, "
              f"rejection {args.rejection}, TTFT SLO {args.ttft_slo:g}s, "
              f"TBT SLO {args.tbt_slo:g}s, text {text}, durability by {durability}, "
              f"session TTL {args.session_ttl:g}s)",
              flush=True)

    async def main() -> None:
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        events = None
        try:
            sources = await asyncio.to_thread(event_sources, store, args.store)
            events = BlockEvents(sources)
            view.use_events(events)
        except NoEvents as exc:
            print(f"conductor: durability by polling the store: {exc}", flush=True)
        try:
            await serve(front, host=host, port=int(port), codec=codec, stop=stop,
                        on_ready=ready)
        finally:
            if events is not None:
                events.close()

    from conductor.front.vllm_instances import UpstreamError

    try:
        asyncio.run(main())
    except UpstreamError as exc:
        raise cli_error(str(exc)) from None
    finally:
        store.close()
    print("conductor: stopped", flush=True)
    return 0
