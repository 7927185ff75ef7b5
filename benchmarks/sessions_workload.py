"""The workload of ``python -m benchmarks.sessions``: N sessions of M turns, and a stream
of one-off requests competing with them for the cache.

Everything here is decided by the seed before the run starts, except each turn's answer
(the model's): a turn's prompt is the previous turn's prompt, the previous turn's answer
and the turn's new user text (``next_prompt``), so the context grows every turn.

* session ``s`` starts at ``s * stagger_s``; its turn 0 sends ``first_tokens`` token ids
  (the system prompt and the first message); every later turn adds ``user_tokens`` (a
  user's message or a tool's output) after a tool pause drawn uniformly from ``pause_s``;
* every session's ids are its own (no prefix shared between sessions), drawn from
  ``[FIRST_ID, vocab)``;
* one-off requests (``background``) arrive at a fixed rate, each a prompt no one sends
  again: what a session's blocks compete with for DRAM between two turns.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

FIRST_ID = 3
"""Token ids start here (0..2 are special ids in the models the benchmark runs)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class WorkloadSpec:
    sessions: int
    turns: int
    first_tokens: int
    user_tokens: int
    output_tokens: int
    pause_s: tuple[float, float]
    stagger_s: float
    vocab: int
    seed: int = 0
    background_per_s: float = 0.0
    background_tokens: int = 0

    def __post_init__(self) -> None:
        if self.sessions < 1 or self.turns < 1:
            raise ValueError("need at least one session of at least one turn")
        if self.first_tokens < 1 or self.user_tokens < 1 or self.output_tokens < 1:
            raise ValueError("first_tokens, user_tokens and output_tokens must be >= 1")
        lo, hi = self.pause_s
        if not 0 <= lo <= hi:
            raise ValueError(f"pause_s must be 0 <= low <= high, got {self.pause_s}")
        if self.stagger_s < 0 or self.background_per_s < 0:
            raise ValueError("stagger_s and background_per_s must be >= 0")
        if self.background_per_s > 0 and self.background_tokens < 1:
            raise ValueError("background requests need background_tokens >= 1")
        if self.vocab <= FIRST_ID:
            raise ValueError(f"vocab must be > {FIRST_ID}")

    def context_tokens(self) -> int:
        """Tokens of a session's last prompt (its whole context when the last turn
        arrives): the first message, every later message and every earlier answer."""
        return (self.first_tokens + (self.turns - 1) * self.user_tokens
                + (self.turns - 1) * self.output_tokens)


@dataclass(slots=True, kw_only=True, frozen=True)
class TurnPlan:
    user: tuple[int, ...]
    """The turn's new token ids (turn 0: the first message)."""
    pause_s: float
    """The tool pause between the previous turn's answer and this turn (0 for turn 0)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class SessionPlan:
    id: str
    start_s: float
    turns: tuple[TurnPlan, ...]


@dataclass(slots=True, kw_only=True, frozen=True)
class OneOff:
    arrival_s: float
    tokens: tuple[int, ...]


def _ids(rng: np.random.Generator, vocab: int, n: int) -> tuple[int, ...]:
    return tuple(int(t) for t in rng.integers(FIRST_ID, vocab, n))


def sessions(spec: WorkloadSpec) -> list[SessionPlan]:
    """Every session's plan, in start order; the same spec gives the same plans."""
    out = []
    for s in range(spec.sessions):
        rng = np.random.default_rng([spec.seed, s])
        turns = [TurnPlan(user=_ids(rng, spec.vocab, spec.first_tokens), pause_s=0.0)]
        for _ in range(1, spec.turns):
            pause = float(rng.uniform(*spec.pause_s))
            turns.append(TurnPlan(user=_ids(rng, spec.vocab, spec.user_tokens),
                                  pause_s=round(pause, 6)))
        out.append(SessionPlan(id=f"s{spec.seed}-{s}", start_s=s * spec.stagger_s,
                               turns=tuple(turns)))
    return out


def background(spec: WorkloadSpec, duration_s: float) -> list[OneOff]:
    """One-off requests at ``background_per_s`` from time 0 to ``duration_s`` (first at
    ``1 / rate``), each with fresh ids."""
    if spec.background_per_s <= 0 or duration_s <= 0:
        return []
    rng = np.random.default_rng([spec.seed, spec.sessions, 1 << 20])
    gap = 1.0 / spec.background_per_s
    n = int(duration_s / gap)
    return [OneOff(arrival_s=round((i + 1) * gap, 6),
                   tokens=_ids(rng, spec.vocab, spec.background_tokens)) for i in range(n)]


def next_prompt(prompt: Sequence[int], answer: Sequence[int], user: Sequence[int]
                ) -> list[int]:
    """A turn's prompt: the previous prompt, its answer, then the new user text."""
    return [*prompt, *answer, *user]


def nominal_duration_s(spec: WorkloadSpec) -> float:
    """When the last session's last turn would be sent if every turn took no time: the
    longest a background stream needs to cover (turns take more, the driver stops the
    stream when the sessions end)."""
    return (spec.sessions - 1) * spec.stagger_s + (spec.turns - 1) * spec.pause_s[1]
