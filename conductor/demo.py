"""``kvstore demo serving``: disaggregated serving on the store, end to end, on loopback.

Starts a kvstore node, two prefill and two decode worker processes (a small
Llama-style model with seeded random weights, on the CPU) and a Conductor, then
sends a stream of requests whose prompts share prefixes the way serving traffic
does: one system prompt; a document asked about several times; a multi-turn chat
whose every turn resends the whole conversation. Each request goes through the
Conductor, which picks the prefill worker (by where its prefix is cached) and the
decode worker. The stream runs twice: with the store as the KV cache, then with
the prefix lookup turned off (every prompt token computed), and the totals are
compared. Everything is stopped at the end.
"""

from __future__ import annotations

import argparse
import random
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from conductor.live.local import LocalServing
from conductor.live.service import ConductorClient
from workers.client import WorkerError
from workers.model import PRESETS


@dataclass(slots=True, kw_only=True)
class Turn:
    kind: str
    prompt: list[int]
    chat_reply_to: int | None = None  # index of the earlier turn whose output it extends


def workload(vocab: int, max_seq_len: int, *, seed: int = 1) -> list[Turn]:
    """The stream; prompt lengths shrink to fit models with a short context."""
    rng = random.Random(seed)
    scale = min(1.0, (max_seq_len - 100) / 1300)

    def toks(n: int) -> list[int]:
        return [rng.randrange(vocab) for _ in range(max(8, int(n * scale)))]

    system, doc1, doc2 = toks(384), toks(768), toks(640)
    turns = [Turn(kind="doc A, question 1", prompt=system + doc1 + toks(24)),
             Turn(kind="doc A, question 2", prompt=system + doc1 + toks(24)),
             Turn(kind="doc B, question 1", prompt=system + doc2 + toks(24)),
             Turn(kind="chat, turn 1", prompt=system + toks(64)),
             Turn(kind="doc A, question 3", prompt=system + doc1 + toks(24)),
             Turn(kind="chat, turn 2", prompt=toks(48), chat_reply_to=3),
             Turn(kind="doc B, question 2", prompt=system + doc2 + toks(24)),
             Turn(kind="chat, turn 3", prompt=toks(48), chat_reply_to=5)]
    return turns


def run_stream(client: ConductorClient, turns: list[Turn], max_new_tokens: int, *,
               use_cache: bool) -> list[dict[str, Any]]:
    results: list[dict[str, Any]] = []
    prompts: list[list[int]] = []
    for t in turns:
        prompt = t.prompt
        if t.chat_reply_to is not None:  # the conversation so far, its answer, a new message
            prev = results[t.chat_reply_to]
            prompt = prompts[t.chat_reply_to] + prev.get("tokens", []) + t.prompt
        prompts.append(prompt)
        results.append(client.generate(prompt, max_new_tokens, use_cache=use_cache))
    return results


def print_stream(title: str, turns: list[Turn], results: list[dict[str, Any]]) -> None:
    print(f"\n{title}")
    print(f"{'#':>2}  {'request':<18} {'prompt':>6} {'cached':>6} {'TTFT ms':>8} "
          f"{'TBT ms':>7} {'out':>4}  prefill -> decode")
    for i, (t, r) in enumerate(zip(turns, results, strict=True), 1):
        if r.get("rejected"):
            print(f"{i:>2}  {t.kind:<18} rejected: {r.get('reason')}")
            continue
        print(f"{i:>2}  {t.kind:<18} {r['prompt_tokens']:>6} {r['cached_tokens']:>6} "
              f"{r['ttft_s'] * 1e3:>8.0f} {r['tbt_s'] * 1e3:>7.1f} {len(r['tokens']):>4}  "
              f"{r['prefill']} -> {r['decode']}")


def totals(results: list[dict[str, Any]]) -> dict[str, float]:
    ok = [r for r in results if not r.get("rejected")]
    return {"requests": len(ok), "prompt_tokens": sum(r["prompt_tokens"] for r in ok),
            "cached_tokens": sum(r["cached_tokens"] for r in ok),
            "ttft_s": sum(r["ttft_s"] for r in ok),
            "tbt_s": sum(r["tbt_s"] for r in ok) / max(1, len(ok))}


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore demo serving", description=__doc__.split("\n")[0])
    p.add_argument("--model", default="small", choices=sorted(PRESETS))
    p.add_argument("--max-new-tokens", type=int, default=12)
    args = p.parse_args(argv)
    cfg = PRESETS[args.model]
    turns = workload(cfg.vocab_size, cfg.max_seq_len)
    with tempfile.TemporaryDirectory(prefix="kvstore-demo-serving-") as tmp:
        print(f"starting a kvstore node, 2 prefill + 2 decode workers ({args.model} model, "
              f"CPU) and a Conductor on 127.0.0.1 ...", flush=True)
        serving = LocalServing.up(tmp, model=args.model)
        try:
            assert serving.conductor is not None
            client = ConductorClient(serving.conductor.addr)
            with_cache = run_stream(client, turns, args.max_new_tokens, use_cache=True)
            without = run_stream(client, turns, args.max_new_tokens, use_cache=False)
        except WorkerError as exc:
            print(f"kvstore demo serving: error: {exc}", file=sys.stderr)
            return 1
        finally:
            codes = serving.stop()
    print_stream("with the store as the KV cache", turns, with_cache)
    print_stream("without it (prefix lookup off: every prompt token computed)", turns, without)
    a, b = totals(with_cache), totals(without)
    print(f"\ntotals over {a['requests']} requests: {a['cached_tokens']:.0f} of "
          f"{a['prompt_tokens']:.0f} prompt tokens came from the store "
          f"({a['cached_tokens'] / max(1, a['prompt_tokens']):.0%}); summed TTFT "
          f"{a['ttft_s']:.2f} s with the cache vs {b['ttft_s']:.2f} s without "
          f"({b['ttft_s'] / max(a['ttft_s'], 1e-9):.2f}x); mean TBT {a['tbt_s'] * 1e3:.1f} ms "
          f"vs {b['tbt_s'] * 1e3:.1f} ms")
    same = all(x.get("tokens") == y.get("tokens") for x, y in zip(with_cache, without,
                                                                   strict=True))
    print(f"generated tokens identical with and without the cache: {same}")
    bad = {k: v for k, v in codes.items() if v != 0}
    if bad:
        print(f"processes that did not stop cleanly: {bad}", file=sys.stderr)
        return 1
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
