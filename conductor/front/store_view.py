"""The front's view of the store: how much of a prompt is cached, and when it is durable.

The kvstore client is synchronous (gRPC / channel); every call runs in a worker thread
(``asyncio.to_thread``) so the event loop never blocks on the store.

Durability (issue step 3): the vLLM connector saves asynchronously (a request may
finish before its blocks reach the store), so the front *waits* for the blocks after the
prefill answered: it polls until every full block of the prompt is stored, on a cluster
until each has ``write_quorum`` holders, with a bound (``timeout_s``). Only then is the
decode instance asked. Keys are content hashes, so a block once present is the right
one; what the wait prevents is a decode that misses and silently recomputes.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from typing import Any

from kvstore.core.keys import leading_run

POLL_FIRST_S = 0.002
POLL_MAX_S = 0.05


class NotDurable(Exception):
    """The prompt's blocks were not all stored within the bound."""

    def __init__(self, message: str, *, found: int, want: int) -> None:
        super().__init__(message)
        self.found = found
        self.want = want


class StoreView:
    def __init__(self, store: Any, *, write_quorum: int = 1) -> None:
        self.store = store
        self.write_quorum = write_quorum

    async def prefix_len(self, keys: Sequence[bytes]) -> int:
        """Leading blocks of ``keys`` the store holds (a failed lookup counts as 0)."""
        if not keys:
            return 0
        try:
            return int(await asyncio.to_thread(self.store.prefix_match, list(keys)))
        except Exception:  # the store is a cache: unreachable means nothing cached
            return 0

    def _durable_len(self, keys: Sequence[bytes]) -> int:
        if self.write_quorum <= 1 or not hasattr(self.store, "holders"):
            return int(self.store.prefix_match(list(keys)))
        quorum = self.write_quorum
        return leading_run(len(holders) >= quorum for holders in self.store.holders(list(keys)))

    async def durable_len(self, keys: Sequence[bytes]) -> int:
        if not keys:
            return 0
        return await asyncio.to_thread(self._durable_len, keys)

    async def wait_durable(self, keys: Sequence[bytes], *, timeout_s: float,
                           namespace: str) -> float:
        """Returns the seconds waited once all ``keys`` are durable; raises ``NotDurable``
        after ``timeout_s`` (saying what to check when none at all appeared)."""
        t0 = time.monotonic()
        pause = POLL_FIRST_S
        found = 0
        while True:
            try:
                found = await self.durable_len(keys)
            except Exception as exc:
                raise NotDurable(f"store unreachable while waiting for the prompt's blocks: "
                                 f"{exc}", found=0, want=len(keys)) from exc
            if found >= len(keys):
                return time.monotonic() - t0
            if time.monotonic() - t0 > timeout_s:
                break
            await asyncio.sleep(pause)
            pause = min(POLL_MAX_S, pause * 2)
        hint = ""
        if found == 0:
            hint = (f"; none at all under namespace {namespace!r}: --kv-namespace and "
                    f"--block-tokens must equal the connectors' namespace and vLLM's "
                    f"block size, and the prefill instances need kv_role kv_both or "
                    f"kv_producer")
        quorum = f" with {self.write_quorum} copies" if self.write_quorum > 1 else ""
        raise NotDurable(f"prefill's KV cache not in the store within {timeout_s:g} s: "
                         f"{found} of {len(keys)} blocks stored{quorum}{hint}",
                         found=found, want=len(keys))
