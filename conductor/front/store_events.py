"""The durability wait driven by the store nodes' KV events.

A node started with ``--kv-events-endpoint`` publishes a ``BlockStored`` event for every
put that commits (``kvstore.node.kv_events``) and names the endpoint in its stats
(``kv_events_endpoint``). ``event_sources`` finds those endpoints from the store client
alone (each node of a cluster); ``BlockEvents`` subscribes to them
(``kvstore.remote.kv_event_subscriber``), one thread per node, and wakes the waits whose
blocks were just stored, so the wait of ``conductor.front.store_view`` asks the store once
at its start instead of polling.

What the waits need is kept per wait, never per block of the store: a key's holders (the
nodes whose events, or the store's answer, say they hold it) live only while some wait
wants that key. Events only ever add certainty; whatever they might miss is covered by
asking the store again: after a gap in a node's sequence numbers (a dropped batch, a
node restart) every pending wait re-checks, and a wait that events have not finished
re-checks every ``RECHECK_S`` as a safety net (a lost last batch, a node that joined the
cluster after the subscriptions were made, the moments before a new subscription is
connected).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.core.keys import leading_run

RECHECK_S = 1.0
"""A wait that events have not finished asks the store again this often."""
RECV_TIMEOUT_S = 0.25
"""How long a subscriber thread blocks before looking at its stop flag."""
_WILDCARD_HOSTS = ("0.0.0.0", "*", "[::]", "::")


class NoEvents(Exception):
    """The store publishes no KV events the front can follow (durability is polled)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class EventSource:
    node: str
    """The node's id as the store client names its holders (its address, single node)."""
    endpoint: str
    """``tcp://HOST:PORT`` of the node's KV events, reachable from the front."""


def reachable(endpoint: str, node_addr: str) -> str:
    """``endpoint`` as the node bound it, with a wildcard host (every interface) replaced
    by the host the front reaches the node at."""
    scheme, sep, rest = endpoint.partition("://")
    if scheme != "tcp" or not sep:
        return endpoint  # ipc:// and the like are local paths
    host, _, port = rest.rpartition(":")
    if host not in _WILDCARD_HOSTS:
        return endpoint
    node_host = node_addr.rpartition(":")[0] or node_addr
    return f"tcp://{node_host}:{port}"


def event_sources(store: Any, store_addr: str | None = None) -> list[EventSource]:
    """Every node's KV event endpoint, from its stats. ``store`` is a node client (then
    ``store_addr`` is its HOST:PORT) or a cluster client (each member's own stats).
    Raises ``NoEvents`` naming a node that publishes none: the wait would miss that
    node's puts, so the front polls instead."""
    try:
        stats = store.stats()
    except Exception as exc:  # any failure: fall back to polling
        raise NoEvents(f"cannot read the store's stats: {exc}") from None
    if "node" in stats and store_addr is not None:  # one node
        per_node = {store_addr: (store_addr, stats)}
    else:
        addrs = {m.node_id: m.addr for m in store.members()}
        per_node = {nid: (addrs.get(nid, ""), s) for nid, s in stats.items()}
    out = []
    for nid, (addr, s) in sorted(per_node.items()):
        endpoint = (s.get("node") or {}).get("kv_events_endpoint") if isinstance(s, dict) \
            else None
        if not endpoint:
            raise NoEvents(f"node {addr or nid} publishes no KV events "
                           f"(kvstore serve --kv-events-endpoint)")
        out.append(EventSource(node=nid, endpoint=reachable(str(endpoint), addr or nid)))
    if not out:
        raise NoEvents("the store has no nodes")
    return out


@dataclass(slots=True, eq=False)
class Wait:
    """One pending durability wait: ``keys`` each need ``quorum`` holders. ``changed``
    is set when events made progress, or when the store must be asked again (a gap)."""

    keys: list[bytes]
    quorum: int
    holders: dict[bytes, set[str]] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    recheck: bool = False

    def held(self) -> int:
        """Leading keys with ``quorum`` holders."""
        return leading_run(len(self.holders.get(k, ())) >= self.quorum for k in self.keys)

    @property
    def done(self) -> bool:
        return self.held() >= len(self.keys)


