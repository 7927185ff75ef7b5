"""The cluster-wide client: every single-node call, placed by rendezvous hashing.

``kvstore.Client(etcd="HOST:PORT", replicas=2, write_quorum=2)`` returns one of
these. It watches membership, ranks the live nodes for every key (see
``replication/placement/rendezvous.py``), and:

* **put**: sends each key once to its master (the top-ranked live node; if that
  node is unreachable, the next ranked node stands in); a batch's masters all get
  their parts before any reply is read (``kvstore/remote/pipelined.py``). With
  ``replicas > 1`` it is a replicated put on the transfer channel: the master stores
  the bytes and forwards them itself (cut-through, as they arrive) to the other
  owners, ranked by its own membership (``replication/copies/forwarder.py``), and
  answers once they settled. A master outside an etcd cluster (a static member
  list) refuses that; then the put is stored and the master asked to
  ``Replicate`` (two trips). Either way the call returns once ``write_quorum``
  copies exist; fewer raise ``QuorumNotMet`` (an ``Unavailable``); the copies
  that were made stay (they are correct bytes, and repair completes them).
* **retain** (and its release, 0 s) asks every read candidate of each key, as
  ``holders`` does, so every copy is kept.
* **get / exists / prefix_match / locate / prefetch**: each key is asked of its read
  candidates in order (owners, then hot-block fan-out nodes, then the next
  ranked node, which still holds keys whose owner changed until repair moves
  them); a miss or an unreachable node moves the key to its next candidate.
  Keys are grouped per node and each round's groups run in parallel.
* **hot blocks** (``hot_reads_per_s``): reads are counted per key with decayed
  counters (``replication/placement/hotness.py``) where they are issued, here, since a
  node only sees its share once reads spread. A key that turns hot is copied to
  the ``fanout`` next-ranked nodes (by its master, in the background) and its
  reads rotate over owners and those copies; when it cools, the extra copies
  are removed.

Calls to several nodes run in parallel threads, except when every node involved is
reached through same-host shared memory (and the call is not a replicated put, which
waits on its masters' forwards): those copies hold the GIL, so threads would only take
turns, and running them one after another costs less.

Nodes that failed a call are tried last for ``suspect_s`` seconds, so one dead
node costs one failed call, not one per request, until membership drops it.

Locks: ``_lock`` guards the membership view, the suspects and the fan-out table;
``_hot_lock`` guards the hotness tracker. Neither is held with the other, nor
during any call to a node. A view is immutable once published (its candidate
cache only memoises), so calls in flight finish on the view they started with.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

from kvstore.auth.security import ClientTls
from kvstore.core.checks import check_key
from kvstore.core.errors import FailedPrecondition, InvalidArgument, KVStoreError, Unavailable
from kvstore.core.keys import BlockKey, leading_run
from kvstore.core.prefetch import DEFAULT_PREFETCH_TIER, PrefetchOutcome, check_prefetch
from kvstore.core.retention import RetainOutcome, check_retain, merged_outcome
from kvstore.remote.channel_client import as_writable
from kvstore.remote.node_client import NodeClient, PutBatch, SingleKeyCalls, all_stored
from kvstore.remote.pipelined import (
    PendingGet,
    PendingPut,
    PendingShmPut,
    finish_all,
    start_get,
    start_puts,
)
from replication.copies.peers import PeerPool
from replication.membership import Membership, StaticMembership
from replication.membership.etcd import EtcdMembership
from replication.placement.candidates import CandidateCache
from replication.placement.hotness import HotnessTracker
from replication.placement.rendezvous import Member, NodeId, Placement

log = logging.getLogger("kvstore.cluster")

T = TypeVar("T")
_COOL_CHECK_S = 1.0
_FIRST_VIEW_TIMEOUT_S = 10.0


class QuorumNotMet(Unavailable):
    """Fewer than ``write_quorum`` copies could be made; the copies made stay."""


@dataclass(frozen=True, slots=True, kw_only=True)
class Holder:
    """A node holding a key, and the tier the key is in there."""

    node_id: str
    addr: str
    tier: str


def _owners_and_rest(owners: list[NodeId], rest: list[NodeId]
                     ) -> tuple[list[NodeId], list[NodeId]]:
    return owners, rest


@dataclass(frozen=True, slots=True, kw_only=True)
class _View:
    """One membership view; ``cache`` memoises (owners, rest) per key for this view only."""

    by_id: dict[NodeId, Member]
    replicas: int
    cache: CandidateCache[tuple[list[NodeId], list[NodeId]]]

    @classmethod
    def of(cls, members: tuple[Member, ...], replicas: int) -> _View:
        return cls(by_id={m.node_id: m for m in members}, replicas=replicas,
                   cache=CandidateCache(Placement(members), _owners_and_rest))

    @property
    def placement(self) -> Placement:
        return self.cache.placement

    def candidates(self, key: BlockKey) -> tuple[list[NodeId], list[NodeId]]:
        return self.cache.get(key, self.replicas)

    def candidates_many(self, keys: Sequence[BlockKey]
                        ) -> list[tuple[list[NodeId], list[NodeId]]]:
        return self.cache.get_many(keys, self.replicas)


class ClusterClient(SingleKeyCalls):
    """A client of a whole cluster; thread-safe; use as a context manager."""

    def __init__(self, *, etcd: str | None = None, members: Sequence[Member] | None = None,
                 membership: Membership | None = None, replicas: int = 1,
                 write_quorum: int | None = None, transport: str = "auto",
                 timeout: float | None = 30.0, node_timeout: float = 5.0,
                 hot_reads_per_s: float | None = None, hot_half_life_s: float = 10.0,
                 fanout: int = 2,
                 suspect_s: float = 5.0, clock: Callable[[], float] = time.monotonic,
                 token: str | None = None, tls: ClientTls | None = None,
                 etcd_tls: ClientTls | None = None, pipeline: bool = True) -> None:
        """``pipeline=False``: a batch put calls its masters on a thread each, not pipelined
        (``kvstore/remote/pipelined.py``): what puts did before, kept for comparison."""
        if sum(x is not None for x in (etcd, members, membership)) != 1:
            raise InvalidArgument("give exactly one of etcd=, members= or membership=")
        if replicas < 1:
            raise InvalidArgument(f"replicas must be >= 1, got {replicas}")
        quorum = replicas if write_quorum is None else write_quorum
        if not 1 <= quorum <= replicas:
            raise InvalidArgument(f"need 1 <= write_quorum <= replicas, got {quorum}")
        if fanout < 0:
            raise InvalidArgument(f"fanout must be >= 0, got {fanout}")
        self.replicas = replicas
        self.write_quorum = quorum
        self.pipeline = pipeline
        self.fanout = fanout
        self.timeout = timeout
        self._clock = clock
        self._suspect_s = suspect_s
        self._owns_membership = membership is None
        if membership is None:
            membership = (EtcdMembership(etcd, tls=etcd_tls) if etcd is not None
                          else StaticMembership(list(members or ())))
        self.membership = membership
        # A node that does not answer in node_timeout is failed over, but a transfer may
        # stall while its master replaces a stopped replica: the caller's own timeout.
        self._peers = PeerPool(transport=transport, timeout=min(timeout or node_timeout,
                                                                   node_timeout),
                               token=token, tls=tls, io_timeout=timeout)
        self._pool = ThreadPoolExecutor(max_workers=16, thread_name_prefix="kvstore-cluster")
        self._hot = (HotnessTracker(hot_reads_per_s=hot_reads_per_s,
                                    half_life_s=hot_half_life_s, clock=clock)
                     if hot_reads_per_s else None)
        self._hot_lock = threading.Lock()  # guards _hot (not thread-safe itself)
        self._lock = threading.Lock()
        # guarded by _lock:
        self._view = _View.of((), replicas)
        self._suspects: dict[NodeId, float] = {}  # node -> until (clock)
        self._fanned: dict[BlockKey, list[NodeId]] = {}  # hot key -> nodes given extra copies
        # Nodes that refused a replicated put (outside an etcd cluster): put + Replicate there.
        self._no_forward: set[NodeId] = set()
        self._next_cool_check = 0.0
        self._spread = itertools.count()
        self._on_members(membership.members())
        self._unsubscribe = membership.subscribe(self._on_members)
        if not self._view.by_id and etcd is not None:
            membership.wait_for(bool, _FIRST_VIEW_TIMEOUT_S)

    # ---- lifecycle and membership ---------------------------------------------------------

    def __enter__(self) -> ClusterClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self._unsubscribe()
        if self._owns_membership:
            self.membership.close()
        self._pool.shutdown(wait=True)
        self._peers.close()

    def _on_members(self, view: Sequence[Member]) -> None:
        members = tuple(view)
        new = _View.of(members, self.replicas)
        with self._lock:
            self._view = new
        self._peers.retain(m.addr for m in members)

    @property
    def transport(self) -> str:
        """The transport asked of every node client (``auto`` picks per node)."""
        return self._peers.transport

    def members(self) -> tuple[Member, ...]:
        return self._current().placement.members

    def _current(self) -> _View:
        with self._lock:
            view = self._view
        if not view.by_id:
            raise Unavailable("no live kvstore nodes in the cluster")
        return view

    def _client(self, view: _View, node: NodeId) -> NodeClient:
        return self._peers.get(view.by_id[node].addr)

    def _suspect(self, node: NodeId) -> None:
        with self._lock:
            self._suspects[node] = self._clock() + self._suspect_s

    def _suspects_now(self) -> set[NodeId]:
        now = self._clock()
        with self._lock:
            return {n for n, until in self._suspects.items() if until > now}

    @staticmethod
    def _demote(nodes: list[NodeId], bad: set[NodeId]) -> list[NodeId]:
        if not bad:
            return nodes
        return [n for n in nodes if n not in bad] + [n for n in nodes if n in bad]

    # ---- placement -----------------------------------------------------------------------

    def _read_candidates(self, view: _View, key: BlockKey, bad: set[NodeId]) -> list[NodeId]:
        owners, rest = view.candidates(key)
        return self._read_order(view, key, owners, rest, bad)

    def _read_order(self, view: _View, key: BlockKey, owners: list[NodeId],
                    rest: list[NodeId], bad: set[NodeId]) -> list[NodeId]:
        """The nodes a read of ``key`` asks, in turn, given its (owners, rest)."""
        fanned = self._fanned.get(key) if self._fanned else None  # a racy read is harmless
        if fanned:
            live = [n for n in fanned if n in view.by_id and n not in owners]
            spread = owners + live
            start = next(self._spread) % len(spread)
            first = spread[start:] + spread[:start]
            rest = [n for n in rest if n not in live]
            return self._demote(first, bad) + rest[:1]
        return self._demote(owners, bad) + rest[:1]

    # ---- writes --------------------------------------------------------------------------

    def put_batch(self, keys: Sequence[bytes], values: Sequence[object], *,
                  parents: Sequence[bytes | None] | None = None, pin: bool = False,
                  retain_s: float | None = None) -> list[bool]:
        """``retain_s``: every copy keeps the blocks (docs/node.md, "Retention")."""
        batch = PutBatch.check(keys, values, parents=parents, pin=pin, retain_s=retain_s)
        ks = batch.keys
        view = self._current()
        live = len(view.by_id)
        if self.write_quorum > live:
            raise Unavailable(f"write quorum {self.write_quorum} needs {self.write_quorum} live "
                              f"nodes; {live} live")
        stored = [False] * len(ks)
        # Owners, then every other node in ranking order (fallbacks).
        cands = [owners + rest for owners, rest in view.candidates_many(ks)]
        down: set[NodeId] = set()  # nodes that failed as master during this call
        errors: list[str] = []
        pending = list(range(len(ks)))
        resent = False  # keys put again after their master failed: all_stored
        while pending:
            bad = self._suspects_now()
            groups: dict[NodeId, list[int]] = {}
            for i in pending:
                alive = [n for n in cands[i] if n not in down]
                if not alive:
                    raise Unavailable("no node accepted the put: " + "; ".join(errors))
                groups.setdefault(self._demote(alive, bad)[0], []).append(i)
            retry: list[int] = []

            def master_down(master: NodeId, idx: list[int], exc: Unavailable,
                            retry: list[int] = retry) -> None:
                self._suspect(master)
                down.add(master)
                errors.append(str(exc))
                retry.extend(idx)

            def record(idx: list[int], flags: list[bool], resent: bool = resent) -> None:
                for i, f in zip(idx, all_stored(flags) if resent else flags, strict=True):
                    stored[i] = f

            def put_group(master: NodeId, idx: list[int]) -> None:
                client = self._client(view, master)
                part = batch.pick(idx)
                try:
                    if self.replicas > 1 and master not in self._no_forward:
                        try:
                            flags = self._put_forwarded(client, part)
                        except FailedPrecondition:  # not an etcd member: the two-trip path
                            with self._lock:
                                self._no_forward.add(master)
                        else:
                            record(idx, flags)
                            return
                    flags = client.put_checked(part)
                    if self.replicas > 1:
                        others = [n for n in view.by_id if n != master]
                        slot = {n: j for j, n in enumerate(others)}
                        orders = [[slot[n] for n in cands[i] if n != master and n not in down]
                                  for i in idx]
                        self._replicate(client, part, [view.by_id[n].addr for n in others],
                                        orders)
                except QuorumNotMet:
                    raise
                except Unavailable as exc:  # the master is down (or died before replicating)
                    master_down(master, idx, exc)
                    return
                record(idx, flags)

            def finish_group(master: NodeId, idx: list[int], sent: PendingPut | PendingShmPut
                             ) -> None:
                try:
                    flags, copies, failed = sent.finish()
                except FailedPrecondition:  # not an etcd member: the two-trip path
                    with self._lock:
                        self._no_forward.add(master)
                    return put_group(master, idx)
                except Unavailable as exc:
                    return master_down(master, idx, exc)
                self._check_quorum(copies, failed)
                record(idx, flags)

            # Stream connections pipeline: every master gets its part before any reply is
            # read (kvstore/remote/pipelined.py); the others are called as before.
            sent = start_puts({m: (self._client(view, m), batch.pick(idx))
                               for m, idx in groups.items()
                               if self.replicas == 1 or m not in self._no_forward},
                              copies=self.replicas, write_quorum=self.write_quorum
                              ) if self.pipeline else {}
            # Replicated puts wait on their masters' forwards (no GIL): those overlap.
            try:
                for p in sent.values():  # same-host puts: every RESERVE is sent, now fill
                    p.advance()
                self._parallel([partial(put_group, m, idx) for m, idx in groups.items()
                                if m not in sent],
                               serial=self.replicas == 1 and self._all_mapped(view, groups))
            finally:  # every pending reply is read, whatever the other masters did
                finish_all([partial(finish_group, m, groups[m], p) for m, p in sent.items()])
            pending, resent = retry, True
        return stored

    def _put_forwarded(self, client: NodeClient, batch: PutBatch) -> list[bool]:
        """One trip: the master stores the blocks and forwards them to the owners it
        ranks itself; QuorumNotMet if fewer than ``write_quorum`` copies exist."""
        flags, copies, failed = client.put_checked_replicated(
            batch, copies=self.replicas, write_quorum=self.write_quorum)
        self._check_quorum(copies, failed)
        return flags

    def _check_quorum(self, copies: int, failed: list[str]) -> None:
        if copies < self.write_quorum:
            raise QuorumNotMet(f"write quorum not met: {copies} of {self.write_quorum} copies "
                               f"({'; '.join(failed)})")

    def _replicate(self, client: NodeClient, batch: PutBatch, targets: list[str],
                   orders: list[list[int]]) -> None:
        """Asks the master ``client`` to copy the batch's keys to their replicas;
        QuorumNotMet if fewer than ``write_quorum`` copies exist when it answers."""
        keys = batch.keys
        for attempt in (1, 2):
            reply = client.replicate(keys, targets, copies=self.replicas,
                                     write_quorum=self.write_quorum, orders=orders)
            if reply.missing and attempt == 1:
                # Evicted on the master between put and replicate: store those again.
                lost = set(reply.missing)
                client.put_checked(batch.pick([i for i, k in enumerate(keys) if k in lost]))
                continue
            if reply.missing:
                raise QuorumNotMet(f"{len(reply.missing)} blocks were evicted on "
                                   f"{client.addr} before they could be replicated")
            if reply.copies < self.write_quorum:
                raise QuorumNotMet(f"write quorum not met: {reply.copies} of "
                                   f"{self.write_quorum} copies ({'; '.join(reply.failed)})")
            return

    # ---- reads ---------------------------------------------------------------------------

    def _rounds(self, keys: list[BlockKey], call: Callable[[NodeClient, list[int]], list[Any]],
                found: Callable[[Any], bool], *, record_reads: bool = False,
                start: Callable[[NodeClient, list[int]], PendingGet | None] | None = None
                ) -> list[Any]:
        """Asks each key of its read candidates in turn; per key the first ``found`` answer
        (or the last answer seen, a miss). ``start``: sends a node its keys' request without
        reading the answer, or None where that node's call does not pipeline; every node
        started is sent its request before any answer is read (``kvstore.remote.pipelined``),
        and a started call whose stream broke is made again the ordinary way."""
        view = self._current()
        results: list[Any] = [None] * len(keys)
        bad = self._suspects_now()
        cands = [self._read_order(view, k, owners, rest, bad)
                 for k, (owners, rest) in zip(keys, view.candidates_many(keys), strict=True)]
        pos = [0] * len(keys)
        answered = [False] * len(keys)
        errors: list[str] = []
        pending = list(range(len(keys)))
        while pending:
            groups: dict[NodeId, list[int]] = {}
            for i in pending:
                groups.setdefault(cands[i][pos[i]], []).append(i)
            failed: set[NodeId] = set()

            def ask(node: NodeId, idx: list[int], failed: set[NodeId] = failed,
                    sent: PendingGet | None = None) -> None:
                try:
                    answers = sent.finish() if sent is not None else None
                    if answers is None:
                        answers = call(self._client(view, node), idx)
                except Unavailable as exc:
                    self._suspect(node)
                    failed.add(node)
                    errors.append(str(exc))
                    return
                for i, a in zip(idx, answers, strict=True):
                    results[i] = a
                    answered[i] = True

            started: dict[NodeId, PendingGet] = {}
            try:
                if start is not None and self.pipeline:
                    for n, idx in groups.items():
                        pending_get = start(self._client(view, n), idx)
                        if pending_get is not None:
                            started[n] = pending_get
                self._parallel([partial(ask, n, idx) for n, idx in groups.items()
                                if n not in started],
                               serial=self._all_mapped(view, groups))
            finally:  # every started answer is read, whatever the other nodes did
                finish_all([partial(ask, n, groups[n], sent=p) for n, p in started.items()])
            nxt = []
            for node, idx in groups.items():
                for i in idx:
                    if node in failed or not found(results[i]):
                        pos[i] += 1
                        if pos[i] < len(cands[i]):
                            nxt.append(i)
            pending = nxt
        if not all(answered):
            raise Unavailable(f"no holder of {answered.count(False)} keys answered: "
                              + "; ".join(dict.fromkeys(errors)))
        if record_reads and self._hot is not None:
            self._note_reads(view, keys)
        return results

    def get_batch(self, keys: Sequence[bytes]) -> list[bytes | None]:
        ks = [check_key(k) for k in keys]
        return self._rounds(ks, lambda c, idx: c.get_batch([ks[i] for i in idx]),
                            lambda r: r is not None, record_reads=True,
                            start=lambda c, idx: start_get(c, [ks[i] for i in idx], None))

    def get_batch_into(self, keys: Sequence[bytes], bufs: Sequence[object]) -> list[int | None]:
        ks = [check_key(k) for k in keys]
        if len(bufs) != len(ks):
            raise InvalidArgument(f"{len(ks)} keys but {len(bufs)} buffers")
        outs = [as_writable(b) for b in bufs]
        return self._rounds(
            ks, lambda c, idx: c.get_batch_into([ks[i] for i in idx], [outs[i] for i in idx]),
            lambda r: r is not None, record_reads=True,
            start=lambda c, idx: start_get(c, [ks[i] for i in idx], [outs[i] for i in idx]))

    def exists(self, keys: Sequence[bytes]) -> list[bool]:
        ks = [check_key(k) for k in keys]
        return [bool(x) for x in self._rounds(
            ks, lambda c, idx: c.exists([ks[i] for i in idx]), bool)]

    def prefix_match(self, keys: Sequence[bytes]) -> int:
        """How many leading keys of ``keys`` are stored somewhere in the cluster."""
        return leading_run(self.exists(keys))

    def locate(self, keys: Sequence[bytes]) -> list[str | None]:
        """The tier of the first holder found for each key, None if none holds it."""
        ks = [check_key(k) for k in keys]
        return self._rounds(ks, lambda c, idx: c.locate([ks[i] for i in idx]),
                            lambda r: r is not None)

    def prefetch(self, keys: Sequence[bytes], tier: str = DEFAULT_PREFETCH_TIER, *,
                 wait: bool = False) -> list[PrefetchOutcome]:
        """Asks each key's holder to bring it up to ``tier`` ahead of its use: the first of
        its read candidates that holds it, in the order a get asks them, so the copy made
        hot is the one the next read is served from. Per key the holder's outcome
        (``NodeClient.prefetch``), MISSING if no candidate holds it. At most
        ``MAX_PREFETCH_KEYS`` keys per call, all nodes together (InvalidArgument before
        anything is sent). Not a read: hot-block counts are untouched."""
        ks, name = check_prefetch(keys, tier)
        return self._rounds(ks, lambda c, idx: c.prefetch([ks[i] for i in idx], name,
                                                          wait=wait),
                            lambda r: r is not PrefetchOutcome.MISSING)

    def holders(self, keys: Sequence[bytes]) -> list[list[Holder]]:
        """For each key, every read candidate that holds it and in which tier (for the
        Conductor): owners, fan-out copies and the next ranked node, asked in parallel."""
        ks = [check_key(k) for k in keys]
        got = self._every_candidate(ks, lambda c, idx: c.locate([ks[i] for i in idx]))
        return [[Holder(node_id=m.node_id, addr=m.addr, tier=t) for m, t in g if t is not None]
                for g in got]

    def retain(self, keys: Sequence[bytes], retain_s: float) -> list[RetainOutcome]:
        """Retains (or with 0 releases) every copy of each key: each of its read candidates
        is asked, in parallel, as ``holders`` asks them, so whichever copy a later read is
        served from is kept. Per key the best answer of any copy (``merged_outcome``:
        retained, denied, released, missing); a node that cannot be reached is skipped.
        At most ``MAX_RETAIN_KEYS`` keys (InvalidArgument before anything is sent)."""
        ks, seconds = check_retain(keys, retain_s)
        got = self._every_candidate(ks, lambda c, idx: c.retain([ks[i] for i in idx], seconds))
        return [merged_outcome([o for _, o in g]) for g in got]

    def _every_candidate(self, ks: list[BlockKey],
                         call: Callable[[NodeClient, list[int]], list[T]]
                         ) -> list[list[tuple[Member, T]]]:
        """Each key's answers from every read candidate that answered, asked in parallel
        (one call per node); a node that fails is suspected and left out."""
        view = self._current()
        asks: dict[NodeId, list[int]] = {}
        bad = self._suspects_now()
        for i, k in enumerate(ks):
            for n in self._read_candidates(view, k, bad):
                asks.setdefault(n, []).append(i)
        out: list[list[tuple[Member, T]]] = [[] for _ in ks]
        lock = threading.Lock()

        def ask(node: NodeId, idx: list[int]) -> None:
            try:
                answers = call(self._client(view, node), idx)
            except Unavailable:
                self._suspect(node)
                return
            m = view.by_id[node]
            with lock:
                for i, a in zip(idx, answers, strict=True):
                    out[i].append((m, a))

        self._parallel([partial(ask, n, idx) for n, idx in asks.items()])
        return out

    def remove(self, key: bytes) -> bool:
        """Removes ``key`` from every live node; True if any held it."""
        k = check_key(key)
        view = self._current()
        removed = []

        def rm(node: NodeId) -> None:
            try:
                removed.append(self._client(view, node).remove(k))
            except Unavailable:
                self._suspect(node)

        self._parallel([partial(rm, n) for n in view.by_id])
        with self._lock:
            self._fanned.pop(k, None)
        return any(removed)

    def stats(self) -> dict[str, dict[str, Any]]:
        """Each live node's ``stats()`` by node id (an ``{"error": ...}`` for one that fails)."""
        view = self._current()
        out: dict[str, dict[str, Any]] = {}

        def st(node: NodeId) -> None:
            try:
                out[node] = self._client(view, node).stats()
            except KVStoreError as exc:
                out[node] = {"error": str(exc)}

        self._parallel([partial(st, n) for n in view.by_id])
        return dict(sorted(out.items()))

    # ---- hot blocks ----------------------------------------------------------------------

    def _note_reads(self, view: _View, keys: list[BlockKey]) -> None:
        assert self._hot is not None
        with self._hot_lock:
            turned = [k for k, n in Counter(keys).items() if self._hot.record(k, n)]
        for k in turned:
            self._pool.submit(self._fan_out, view, k)
        now = self._clock()
        with self._lock:
            due = now >= self._next_cool_check
            if due:
                self._next_cool_check = now + _COOL_CHECK_S
        if due:
            with self._hot_lock:
                cooled = self._hot.cooled()
            for raw in cooled:  # the tracker keeps the keys it was given as plain bytes
                self._pool.submit(self._drop_fan_out, view, BlockKey(raw))

    def _fan_out(self, view: _View, key: BlockKey) -> None:
        owners, rest = view.candidates(key)
        extra = rest[: self.fanout]
        if not extra:
            return
        try:
            self._client(view, owners[0]).replicate(
                [key], [view.by_id[n].addr for n in extra], copies=1 + len(extra),
                write_quorum=1 + len(extra))
        except KVStoreError as exc:
            log.info("fan-out of %s failed: %s", key.hex(), exc)
            return
        with self._lock:
            self._fanned[key] = extra

    def _drop_fan_out(self, view: _View, key: BlockKey) -> None:
        with self._lock:
            extra = self._fanned.pop(key, [])
        owners = set(view.placement.owners(key, self.replicas))
        for n in extra:
            if n in view.by_id and n not in owners:
                try:
                    self._client(view, n).remove(key)
                except KVStoreError as exc:
                    log.info("dropping fan-out copy of %s on %s failed: %s", key.hex(), n, exc)

    def fanned_out(self) -> dict[bytes, list[str]]:
        """Hot keys with extra copies, and the nodes holding them."""
        with self._lock:
            return {k: list(v) for k, v in self._fanned.items()}

    # ---- helpers -------------------------------------------------------------------------

    def _all_mapped(self, view: _View, nodes: Iterable[NodeId]) -> bool:
        """True if every node's client copies through shared memory (see
        ``NodeClient.maps_node_memory``): threads would only take turns holding the GIL."""
        return all(self._client(view, n).maps_node_memory for n in nodes)

    def _parallel(self, calls: list[Callable[[], None]], *, serial: bool = False) -> None:
        """Runs the calls, in parallel when there are several (unless ``serial``);
        re-raises the first error."""
        if not calls:
            return
        if serial:
            for call in calls:
                call()
            return
        futures = [self._pool.submit(c) for c in calls[1:]]
        try:
            calls[0]()  # the caller's thread does one share instead of idling
        finally:
            wait(futures)  # never leave work running on the caller's buffers
        for f in futures:
            f.result()
