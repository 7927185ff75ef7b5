"""Sessions keep their cache: the blocks of a session's last turn stay retained in the store
between turns, are brought up to DRAM when its next turn arrives, and are released when
the session ends (docs/conductor.md, "Sessions").

A request names its session by the ``X-Session-Affinity`` header or a ``session_id`` body
field (``session_of_request``). Per session the cache remembers the store keys of its last
turn's prompt (the full blocks the Conductor already computes to route it). Then:

* **arrival** (``arrive``): the leading keys the new prompt shares with the last turn are
  prefetched to DRAM (``prefetch``, not waited for: the node plans the moves and answers,
  the copies run while the request waits for its instance);
* **turn end** (``end_turn``): the turn's keys are retained for ``ttl_s`` (``retain``),
  which refreshes the ones retained before; the last turn's keys the new prompt no longer
  has are released (``retain`` with 0 s), unless another live session still holds them;
* **delete** (``delete``, ``DELETE /v1/sessions/{id}``) and **idle expiry** (``sweep``, a
  session whose last turn ended ``ttl_s`` ago) release the session's keys the same way.

Bounds: at most ``max_sessions`` sessions (the least recently used is released first) and
``MAX_SESSION_KEYS`` keys per session (a prompt's leading blocks; the rest is not kept);
store calls carry at most ``MAX_RETAIN_KEYS`` keys each. ``ttl_s`` of 0 turns sessions off:
nothing is asked of the store (routing affinity is separate: ``conductor.front.sessions``).

Everything here is best effort, as retention itself is: a store call that fails is counted
(``store_errors``) and the request goes on. Two sessions sharing blocks (a common system
prompt) hold them together: a key is released only when no live session holds it (counted
per key). Calls for one session are meant to come one turn at a time; two overlapping
turns of one session may leave the table with either turn's keys (both are retained).

Thread-safe: the table is guarded by a lock that is never held during a store call.
Time comes from an injected ``clock`` (monotonic seconds), so the tests move it exactly.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any, Protocol

from conductor.front.sessions import SESSION_HEADER, session_of
from kvstore.core.retention import MAX_RETAIN_KEYS, MAX_RETAIN_S, RetainOutcome

SESSION_FIELD = "session_id"
"""The request body field naming a session (the header wins when both are given)."""
DEFAULT_SESSION_TTL_S = 300.0
"""``conductor serve --session-ttl``'s default: how long a session's blocks stay retained
after its last turn ended."""
MAX_SESSION_KEYS = 16 * MAX_RETAIN_KEYS
"""Most store keys one session keeps (its prompt's leading blocks): at most 16 retain calls
per turn."""


class SessionStore(Protocol):
    """What the cache asks of the store (``kvstore.Client``, node or cluster)."""

    def retain(self, keys: Sequence[bytes], retain_s: float) -> list[RetainOutcome]: ...

    def prefetch(self, keys: Sequence[bytes], tier: str = ..., *, wait: bool = ...
                 ) -> list[Any]: ...


def check_session_ttl(ttl_s: float) -> float:
    """``ttl_s`` as a float; ValueError unless finite, ``>= 0`` and at most 7 days."""
    if not 0 <= ttl_s <= MAX_RETAIN_S:  # also refuses NaN
        raise ValueError(f"session TTL must be 0 (off) to {MAX_RETAIN_S:.0f} s, got {ttl_s!r}")
    return float(ttl_s)


def session_of_request(header: str | None, body: Mapping[str, Any]) -> str | None:
    """The session a request names: its ``X-Session-Affinity`` header's value (``header``,
    looked up by the caller: ``SESSION_HEADER``), else its ``session_id`` field (a string;
    anything else names none). Same bounds as the header's (``session_of``)."""
    got = session_of(header)
    if got is not None:
        return got
    field = body.get(SESSION_FIELD)
    return session_of(field) if isinstance(field, str) else None


@dataclass(slots=True, kw_only=True)
class SessionCounts:
    """What the cache did, for ``/health`` and the benchmarks."""

    turns: int = 0
    prefetch_calls: int = 0
    prefetched_keys: int = 0
    retain_calls: int = 0
    retained_keys: int = 0
    denied_keys: int = 0
    missing_keys: int = 0
    released_keys: int = 0
    deleted: int = 0
    expired: int = 0
    evicted: int = 0
    store_errors: int = 0


@dataclass(slots=True)
class _Session:
    keys: tuple[bytes, ...]
    used: float