class BlockEvents:
    """Follows the KV events of ``sources`` and wakes the ``Wait``s they concern. Create
    and use it on the event loop that awaits the waits; ``close`` stops the threads."""

    def __init__(self, sources: Sequence[EventSource]) -> None:
        from kvstore.remote.kv_event_subscriber import KVEventSubscriber

        self.sources = list(sources)
        self._loop = asyncio.get_running_loop()
        self._waits: dict[bytes, set[Wait]] = {}
        self._stop = threading.Event()
        self.batches = 0
        """Event batches received (from every node), for the liveness check at start."""
        self.gaps = 0
        """Batches whose sequence number showed missed ones (each made waits re-check)."""
        self._subs = [KVEventSubscriber(s.endpoint) for s in self.sources]
        self._threads = [threading.Thread(target=self._follow, args=(s.node, sub),
                                          name=f"kv-events-{s.node}", daemon=True)
                         for s, sub in zip(self.sources, self._subs, strict=True)]
        for t in self._threads:
            t.start()

    def describe(self) -> str:
        return ", ".join(s.endpoint for s in self.sources)

    # ---- waits (event loop) --------------------------------------------------------------

    def watch(self, keys: Sequence[bytes], quorum: int) -> Wait:
        w = Wait(keys=[bytes(k) for k in keys], quorum=quorum)
        for k in w.keys:
            self._waits.setdefault(k, set()).add(w)
        return w

    def unwatch(self, w: Wait) -> None:
        for k in w.keys:
            waiting = self._waits.get(k)
            if waiting is not None:
                waiting.discard(w)
                if not waiting:
                    del self._waits[k]

    @staticmethod
    def seed(w: Wait, held: dict[str, Sequence[bytes]]) -> None:
        """Adds what the store said: node -> the keys of ``w`` it holds."""
        for node, keys in held.items():
            for k in keys:
                w.holders.setdefault(bytes(k), set()).add(node)

    def _apply(self, node: str, stored: list[bytes], removed: list[bytes], gap: bool
               ) -> None:
        touched: set[Wait] = set()
        for k in stored:
            for w in self._waits.get(k, ()):
                w.holders.setdefault(k, set()).add(node)
                touched.add(w)
        for k in removed:
            for w in self._waits.get(k, ()):
                w.holders.get(k, set()).discard(node)
        if gap:
            for waiting in self._waits.values():
                for w in waiting:
                    w.recheck = True
                    touched.add(w)
        for w in touched:
            w.changed.set()

    # ---- subscriber threads --------------------------------------------------------------

    def _follow(self, node: str, sub: Any) -> None:
        from kvstore.remote.kv_event_subscriber import decode

        last = -1
        while not self._stop.is_set():
            try:
                got = sub.recv(RECV_TIMEOUT_S)
            except Exception:  # closed under us: stopping
                return
            if got is None:
                continue
            seq, payload = got
            gap = last >= 0 and seq != last + 1
            last = seq
            stored: list[bytes] = []
            removed: list[bytes] = []
            for e in decode(payload):
                kind = e.get("type")
                if kind == "BlockStored":
                    stored += [h for h in e["block_hashes"] if isinstance(h, bytes)]
                elif kind == "BlockRemoved":
                    removed += [h for h in e["block_hashes"] if isinstance(h, bytes)]
                elif kind == "AllBlocksCleared":
                    gap = True  # a resync: what it restates is asked of the store again
            try:
                self._loop.call_soon_threadsafe(self._note, node, stored, removed, gap)
            except RuntimeError:  # the loop closed
                return

    def _note(self, node: str, stored: list[bytes], removed: list[bytes], gap: bool) -> None:
        self.batches += 1
        self.gaps += gap
        self._apply(node, stored, removed, gap)

    def close(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(2 * RECV_TIMEOUT_S + 1)
        for sub in self._subs:
            sub.close()
