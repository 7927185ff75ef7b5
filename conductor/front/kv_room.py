"""When an instance's KV cache has room for one more request: its requests in flight
hold blocks until they end, and the engine starts a new request only once its blocks fit.

vLLM admits a waiting request only when the KV cache can hold its prompt's blocks, and a
running request that needs a block for its next token while none is free preempts
another (which then computes its prompt again). So a request sent to an instance whose
cache the front's requests in flight already fill does not start when its queue says: it
starts when enough of them end. On a cache that holds one and a half long prompts, an
instance decoding one document's question cannot take another document's question,
however empty its prefill queue, while an instance decoding a question of the same
document can (the two share the document's blocks).

``KvRoom`` counts, per instance, what each request in flight holds: the full blocks of its
prompt (chained block keys, so a prefix two requests share counts once, as the engine's
prefix cache shares it) and the rest of its prompt and its output in whole blocks. A new
request's wait is zero when its own blocks fit beside them, else the expected end of the
request whose end makes them fit (ends in expected order). Finished requests' blocks stay
cached in the engine but are reclaimable, so they count as room. What other clients hold is
not known, and a request larger than the whole cache never waits here (the engine refuses
it or runs it alone).

Single owner (the front's event loop): no locks.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NewType

ResidentId = NewType("ResidentId", int)


@dataclass(slots=True, kw_only=True)
class _Resident:
    blocks: frozenset[bytes]
    """The full blocks of its prompt, by chained key."""
    extra_blocks: int
    """Blocks for the rest of its prompt and its output."""
    ends_at: float


class KvRoom:
    """The KV cache of one instance, ``capacity_tokens`` tokens in blocks of
    ``block_tokens`` (see the module docstring)."""

    __slots__ = ("_extra_total", "_ids", "_refs", "_residents", "block_tokens",
                 "capacity_blocks")

    def __init__(self, *, capacity_tokens: int, block_tokens: int) -> None:
        if capacity_tokens < 1 or block_tokens < 1:
            raise ValueError(f"a KV cache of {capacity_tokens} tokens in blocks of "
                             f"{block_tokens}: both must be >= 1")
        self.block_tokens = block_tokens
        self.capacity_blocks = capacity_tokens // block_tokens
        self._residents: dict[ResidentId, _Resident] = {}
        # Invariant: _refs counts, per block key, the residents holding it (keys at 0 are
        # absent), and _extra_total is the sum of the residents' extra_blocks: so the
        # blocks held are len(_refs) + _extra_total, kept as residents come and go (a
        # choice asks every instance, and a busy one holds hundreds of requests).
        self._refs: dict[bytes, int] = {}
        self._extra_total = 0
        self._ids = itertools.count(1)

    def __len__(self) -> int:
        return len(self._residents)

    def add(self, keys: Sequence[bytes], *, prompt_tokens: int, out_tokens: int,
            ends_at: float) -> ResidentId:
        """A request in flight: ``keys`` its prompt's full blocks, expected over at
        ``ends_at``."""
        rid = ResidentId(next(self._ids))
        resident = _Resident(
            blocks=frozenset(keys), extra_blocks=self._extra(keys, prompt_tokens, out_tokens),
            ends_at=ends_at)
        self._residents[rid] = resident
        refs = self._refs
        for k in resident.blocks:
            refs[k] = refs.get(k, 0) + 1
        self._extra_total += resident.extra_blocks
        return rid

    def expect_end(self, rid: ResidentId, ends_at: float) -> None:
        """Better news of when ``rid`` ends (its first token came); unknown ids: nothing."""
        resident = self._residents.get(rid)
        if resident is not None:
            resident.ends_at = ends_at

    def remove(self, rid: ResidentId) -> None:
        """``rid`` is over; unknown ids (already removed): nothing."""
        resident = self._residents.pop(rid, None)
        if resident is None:
            return
        refs = self._refs
        for k in resident.blocks:
            n = refs[k] - 1
            if n:
                refs[k] = n
            else:
                del refs[k]
        self._extra_total -= resident.extra_blocks

    def held_blocks(self) -> int:
        return len(self._refs) + self._extra_total

    def wait_s(self, keys: Sequence[bytes], *, prompt_tokens: int, out_tokens: int,
               now: float) -> float:
        """Seconds from ``now`` until a request of ``keys`` (its prompt's full blocks),
        ``prompt_tokens`` and ``out_tokens`` fits beside the requests in flight."""
        mine = frozenset(keys)
        extra = self._extra(keys, prompt_tokens, out_tokens)
        cap = self.capacity_blocks
        if len(mine) + extra > cap:
            return 0.0
        refs = self._refs
        distinct, extra_held = len(refs), self._extra_total
        missing = sum(1 for k in mine if k not in refs)  # blocks it would add
        if distinct + extra_held + missing + extra <= cap:
            return 0.0
        gone: dict[bytes, int] = {}  # references the residents ended so far held
        for resident in sorted(self._residents.values(), key=lambda r: r.ends_at):
            extra_held -= resident.extra_blocks
            for k in resident.blocks:
                n = gone[k] = gone.get(k, 0) + 1
                if n == refs[k]:  # its last holder ended
                    distinct -= 1
                    if k in mine:
                        missing += 1
            if distinct + extra_held + missing + extra <= cap:
                return max(0.0, resident.ends_at - now)
        raise AssertionError("a request that fits an empty cache fits once all have ended")

    def _extra(self, keys: Sequence[bytes], prompt_tokens: int, out_tokens: int) -> int:
        rest = max(0, prompt_tokens - len(keys) * self.block_tokens) + max(0, out_tokens)
        return -(-rest // self.block_tokens)
