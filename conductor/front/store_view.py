"""The front's view of the store: how much of a prompt is cached, and when it is durable.

The kvstore client is synchronous (gRPC / channel); every call runs in a worker thread
(``asyncio.to_thread``) so the event loop never blocks on the store.

Durability (issue step 3): the vLLM connector saves asynchronously (a request may
finish before its blocks reach the store), so the front *waits* for the blocks after the
prefill answered, until every full block of the prompt is stored, on a cluster until
each has ``write_quorum`` holders, with a bound (``timeout_s``). Only then is the
decode instance asked. Keys are content hashes, so a block once present is the right
one; what the wait prevents is a decode that misses and silently recomputes.

How it waits: with ``events`` (``conductor.front.store_events``: the nodes publish KV
events) it asks the store once, then is woken by the ``BlockStored`` events of its
blocks (asking again only after a gap in the events, and every ``RECHECK_S`` as a safety
net); without, it polls the store (2 ms, doubling to 50 ms).
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import Sequence
from typing import Any, NoReturn

from conductor.front.store_events import RECHECK_S, BlockEvents
from kvstore.core.keys import leading_run
from kvstore.integrations.vllm.ranks import stored_prefix

POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05


class NotDurable(Exception):
    """The prompt's blocks were not all stored within the bound."""

    def __init__(self, message: str, *, found: int, want: int) -> None:
        super().__init__(message)
        self.found = found
        self.want = want


class StoreView:
    def __init__(self, store: Any, *, write_quorum: int = 1,
                 events: BlockEvents | None = None) -> None:
        self.store = store
        self.write_quorum = write_quorum
        self.events = events
        """Set (``use_events``) when the nodes publish KV events: the wait follows them."""
        self.store_checks = 0
        """Store calls the durability waits made (one per poll; with events, about one
        per wait)."""

    def use_events(self, events: BlockEvents | None) -> None:
        self.events = events

    @property
    def waits_by(self) -> str:
        """How the durability wait learns of saves: ``events`` or ``polling``."""
        return "polling" if self.events is None else "events"

    async def prefix_len(self, keys: Sequence[bytes], shards: Sequence[str] = ()) -> int:
        """Leading blocks of ``keys`` the store holds, every one of ``shards`` of them
        when the engines store blocks in shards (a failed lookup counts as 0)."""
        if not keys:
            return 0
        try:
            if shards:
                return await asyncio.to_thread(stored_prefix, self.store.prefix_match,
                                               list(keys), list(shards))
            return int(await asyncio.to_thread(self.store.prefix_match, list(keys)))
        except Exception:  # the store is a cache: unreachable means nothing cached
            return 0

    def _holders(self, keys: Sequence[bytes]) -> dict[str, list[bytes]]:
        """Node -> the ``keys`` it holds (one node: its stored leading run, under the
        name its events come by)."""
        if self.write_quorum <= 1 or not hasattr(self.store, "holders"):
            n = int(self.store.prefix_match(list(keys)))
            return {self._single_node(): list(keys[:n])}
        out: dict[str, list[bytes]] = {}
        for k, holders in zip(keys, self.store.holders(list(keys)), strict=True):
            for h in holders:
                out.setdefault(h.node_id, []).append(k)
        return out

    def _single_node(self) -> str:
        sources = self.events.sources if self.events is not None else ()
        return sources[0].node if len(sources) == 1 else "node"

    def _durable_len(self, keys: Sequence[bytes]) -> int:
        if self.write_quorum <= 1 or not hasattr(self.store, "holders"):
            return int(self.store.prefix_match(list(keys)))
        quorum = self.write_quorum
        return leading_run(len(holders) >= quorum for holders in self.store.holders(list(keys)))

    async def durable_len(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        self.store_checks += 1
        return await asyncio.to_thread(self._durable_len, keys)

    async def wait_durable(self, keys: Sequence[bytes], *, timeout_s: float,
                           namespace: str) -> float:
        """Returns the seconds waited once all ``keys`` are durable; raises ``NotDurable``
        after ``timeout_s`` (saying what to check when none at all appeared)."""
        wait = self._wait_by_events if self.events is not None else self._wait_by_polling
        done, waited, found = await wait(keys, timeout_s)
        if done:
            return waited
        self._not_durable(found, len(keys), timeout_s, namespace)

    async def _wait_by_polling(self, keys: Sequence[bytes], timeout_s: float
                               ) -> tuple[bool, float, int]:
        """(all durable, seconds waited, leading blocks durable at the end)."""
        t0 = time.monotonic()
        pause = POLL_FIRST_S
        found = 0
        while True:
            found = await self._checked(self.durable_len(keys), len(keys))
            if found >= len(keys):
                return True, time.monotonic() - t0, found
            if time.monotonic() - t0 > timeout_s:
                return False, time.monotonic() - t0, found
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)

    async def _wait_by_events(self, keys: Sequence[bytes], timeout_s: float
                              ) -> tuple[bool, float, int]:
        """As ``_wait_by_polling``, woken by the events of ``keys`` (see the module
        docstring). The wait is registered before the store is asked, so a save that
        lands between the two is seen by one or the other."""
        events = self.events
        assert events is not None
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        w = events.watch(keys, self.write_quorum)
        try:
            ask = True
            while True:
                if ask:
                    w.recheck = False
                    self.store_checks += 1
                    held = await self._checked(asyncio.to_thread(self._holders, keys),
                                               len(keys))
                    events.seed(w, held)
                    last_ask = time.monotonic()
                now = time.monotonic()
                if w.done or now >= deadline:
                    return w.done, now - t0, w.held()
                w.changed.clear()
                wake = min(deadline, last_ask + RECHECK_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(w.changed.wait(), max(0.0, wake - now))
                ask = w.recheck or time.monotonic() >= last_ask + RECHECK_S
        finally:
            events.unwatch(w)

    async def _checked(self, call: Any, want: int) -> Any:
        try:
            return await call
        except Exception as exc:
            raise NotDurable(f"store unreachable while waiting for the prompt's blocks: "
                             f"{exc}", found=0, want=want) from exc

    def _not_durable(self, found: int, want: int, timeout_s: float, namespace: str
                     ) -> NoReturn:
        hint = ""
        if found == 0:
            hint = (f"; none at all under namespace {namespace!r}: is the Conductor's "
                    f"--store / --etcd the connectors' store (and --kv-namespace, when "
                    f"given, their namespace)?")
        quorum = f" with {self.write_quorum} copies" if self.write_quorum > 1 else ""
        raise NotDurable(f"prefill's KV cache not in the store within {timeout_s:g} s: "
                         f"{found} of {want} blocks stored{quorum}{hint}",
                         found=found, want=want)
