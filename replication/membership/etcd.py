"""etcd-backed membership (see ``replication/membership/__init__.py`` for the key format).

Threads. ``EtcdMembership`` runs one asyncio event loop in a daemon thread; that
loop owns the aetcd client and all state touched by etcd I/O. The public methods
are synchronous and thread-safe: they submit a coroutine to the loop and wait for
it. Subscriber callbacks run in a second daemon thread (one per instance, started
at the first ``subscribe``), in order, one at a time, so a slow callback never
delays lease keepalives and a callback may itself call ``members``, ``register``,
``update`` or ``leave``. No public method may be called from the loop thread.

Retry policy. Every etcd call but the long-lived watch stream is bounded by
``timeout`` seconds; a watch on a silently dead connection is noticed by gRPC
keepalive pings (every 10 s, 5 s to answer). The watcher and the keepalive retry
failed calls forever, sleeping 0.1 s doubling up to 2 s (keepalive: up to
``ttl / 3``), each sleep scaled by a random factor in [0.5, 1] so many nodes do
not reconnect in lock step; a success resets the delay. The first failure of an
outage is logged as a warning, the retries at debug level. The gRPC channel
reconnects by itself, with its own backoff capped at 2 s. ``register``/``update``
retry within their ``timeout`` and then raise ``MembershipUnavailable``.

What callers can rely on:

* ``members()`` is eventually consistent: it reflects etcd as of the last event
  received, sorted by ``node_id``. While etcd is unreachable the last known view
  is kept (never emptied); on reconnect the prefix is listed again and watched
  from the listed revision, so the view matches etcd again (changes made during
  the outage arrive as one new view) and no later change is missed.
* Construction returns after the first listing, so ``members()`` is meaningful
  at once. ``register``/``update`` return after the write, and (unless the watch
  is disconnected) after this instance's own view shows it; ``leave`` likewise.
* Callbacks receive each new view after every change, in order, never
  concurrently with each other. They are not called at ``subscribe`` time.
* A registered node stays registered: if its lease is found gone it re-registers
  with a new lease, retrying while etcd is unreachable, for as long as it has
  not left. If another live node took the id meanwhile, it logs an error and
  keeps retrying until that node goes away.
* Values that are not valid member JSON are logged and ignored; they never stop
  the watcher.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import random
import threading
import time
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from typing import Any, TypeVar

import aetcd
import aetcd.exceptions
import aetcd.transactions
import grpc
from aetcd import rpc

from kvstore.auth.security import ClientTls
from replication.membership.base import (
    DEFAULT_PREFIX,
    Callback,
    MembershipError,
    MembershipUnavailable,
    View,
    ViewBroadcast,
    decode_member,
    encode_member,
)
from replication.placement.rendezvous import Member

log = logging.getLogger("kvstore.membership")

T = TypeVar("T")

# gRPC channel options: reconnect quickly after an etcd restart (the default backoff grows
# to 120 s), and notice a silently dead connection (etcd allows pings every 5 s or slower).
_CHANNEL_OPTIONS: dict[str, Any] = {
    "grpc.initial_reconnect_backoff_ms": 100,
    "grpc.max_reconnect_backoff_ms": 2000,
    "grpc.keepalive_time_ms": 10_000,
    "grpc.keepalive_timeout_ms": 5_000,
}


class _LeaseGone(MembershipError):
    """etcd no longer knows the lease (it expired or was revoked)."""


# ---- etcd -----------------------------------------------------------------------------------


class _LeaseIs(aetcd.transactions.BaseCompare):
    """Transaction compare on a key's lease id (aetcd offers value/version/create/mod only).

    A missing key compares as lease 0.
    """

    def __init__(self, key: bytes) -> None:
        # Only to type the constructor: aetcd's own is unannotated. Named, not super(), so
        # that the type checker sees it is aetcd's (untyped_calls_exclude).
        aetcd.transactions.BaseCompare.__init__(self, key)

    def build_compare(self, compare: Any) -> None:
        compare.target = rpc.Compare.LEASE
        compare.lease = int(self.value)


@dataclass(slots=True, kw_only=True)
class _Backoff:
    """Delays of ``first`` doubling to ``cap`` seconds, each scaled by U(0.5, 1).

    ``failures`` counts delays since the last ``reset``, so a retry loop can log the first
    failure of an outage loudly and the rest quietly.
    """

    first: float = 0.1
    cap: float = 2.0
    failures: int = field(default=0, init=False)

    def delay(self) -> float:
        d = min(self.cap, self.first * 2.0 ** min(self.failures, 30))
        self.failures += 1
        return d * random.uniform(0.5, 1.0)

    @property
    def log_level(self) -> int:
        """WARNING for the first failure since the last success, DEBUG after."""
        return logging.WARNING if self.failures == 0 else logging.DEBUG

    def reset(self) -> bool:
        """Forgets past failures; True if there were any (an outage just ended)."""
        failed, self.failures = self.failures > 0, 0
        return failed


@dataclass(slots=True, kw_only=True)
class _Registration:
    """This instance's own registration. ``lease_id == 0``: no lease known to be live."""

    member: Member
    ttl: int
    lease_id: int = 0
    revision: int = 0  # of the last successful write
    keepalive: asyncio.Task[None] | None = None