class SessionCache:
    """Session id -> the store keys of its last turn, retained (see the module docstring)."""

    def __init__(self, store: SessionStore, *, ttl_s: float = DEFAULT_SESSION_TTL_S,
                 max_sessions: int = 100_000,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if max_sessions < 1:
            raise ValueError(f"max_sessions must be >= 1, got {max_sessions}")
        self.store = store
        self.ttl_s = check_session_ttl(ttl_s)
        self.max_sessions = max_sessions
        self._clock = clock
        self._lock = threading.Lock()
        # guarded by _lock:
        self._sessions: OrderedDict[str, _Session] = OrderedDict()  # least recent first
        self._refs: dict[bytes, int] = {}  # key -> live sessions holding it
        self.counts = SessionCounts()

    @property
    def enabled(self) -> bool:
        """Sessions on (``ttl_s > 0``)."""
        return self.ttl_s > 0

    def __len__(self) -> int:
        with self._lock:
            return len(self._sessions)

    def __contains__(self, session: str) -> bool:
        with self._lock:
            return session in self._sessions

    def keys_of(self, session: str) -> tuple[bytes, ...] | None:
        """The keys kept for ``session`` (None: unknown)."""
        with self._lock:
            s = self._sessions.get(session)
            return None if s is None else s.keys

    def snapshot(self) -> dict[str, Any]:
        with self._lock:
            return {"ttl_s": self.ttl_s, "sessions": len(self._sessions),
                    "keys_held": len(self._refs), **asdict(self.counts)}

    # ---- the turn's calls ----------------------------------------------------------------

    def arrive(self, session: str | None, keys: Sequence[bytes]) -> int:
        """A turn of ``session`` with these store keys arrived: prefetches the leading keys
        it shares with the session's last turn (and releases sessions idle past their TTL
        first). How many keys were asked for. (``to_prefetch`` then ``prefetch``, for a
        caller that makes the store calls off its request's path.)"""
        if not self.enabled:
            return 0
        self.sweep()
        shared = self.to_prefetch(session, keys)
        self.prefetch(shared)
        return len(shared)

    def to_prefetch(self, session: str | None, keys: Sequence[bytes]) -> list[bytes]:
        """The leading keys a turn of ``session`` with these store keys shares with the
        session's last turn (what ``arrive`` prefetches); no store call."""
        if not self.enabled or session is None:
            return []
        with self._lock:
            s = self._sessions.get(session)
            return [] if s is None else _shared_prefix(s.keys, keys)

    def prefetch(self, keys: Sequence[bytes]) -> None:
        """Asks the store to bring ``keys`` up to DRAM (not waited for; counted)."""
        if keys:
            self._call(self._prefetch, keys)

    def end_turn(self, session: str | None, keys: Sequence[bytes]) -> None:
        """``session``'s turn with these store keys ended: retains them for ``ttl_s`` and
        releases the last turn's keys no live session holds any more."""
        if not self.enabled or session is None:
            return
        now = self._clock()
        kept = tuple(dict.fromkeys(keys[:MAX_SESSION_KEYS]))
        with self._lock:
            old = self._sessions.pop(session, None)
            self._sessions[session] = _Session(keys=kept, used=now)
            gone = self._hold(kept, old.keys if old is not None else ())
            evicted = self._evict_over_bound()
        if kept:
            self._call(self._retain, list(kept))
        self._release([*gone, *evicted])
        with self._lock:  # last: a turn counted has its retain's outcomes counted too
            self.counts.turns += 1

    def delete(self, session: str) -> bool:
        """Ends ``session``: its keys no other live session holds are released. False if
        the session is unknown (never seen, expired, or sessions off)."""
        with self._lock:
            s = self._sessions.pop(session, None)
            if s is None:
                return False
            self.counts.deleted += 1
            gone = self._hold((), s.keys)
        self._release(gone)
        return True

    def sweep(self) -> int:
        """Ends every session whose last turn ended ``ttl_s`` ago or more (their keys are
        released as by ``delete``); how many ended."""
        if not self.enabled:
            return 0
        now = self._clock()
        gone: list[bytes] = []
        n = 0
        with self._lock:
            while self._sessions:
                sid, s = next(iter(self._sessions.items()))
                if now - s.used < self.ttl_s:
                    break
                del self._sessions[sid]
                gone += self._hold((), s.keys)
                n += 1
            self.counts.expired += n
        self._release(gone)
        return n

    # ---- under the lock ------------------------------------------------------------------

    def _hold(self, new: Sequence[bytes], old: Sequence[bytes]) -> list[bytes]:
        """Counts ``new`` held and ``old`` no longer (by one session); the keys now held by
        none."""
        refs = self._refs
        for k in new:
            refs[k] = refs.get(k, 0) + 1
        gone = []
        for k in old:
            left = refs[k] - 1
            if left:
                refs[k] = left
            else:
                del refs[k]
                gone.append(k)
        return gone

    def _evict_over_bound(self) -> list[bytes]:
        gone: list[bytes] = []
        while len(self._sessions) > self.max_sessions:
            _, s = self._sessions.popitem(last=False)
            gone += self._hold((), s.keys)
            self.counts.evicted += 1
        return gone

    # ---- store calls (never under the lock) ----------------------------------------------

    def _release(self, keys: list[bytes]) -> None:
        if keys:
            self._call(self._release_chunk, keys)

    def _call(self, call: Callable[[list[bytes]], None], keys: list[bytes] | Sequence[bytes]
              ) -> None:
        for lo in range(0, len(keys), MAX_RETAIN_KEYS):
            try:
                call(list(keys[lo:lo + MAX_RETAIN_KEYS]))
            except Exception:  # a cache hint: the request goes on without it
                with self._lock:
                    self.counts.store_errors += 1

    def _prefetch(self, keys: list[bytes]) -> None:
        self.store.prefetch(keys)
        with self._lock:
            self.counts.prefetch_calls += 1
            self.counts.prefetched_keys += len(keys)

    def _retain(self, keys: list[bytes]) -> None:
        got = self.store.retain(keys, self.ttl_s)
        with self._lock:
            c = self.counts
            c.retain_calls += 1
            for o in got:
                if o == RetainOutcome.RETAINED:
                    c.retained_keys += 1
                elif o == RetainOutcome.DENIED:
                    c.denied_keys += 1
                else:
                    c.missing_keys += 1

    def _release_chunk(self, keys: list[bytes]) -> None:
        self.store.retain(keys, 0)
        with self._lock:
            self.counts.released_keys += len(keys)


def _shared_prefix(a: Sequence[bytes], b: Sequence[bytes]) -> list[bytes]:
    """The leading keys ``a`` and ``b`` share (chained keys: equal up to the first
    difference)."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return list(b[:n])


__all__ = ["DEFAULT_SESSION_TTL_S", "MAX_SESSION_KEYS", "SESSION_FIELD", "SESSION_HEADER",
           "SessionCache",
           "SessionCounts", "SessionStore", "check_session_ttl", "session_of_request"]
