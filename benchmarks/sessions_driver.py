"""Replays the sessions workload against a running ``conductor serve`` and samples the node.

Each session runs as its own task: turn 0 at its start time, then for every later turn a
tool pause after the previous answer, then the grown prompt (``next_prompt``). Beside
them, the one-off traffic (``background``) writes its blocks straight to the node at their
arrival times until the sessions end (``put_background``, in a thread): the cache pressure
of other requests without their prefill compute, which two shared CPU cores cannot pay
for. The requests:

* ``toy`` (the project's workers behind ``conductor serve --prefill/--decode``):
  ``POST /generate`` ``{"token_ids", "max_new_tokens"}``; the reply's ``ttft_s`` (measured
  by the Conductor, from its receipt to the prefill's first token: that service does not
  stream) and ``cached_tokens`` (the prefill worker's prefix fetched from the store);
* ``vllm`` (vLLM behind ``conductor serve --vllm``): ``POST /v1/completions``, streamed, with
  ``return_token_ids`` and ``stream_options.include_usage``; TTFT at the client, from
  sending to the first token, and the usage's ``prompt_tokens_details.cached_tokens``
  (vLLM's own prefix cache plus what its connector loaded from the store; the instances
  run with ``--enable-prompt-tokens-details``).

With ``session_header`` each session's requests carry ``X-Session-Affinity: <id>``; with
``release`` a session's last answer is followed by ``DELETE /v1/sessions/<id>`` (a
Conductor without sessions refuses it: counted, not an error).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from benchmarks.sessions_report import Sample, TurnRecord
from benchmarks.sessions_workload import OneOff, SessionPlan, WorkloadSpec, next_prompt

SESSION_HEADER = "X-Session-Affinity"


@dataclass(slots=True, kw_only=True)
class Answer:
    ok: bool
    status: int
    tokens: list[int] = field(default_factory=list)
    ttft_s: float | None = None
    cached_tokens: int | None = None


async def ask_toy(http: httpx.AsyncClient, url: str, prompt: list[int], output: int,
                  headers: dict[str, str]) -> Answer:
    r = await http.post(url + "/generate", json={"token_ids": prompt,
                                                 "max_new_tokens": output}, headers=headers)
    if r.status_code != 200:
        return Answer(ok=False, status=r.status_code)
    body = r.json()
    return Answer(ok=True, status=200, tokens=[int(t) for t in body["tokens"]],
                  ttft_s=float(body["ttft_s"]), cached_tokens=int(body["cached_tokens"]))


async def ask_vllm(http: httpx.AsyncClient, url: str, prompt: list[int], output: int,
                   headers: dict[str, str], model: str) -> Answer:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0,
            "ignore_eos": True, "stream": True, "return_token_ids": True,
            "stream_options": {"include_usage": True}}
    t0 = time.monotonic()
    out = Answer(ok=True, status=200)
    async with http.stream("POST", url + "/v1/completions", json=body,
                           headers=headers) as r:
        if r.status_code != 200:
            await r.aread()
            return Answer(ok=False, status=r.status_code)
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                return Answer(ok=False, status=502)
            for ch in ev.get("choices") or []:
                new = ch.get("token_ids") or []
                if new and out.ttft_s is None:
                    out.ttft_s = time.monotonic() - t0
                out.tokens += [int(t) for t in new]
            usage = ev.get("usage")
            if usage:
                details = usage.get("prompt_tokens_details") or {}
                if details.get("cached_tokens") is not None:
                    out.cached_tokens = int(details["cached_tokens"])
    return out


Ask = Callable[[httpx.AsyncClient, list[int], int, dict[str, str]], Any]


@dataclass(slots=True, kw_only=True)
class Replay:
    """One replay: what to send where, and what came back."""

    spec: WorkloadSpec
    sessions: list[SessionPlan]
    background: list[OneOff]
    ask: Ask
    put_background: Callable[[tuple[int, ...]], bool]
    url: str
    session_header: bool
    release: bool = False
    records: list[TurnRecord] = field(default_factory=list)
    background_ok: int = 0
    background_failed: int = 0
    released: dict[int, int] = field(default_factory=dict)  # HTTP status -> count

    async def run_session(self, http: httpx.AsyncClient, plan: SessionPlan,
                          t_start: float) -> None:
        await asyncio.sleep(max(0.0, t_start + plan.start_s - time.monotonic()))
        headers = {SESSION_HEADER: plan.id} if self.session_header else {}
        prompt: list[int] = []
        answer: list[int] = []
        for i, turn in enumerate(plan.turns):
            if i:
                await asyncio.sleep(turn.pause_s)
            prev = len(prompt) + len(answer)
            prompt = next_prompt(prompt, answer, turn.user)
            sent = time.monotonic() - t_start
            got: Answer = await self.ask(http, prompt, self.spec.output_tokens, headers)
            self.records.append(TurnRecord(
                session=plan.id, turn=i, prompt_tokens=len(prompt), prev_context=prev,
                cached_tokens=got.cached_tokens, ttft_s=got.ttft_s, ok=got.ok, sent_s=sent,
                status=got.status))
            if not got.ok:
                return  # the session cannot go on without its answer
            answer = got.tokens
        if self.release:
            r = await http.delete(f"{self.url}/v1/sessions/{plan.id}")
            self.released[r.status_code] = self.released.get(r.status_code, 0) + 1

    async def run_background(self, t_start: float, done: asyncio.Event) -> None:
        async def one(req: OneOff) -> None:
            await asyncio.sleep(max(0.0, t_start + req.arrival_s - time.monotonic()))
            if await asyncio.to_thread(self.put_background, req.tokens):
                self.background_ok += 1
            else:
                self.background_failed += 1

        await asyncio.gather(*(one(r) for r in self.background))

    async def run(self, sample: Callable[[], Sample | None], sample_s: float
                  ) -> list[Sample]:
        """Runs every session and the background stream; samples the node every
        ``sample_s`` (``sample`` runs in a thread: it may block)."""
        samples: list[Sample] = []
        done = asyncio.Event()
        limits = httpx.Limits(max_connections=256)
        async with httpx.AsyncClient(timeout=httpx.Timeout(600, connect=10),
                                     limits=limits) as http:
            t_start = time.monotonic()

            async def sampler() -> None:
                while True:
                    s = await asyncio.to_thread(sample)
                    if s is not None:
                        s.t_s = round(time.monotonic() - t_start, 3)
                        samples.append(s)
                    if done.is_set():
                        return
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(done.wait(), sample_s)

            sampling = asyncio.create_task(sampler())
            others = asyncio.create_task(self.run_background(t_start, done))
            try:
                await asyncio.gather(*(self.run_session(http, p, t_start)
                                       for p in self.sessions))
            finally:
                done.set()
                others.cancel()  # the writes under way finish in their threads
                await asyncio.gather(others, return_exceptions=True)
                await sampling
        self.records.sort(key=lambda r: (r.turn, r.session))
        return samples


def node_sample(stats: dict[str, Any]) -> Sample:
    """A ``Sample`` of a node's ``stats()`` (its time is set by the caller)."""
    node = stats.get("node", {})
    tiers = {name: int(t.get("used", 0)) for name, t in stats.get("tiers", {}).items()}
    return Sample(t_s=0.0, retained_bytes=int(node.get("retained_bytes", 0)), tier_bytes=tiers,
                  prefetch_blocks={k: int(v)
                                   for k, v in (node.get("prefetch_blocks") or {}).items()},
                  tier_evictions={name: int(t.get("evictions", 0))
                                  for name, t in stats.get("tiers", {}).items()},
                  retention_denied=int(node.get("retention_denied", 0)))
