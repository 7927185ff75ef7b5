"""Prefill-instance selection policies, pluggable by name (``POLICIES``).

For each request the Conductor hands a policy one ``Candidate`` per prefill
instance, with two estimated plans: ``local`` (reuse only the instance's own
cached prefix, compute the rest) and ``fetch`` (also fetch the longer prefix the
global pool holds, paying the transfer). Every instance reuses its local prefix
when it runs a request, whatever the policy: the policies differ only in what
they *choose by*, as in the FAST'25 comparison:

* ``random``: a uniformly random instance (seeded RNG), local plan;
* ``load-balancing``: the least queued instance, local plan;
* ``local-cache-aware``: the smallest estimated TTFT of the local plans;
* ``global-cache-aware`` (Mooncake's KV-cache-centric Algorithm 1): the smallest
  estimated TTFT over both plans of every instance. Fetching is chosen exactly
  when the transfer costs less than the compute it saves; the fetched blocks then
  join the instance's cache, which replicates hot prefixes to where they are used.
  (The paper decides to fetch with a ``kvcache_balancing_threshold`` on the
  ratio of prefix lengths; comparing the estimated TTFTs is the same decision
  made with the cost model instead of a tuned ratio.)

Ties go to the lowest-index instance (and to the local plan), so every choice is
deterministic given the RNG seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

from conductor.scheduling.types import PrefillPlan, Request


@dataclass(slots=True, kw_only=True, frozen=True)
class Candidate:
    """One prefill instance's options for a request. ``fetch is local`` when the pool
    holds no longer prefix than the instance itself."""

    queue_s: float
    local: PrefillPlan
    fetch: PrefillPlan


class PrefillPolicy(Protocol):
    """Chooses the prefill instance and plan for a request."""

    @property
    def name(self) -> str: ...

    @property
    def may_fetch(self) -> bool:
        """Whether ``choose`` may return a ``fetch`` plan (else the Conductor skips
        computing them and passes ``fetch = local``)."""
        ...

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan: ...


def _argmin(values: Sequence[float]) -> int:
    best = 0
    for i in range(1, len(values)):
        if values[i] < values[best]:
            best = i
    return best


class RandomPolicy:
    name = "random"
    may_fetch = False

    def __init__(self, seed: int = 0) -> None:
        self._rng = random.Random(seed)

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan:
        return candidates[self._rng.randrange(len(candidates))].local


class LoadBalancingPolicy:
    name = "load-balancing"
    may_fetch = False

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan:
        return candidates[_argmin([c.queue_s for c in candidates])].local


class LocalCacheAwarePolicy:
    name = "local-cache-aware"
    may_fetch = False

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan:
        return candidates[_argmin([c.local.ttft_s for c in candidates])].local


class GlobalCacheAwarePolicy:
    name = "global-cache-aware"
    may_fetch = True

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan:
        best = candidates[0].local
        for c in candidates:
            for plan in (c.local, c.fetch):
                if plan.ttft_s < best.ttft_s:
                    best = plan
        return best


POLICIES: dict[str, Callable[[int], PrefillPolicy]] = {
    "random": RandomPolicy,
    "load-balancing": lambda seed: LoadBalancingPolicy(),
    "local-cache-aware": lambda seed: LocalCacheAwarePolicy(),
    "global-cache-aware": lambda seed: GlobalCacheAwarePolicy(),
}
"""Policy name -> factory taking the RNG seed. Order is the paper's, worst first."""


def make_policy(name: str, seed: int = 0) -> PrefillPolicy:
    try:
        return POLICIES[name](seed)
    except KeyError:
        raise ValueError(f"unknown policy {name!r} (known: {', '.join(POLICIES)})") from None
