"""Session affinity: which instance a session's previous request went to.

A client names its session in the ``X-Session-Affinity`` header (AIPerf sends it for
multi-turn conversations; any client may). The front remembers, per session, the instance
that ran its last request, and prefers it for the next one as long as that instance's
estimated TTFT meets the SLO: a conversation's next turn finds its prefix in that
instance's own prefix cache, not only in the store. It is a hint, never a constraint.

The memory is bounded both ways: at most ``max_sessions`` entries (the least recently
used goes first) and each forgotten ``ttl_s`` after its last use, so a client that sends
a new session id per request cannot grow it without bound.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from conductor.scheduling.policies import Candidate, PrefillPolicy
from conductor.scheduling.types import InstanceId, PrefillPlan, Request

SESSION_HEADER = "x-session-affinity"
"""The request header naming a session (HTTP headers are case-insensitive)."""
MAX_SESSION_ID = 256
"""Longer header values are ignored (no hint), so one entry stays small."""


def session_of(value: str | None) -> str | None:
    """The session id of a header value, None for none (absent, empty or too long)."""
    if value is None:
        return None
    value = value.strip()
    if not value or len(value) > MAX_SESSION_ID:
        return None
    return value


@dataclass(slots=True, kw_only=True)
class SessionAffinity:
    """Session id -> the instance of its last request (see the module docstring). Times
    are whatever clock the caller passes (``time.monotonic()`` live)."""

    max_sessions: int = 100_000
    ttl_s: float = 600.0
    _where: OrderedDict[str, tuple[InstanceId, float]] = field(default_factory=OrderedDict)

    def __post_init__(self) -> None:
        if self.max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {self.max_sessions}")
        if not self.ttl_s > 0:
            raise ValueError(f"ttl_s must be > 0, got {self.ttl_s}")

    def __len__(self) -> int:
        return len(self._where)

    def instance(self, session: str, now: float) -> InstanceId | None:
        """The instance of ``session``'s last request, None if unknown or expired."""
        got = self._where.get(session)
        if got is None:
            return None
        if now - got[1] > self.ttl_s:
            del self._where[session]
            return None
        return got[0]

    def forget(self, session: str) -> bool:
        """Drops ``session`` (``DELETE /v1/sessions/{id}``); False if it was not known."""
        return self._where.pop(session, None) is not None

    def remember(self, session: str, instance: InstanceId, now: float) -> None:
        """``session``'s latest request went to ``instance`` at ``now``."""
        self._where[session] = (instance, now)
        self._where.move_to_end(session)
        self._expire(now)
        while len(self._where) > self.max_sessions:
            self._where.popitem(last=False)

    def _expire(self, now: float) -> None:
        # Entries are in last-use order: the expired ones are at the front.
        while self._where:
            session, (_, used) = next(iter(self._where.items()))
            if now - used <= self.ttl_s:
                return
            del self._where[session]


class PreferSession:
    """The scheduler's policy, preferring ``preferred`` (the session's instance, set by
    the front before each decision) when its best plan meets the TTFT SLO."""

    def __init__(self, inner: PrefillPolicy, ttft_slo_s: float) -> None:
        self.inner = inner
        self.ttft_slo_s = ttft_slo_s
        self.preferred: InstanceId | None = None

    @property
    def name(self) -> str:
        return self.inner.name

    @property
    def may_fetch(self) -> bool:
        return self.inner.may_fetch

    def choose(self, request: Request, candidates: Sequence[Candidate]) -> PrefillPlan:
        for c in candidates:
            if self.preferred is not None and c.local.instance == self.preferred:
                plan = min((c.local, c.fetch), key=lambda p: p.ttft_s)
                if plan.ttft_s <= self.ttft_slo_s:
                    return plan
        return self.inner.choose(request, candidates)
