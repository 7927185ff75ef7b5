"""The request streams ``python -m benchmarks.vllm_serving`` replays: token-id prompts with
arrival times, built so that which prompts share a prefix is known exactly.

* ``prefix-groups``: documents shared by several questions (a RAG or few-shot set-up), more
  documents than one instance's KV cache holds, each round of questions in a shuffled order
  so a document comes back after the instances' own caches have moved on;
* ``conversation``: the Mooncake conversation trace at its real prefix structure (each
  ``hash_id`` one block of token ids drawn from a generator seeded by the id, so equal ids
  give equal blocks), scaled to what a CPU model serves;
* ``miss``: prompts that share nothing, so every block is a miss (what a store costs when
  it cannot help).

Token ids are drawn from ``[3, 500)`` (the random model's vocabulary is 512); every workload
seeds its generators with its own tag first, so no two workloads share a prefix and one
instance can serve them one after another.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from conductor.simulation.trace import load_trace

TRACE_BLOCK = 512
"""Tokens per ``hash_id`` in the Mooncake traces."""
_LOW, _HIGH = 3, 500
_TAG_GROUPS, _TAG_TRACE, _TAG_MISS = 1, 2, 3


@dataclass(slots=True, kw_only=True, frozen=True)
class Req:
    arrival_s: float
    tokens: list[int]
    output: int
    group: str
    """What the prompt shares its prefix with (``doc3``, ``trace``, ``miss``)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class Workload:
    name: str
    requests: list[Req]
    description: str

    @property
    def prompt_tokens(self) -> int:
        return sum(len(r.tokens) for r in self.requests)


def _tokens(seed: list[int], n: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(_LOW, _HIGH, n)]


def prefix_groups(*, documents: int, questions: int, doc_tokens: int, question_tokens: int,
                  output: int, interval_s: float, seed: int = 0) -> Workload:
    """``documents`` x ``questions`` requests, one every ``interval_s``: round q asks every
    document its q-th question (document + ``question_tokens`` new tokens), in an order
    shuffled per round."""
    if documents < 1 or questions < 1 or doc_tokens < 1 or question_tokens < 1:
        raise ValueError("prefix_groups: every count must be positive")
    docs = [_tokens([_TAG_GROUPS, seed, d], doc_tokens) for d in range(documents)]
    order_rng = np.random.default_rng([_TAG_GROUPS, seed, 1 << 20])
    reqs: list[Req] = []
    for q in range(questions):
        for d in order_rng.permutation(documents):
            tail = _tokens([_TAG_GROUPS, seed, int(d), q + 1], question_tokens)
            reqs.append(Req(arrival_s=len(reqs) * interval_s, tokens=docs[int(d)] + tail,
                            output=output, group=f"doc{int(d)}"))
    return Workload(name="prefix-groups", requests=reqs, description=(
        f"{documents} documents of {doc_tokens} tokens, {questions} questions each "
        f"(+{question_tokens} tokens), shuffled per round, one request every "
        f"{interval_s:.3g} s, {output} output tokens"))


def conversation(path: Path, *, requests: int, token_scale: int, max_prompt: int,
                 max_output: int, speed: float, seed: int = 0) -> Workload:
    """The first ``requests`` of the trace: a ``hash_id`` is ``512 / token_scale`` tokens, a
    prompt is its blocks cut to ``input_length / token_scale`` tokens (at most
    ``max_prompt``), the output ``output_length / token_scale`` tokens (1 to
    ``max_output``), arrivals the trace's timestamps / ``speed``. Another ``seed`` draws
    other tokens for every id: the same prefix structure, shared with nothing else."""
    if TRACE_BLOCK % token_scale:
        raise ValueError(f"token_scale must divide {TRACE_BLOCK}, got {token_scale}")
    block = TRACE_BLOCK // token_scale
    reqs: list[Req] = []
    for r in load_trace(path)[:requests]:
        ids: list[int] = []
        for h in r.hash_ids:
            ids += _tokens([_TAG_TRACE, seed, h], block)
        length = max(1, min(r.input_length // token_scale, max_prompt, len(ids)))
        reqs.append(Req(arrival_s=r.timestamp_ms / 1000 / speed, tokens=ids[:length],
                        output=max(1, min(r.output_length // token_scale, max_output)),
                        group="trace"))
    return Workload(name="conversation", requests=reqs, description=(
        f"first {len(reqs)} requests of {path.name}, tokens / {token_scale} (a trace block "
        f"= {block} tokens), prompts <= {max_prompt}, outputs <= {max_output}, arrivals / "
        f"{speed:g}"))


def pure_miss(*, requests: int, prompt_tokens: int, output: int, interval_s: float,
              seed: int = 0) -> Workload:
    """``requests`` prompts of ``prompt_tokens`` ids that share nothing (not even a first
    block), one every ``interval_s``."""
    reqs = [Req(arrival_s=i * interval_s, tokens=_tokens([_TAG_MISS, seed, i], prompt_tokens),
                output=output, group="miss") for i in range(requests)]
    return Workload(name="miss", requests=reqs, description=(
        f"{requests} prompts of {prompt_tokens} tokens sharing nothing, one every "
        f"{interval_s:.3g} s, {output} output tokens"))