# Errors where etcd answered, so retrying the same request is pointless.
_ETCD_REFUSED = (
    aetcd.InvalidArgumentError,
    aetcd.PreconditionFailedError,
    aetcd.RevisionCompactedError,
    aetcd.exceptions.UnauthenticatedError,
)
# Everything else a call can raise when etcd is down, restarting or slow.
_TRANSPORT = (aetcd.ClientError, grpc.RpcError, OSError, TimeoutError)


def _is_lease_gone(error: BaseException) -> bool:
    cause = error.__cause__  # aetcd raises its errors "from" the gRPC error
    return isinstance(cause, grpc.aio.AioRpcError) and cause.code() == grpc.StatusCode.NOT_FOUND


def _parse_endpoint(endpoint: str) -> tuple[str, int]:
    hostport = endpoint.removeprefix("http://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"etcd endpoint must be 'host:port', got {endpoint!r}")
    return host.strip("[]"), int(port)


class _TlsEtcdClient(aetcd.Client):
    """aetcd 1.0 opens only plaintext channels. This ``connect`` is aetcd's own
    (aetcd/client.py, 1.0.0) with ``secure_channel`` in place of ``insecure_channel``;
    no etcd user/password (TLS client certificates authenticate instead)."""

    def __init__(self, host: str, port: int, *, credentials: grpc.ChannelCredentials,
                 **kwargs: Any) -> None:
        super().__init__(host, port, **kwargs)
        self._credentials = credentials

    async def connect(self) -> None:
        if self._connected.is_set():
            return
        if self._is_connecting:
            await asyncio.wait_for(self._connected.wait(), self._connect_wait_timeout)
            return
        try:
            self._is_connecting = True
            self.channel = aetcd.rpc.secure_channel(f"{self._host}:{self._port}",
                                                    self._credentials,
                                                    options=list(self._options.items()))
            self.kvstub = aetcd.rpc.KVStub(self.channel)
            self.clusterstub = aetcd.rpc.ClusterStub(self.channel)
            self.leasestub = aetcd.rpc.LeaseStub(self.channel)
            self.maintenancestub = aetcd.rpc.MaintenanceStub(self.channel)
            self._watcher = aetcd.watcher.Watcher(aetcd.rpc.WatchStub(self.channel),
                                                  timeout=self._timeout, metadata=self.metadata)
            self._connected.set()
        finally:
            self._is_connecting = False


class EtcdMembership:
    """Membership kept in etcd at ``endpoint`` (``"host:port"``); see the module docstring.

    ``timeout`` bounds each etcd call and each blocking method; ``clock`` measures those
    deadlines. Construction raises ``MembershipUnavailable`` if etcd cannot be listed
    within ``timeout``.
    """

    def __init__(
        self,
        endpoint: str,
        *,
        prefix: str = DEFAULT_PREFIX,
        timeout: float = 5.0,
        clock: Callable[[], float] = time.monotonic,
        tls: ClientTls | None = None,
    ) -> None:
        if not prefix:
            raise ValueError("prefix must not be empty")
        self._tls = tls  # etcd over TLS (with a client certificate when tls has one)
        self._endpoint = endpoint
        self._host, self._port = _parse_endpoint(endpoint)
        self._prefix = prefix.encode()
        self._timeout = timeout
        self._clock = clock
        self._views = ViewBroadcast(f"membership-callbacks-{endpoint}")
        self._connected = False
        self._close_lock = threading.Lock()
        self._closed = False
        # Loop-thread state, never touched from other threads once the loop runs.
        self._entries: dict[str, tuple[Member, int]] = {}  # node id -> (member, lease id)
        self._seen_revision = 0  # newest etcd revision the view reflects
        self._reg: _Registration | None = None
        self._client: aetcd.Client
        self._progress: asyncio.Condition
        self._reg_lock: asyncio.Lock
        self._watch_task: asyncio.Task[None]
        self._synced = threading.Event()

        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever,
                                        name=f"membership-{endpoint}", daemon=True)
        self._thread.start()
        self._submit(self._start(), timeout)
        if not self._synced.wait(timeout):
            self.close()
            raise MembershipUnavailable(f"etcd at {endpoint} could not be listed in {timeout}s")

    # ---- public API (any thread but the loop's) ----------------------------------------------

    @property
    def connected(self) -> bool:
        """Whether the last etcd call succeeded (for health reporting)."""
        return self._connected

    def members(self) -> View:
        return self._views.view

    def subscribe(self, callback: Callback) -> Callable[[], None]:
        return self._views.subscribe(callback)

    def wait_for(self, predicate: Callable[[View], bool], timeout: float) -> bool:
        return self._views.wait_for(predicate, timeout)

    def register(self, member: Member, *, ttl: int = 10) -> None:
        """Registers ``member`` under a lease of ``ttl`` s and keeps it alive until ``leave``.

        Raises ``MembershipError`` if a live node holds the same id, or if this instance is
        already registered; ``MembershipUnavailable`` if etcd is unreachable for ``timeout``.
        """
        if not isinstance(ttl, int) or ttl < 1:
            raise ValueError(f"ttl must be an integer >= 1, got {ttl!r}")
        self._submit(self._register(member, ttl), self._timeout)

    def update(self, member: Member) -> None:
        """Replaces the registered value (same node id, e.g. a new weight), keeping the lease."""
        self._submit(self._update(member), self._timeout)

    def leave(self) -> None:
        """Revokes the lease so the member disappears at once; idempotent.

        If etcd is unreachable the lease cannot be revoked; the member then disappears
        when the lease expires (within ``ttl``), and a warning is logged.
        """
        self._submit(self._leave(), self._timeout)

    def close(self) -> None:
        """Leaves (if registered), stops watching and ends the threads; idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        try:
            if self._loop.is_running():
                self._submit(self._shutdown(), 2 * self._timeout, closing=True)
        except MembershipError as e:  # an unrevoked lease still expires within its ttl
            log.warning("membership close: %s", e)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(self._timeout)
            if not self._thread.is_alive():
                self._loop.close()
            self._views.close()

    def __enter__(self) -> EtcdMembership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _submit(self, coro: Coroutine[Any, Any, T], timeout: float, *, closing: bool = False
                ) -> T:
        """Runs ``coro`` on the loop and waits; the coroutines enforce their own deadlines."""
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("EtcdMembership methods must not be called from its event loop")
        if self._closed and not closing:
            coro.close()
            raise MembershipError("membership is closed")
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout + 1.0)  # grace: the deadline inside fires first
        except concurrent.futures.TimeoutError:
            future.cancel()
            raise MembershipUnavailable(f"etcd at {self._endpoint}: no answer in {timeout}s"
                                        ) from None

    # ---- loop thread: the error choke point --------------------------------------------------

    async def _call(self, awaitable: Awaitable[T]) -> T:
        """Awaits one etcd call: the only place aetcd/gRPC errors become domain errors."""
        try:
            result = await awaitable
        except _ETCD_REFUSED as e:
            self._connected = True
            raise MembershipError(f"etcd at {self._endpoint} refused: {e!r}") from e
        except _TRANSPORT as e:
            if _is_lease_gone(e):  # the only NOT_FOUND etcd's KV and lease calls return
                self._connected = True
                raise _LeaseGone(str(e)) from e
            self._connected = False
            raise MembershipUnavailable(f"etcd at {self._endpoint} unreachable: {e}") from e
        self._connected = True
        return result

    async def _retry(self, op: Callable[[], Awaitable[T]], deadline: float) -> T:
        """``op()`` retried on ``MembershipUnavailable`` with backoff until ``deadline``."""
        backoff = _Backoff()
        while True:
            try:
                return await op()
            except MembershipUnavailable:
                pause = backoff.delay()
                if self._clock() + pause >= deadline:
                    raise
                await asyncio.sleep(pause)

    # ---- loop thread: the watcher ------------------------------------------------------------

    async def _start(self) -> None:
        if self._tls is None:
            self._client = aetcd.Client(
                self._host, self._port,
                timeout=self._timeout,  # type: ignore[arg-type]  # aetcd annotates int; seconds for grpc, a float works
                options=_CHANNEL_OPTIONS)
        else:
            self._client = _TlsEtcdClient(self._host, self._port, timeout=self._timeout,
                                          options=_CHANNEL_OPTIONS,
                                          credentials=self._tls.grpc_credentials())
        self._progress = asyncio.Condition()
        self._reg_lock = asyncio.Lock()
        self._watch_task = asyncio.get_running_loop().create_task(self._watch_forever())

    async def _watch_forever(self) -> None:
        """List, then watch from the listed revision + 1; on any failure, back off and repeat."""
        backoff = _Backoff()
        while True:
            try:
                listing = await self._call(self._client.get_prefix(self._prefix))
                await self._replace_all(listing)
                self._synced.set()
                watch = await self._call(self._client.watch_prefix(
                    self._prefix, start_revision=listing.header.revision + 1))
                if backoff.reset():
                    log.info("membership watch on %s is back", self._endpoint)
                events = aiter(watch)
                while True:
                    event = await self._call(anext(events))
                    await self._apply(event)
            except StopAsyncIteration:
                log.log(backoff.log_level, "etcd watch on %s ended; listing again",
                        self._endpoint)
            except MembershipError as e:
                log.log(backoff.log_level,
                        "membership watch: %s; keeping the last view and retrying", e)
            await asyncio.sleep(backoff.delay())

    def _node_id(self, key: bytes) -> str | None:
        try:
            node_id = key[len(self._prefix):].decode("utf-8")
        except UnicodeDecodeError:
            node_id = ""
        if not node_id:
            log.warning("ignoring membership key %r: no valid node id after the prefix", key)
            return None
        return node_id

    def _parse(self, node_id: str, kv: Any) -> Member | None:
        try:
            return decode_member(node_id, kv.value)
        except ValueError as e:
            log.warning("ignoring malformed member value under %r: %s (%r)", kv.key, e,
                        bytes(kv.value[:200]))
            return None

    async def _replace_all(self, listing: Any) -> None:
        entries: dict[str, tuple[Member, int]] = {}
        for kv in listing:
            node_id = self._node_id(kv.key)
            member = self._parse(node_id, kv) if node_id is not None else None
            if node_id is not None and member is not None:
                entries[node_id] = (member, kv.lease)
        self._entries = entries
        await self._changed(listing.header.revision)

    async def _apply(self, event: aetcd.Event) -> None:
        node_id = self._node_id(event.kv.key)
        if node_id is not None:
            member = self._parse(node_id, event.kv) if event.kind == "PUT" else None
            if member is None:  # deleted, or now malformed: not a live member any more
                self._entries.pop(node_id, None)
            else:
                self._entries[node_id] = (member, event.kv.lease)
        await self._changed(event.kv.mod_revision)

    async def _changed(self, revision: int) -> None:
        self._seen_revision = max(self._seen_revision, revision)
        view = tuple(sorted((m for m, _ in self._entries.values()), key=lambda m: m.node_id))
        self._views.publish(view)
        async with self._progress:
            self._progress.notify_all()

    async def _await_view(self, predicate: Callable[[], bool], deadline: float) -> None:
        """Waits (best effort, until ``deadline``) for this instance's own view to catch up."""
        try:
            async with self._progress:
                await asyncio.wait_for(self._progress.wait_for(predicate),
                                       max(0.0, deadline - self._clock()))
        except TimeoutError:
            log.info("membership view did not catch up before the deadline (watch lagging)")

    # ---- loop thread: registration -----------------------------------------------------------

    def _key(self, node_id: str) -> bytes:
        return self._prefix + node_id.encode()

    async def _publish(self, reg: _Registration) -> int:
        """Writes ``reg.member`` under ``reg``'s lease (granting one if it has none).

        The write succeeds only if the key is absent or already carries this lease, so a
        live node's registration is never overwritten. Returns the write's revision.
        Retrying after an unanswered attempt is safe: the lease is granted once and reused.
        """
        if reg.lease_id != 0:
            try:
                return await self._write(reg)
            except _LeaseGone:
                log.warning("lease of %s is gone; granting a new one", reg.member.node_id)
        reg.lease_id = 0
        reg.lease_id = (await self._call(self._client.lease(reg.ttl))).id
        return await self._write(reg)

    async def _write(self, reg: _Registration) -> int:
        client = self._client
        key = self._key(reg.member.node_id)
        t = client.transactions
        put = t.put(key, encode_member(reg.member), lease=reg.lease_id)
        created, responses = await self._call(client.transaction(
            compare=[t.version(key) == 0],
            success=[put],
            failure=[t.txn(compare=[_LeaseIs(key) == reg.lease_id], success=[put], failure=[])],
        ))
        response = responses[0] if created else responses[0].response_txn
        if not created and not response.succeeded:
            raise MembershipError(
                f"node id {reg.member.node_id!r} is already registered by a live node")
        put_response = response.response_put if created else response.responses[0].response_put
        reg.revision = int(put_response.header.revision)
        return reg.revision

    async def _register(self, member: Member, ttl: int) -> None:
        deadline = self._clock() + self._timeout
        async with self._reg_lock:
            if self._reg is not None:
                raise MembershipError(
                    f"already registered as {self._reg.member.node_id!r}; leave() first")
            reg = _Registration(member=member, ttl=ttl)
            try:
                revision = await self._retry(lambda: self._publish(reg), deadline)
            except BaseException:
                await self._revoke(reg)  # the last attempt may have written unseen
                raise
            self._reg = reg
            reg.keepalive = asyncio.get_running_loop().create_task(self._keep_alive(reg))
        await self._await_view(lambda: self._seen_revision >= revision, deadline)

    async def _update(self, member: Member) -> None:
        deadline = self._clock() + self._timeout
        async with self._reg_lock:
            reg = self._reg
            if reg is None:
                raise MembershipError("not registered: register() first")
            if member.node_id != reg.member.node_id:
                raise MembershipError(
                    f"update() cannot change the node id ({reg.member.node_id!r} to "
                    f"{member.node_id!r}); leave() and register() instead")
            reg.member = member  # the keepalive re-registers with it even if this write fails
            revision = await self._retry(lambda: self._publish(reg), deadline)
        await self._await_view(lambda: self._seen_revision >= revision, deadline)

    async def _leave(self) -> None:
        deadline = self._clock() + self._timeout
        async with self._reg_lock:
            reg, self._reg = self._reg, None
            if reg is None:
                return
            assert reg.keepalive is not None
            reg.keepalive.cancel()
            await asyncio.gather(reg.keepalive, return_exceptions=True)
            lease_id = reg.lease_id
            if not await self._revoke(reg):
                return
        node_id = reg.member.node_id
        await self._await_view(
            lambda: self._entries.get(node_id, (None, 0))[1] != lease_id, deadline)

    async def _revoke(self, reg: _Registration) -> bool:
        """Revokes ``reg``'s lease if it has one; False (logged) if etcd is unreachable."""
        if reg.lease_id == 0:
            return True
        try:
            await self._call(self._client.revoke_lease(reg.lease_id))
        except _LeaseGone:
            pass
        except MembershipError as e:
            log.warning("could not revoke the lease of %s (%s); it expires within %d s",
                        reg.member.node_id, e, reg.ttl)
            return False
        reg.lease_id = 0
        return True

    async def _keep_alive(self, reg: _Registration) -> None:
        """Refreshes the lease every ``ttl / 3`` s; re-registers when etcd says it is gone.

        Also writes the value again if the lease lives but the view, once it has caught up
        with our last write, lacks our key (deleted or overwritten by someone else).
        """
        period = reg.ttl / 3
        backoff = _Backoff(cap=min(2.0, period))
        node_id = reg.member.node_id
        while True:
            try:
                if reg.lease_id != 0:
                    reply = await self._call(self._client.refresh_lease(reg.lease_id))
                    if reply is None or reply.TTL <= 0:  # etcd answers TTL 0 for a gone lease
                        log.warning("lease of %s expired; registering again", node_id)
                        reg.lease_id = 0
                shown = self._entries.get(node_id, (None, 0))[1] == reg.lease_id
                if reg.lease_id == 0 or (self._seen_revision >= reg.revision and not shown):
                    async with self._reg_lock:
                        await self._publish(reg)
                    log.info("%s registered again", node_id)
                if backoff.reset():
                    log.info("lease keepalive for %s is back", node_id)
                await asyncio.sleep(period)
            except MembershipUnavailable as e:
                log.log(backoff.log_level, "lease keepalive for %s: %s; retrying", node_id, e)
                await asyncio.sleep(backoff.delay())
            except MembershipError as e:  # e.g. another live node took the id meanwhile
                level = logging.ERROR if backoff.failures == 0 else logging.DEBUG
                log.log(level, "cannot re-register %s: %s; retrying", node_id, e)
                backoff.delay()  # counted, so the error is logged once per episode
                await asyncio.sleep(period)

    async def _shutdown(self) -> None:
        try:
            await self._leave()
        except MembershipError as e:
            log.warning("leaving during close failed: %s", e)
        current = asyncio.current_task()
        tasks = [t for t in asyncio.all_tasks() if t is not current]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._client.close()
        await asyncio.get_running_loop().shutdown_asyncgens()


__all__ = ["EtcdMembership"]
