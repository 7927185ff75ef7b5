"""KV events for routers outside kvstore: a ZeroMQ publisher in vLLM's wire format.

``kvstore serve --kv-events-endpoint tcp://HOST:PORT`` starts one ``KVEventPublisher``:

* The TierManager tells an observer (``_Enqueue``) of every index change, under the node's
  lock and in index order: a commit is ``BlockStored``; an unlink (remove, eviction, a
  block found corrupt) is ``BlockRemoved``; a move between tiers is ``BlockStored`` on the
  new medium *then* ``BlockRemoved`` from the old one, so a consumer applying events one
  by one never believes a held block is gone. The observer only appends to a bounded queue:
  a put never waits for the network.
* One thread owns the sockets: every ``flush_interval_s`` (5 ms) it drains the queue into
  batches (up to ``max_batch`` events each) and sends each on the PUB socket as
  ``(topic, seq, payload)``. PUB drops
  messages for a subscriber past its high-water mark rather than block.
* Sequence numbers count batches, one apart. The first one of a node process is its start
  time in microseconds since the epoch, so a restart shows up as a jump: vLLM's
  subscribers see a gap and ask the replay endpoint from their last seq + 1.
* The first batch of a process is a *resync*: ``AllBlocksCleared`` then one
  ``BlockStored`` per block the node holds (what the SSD tier recovered). When the queue
  overflows, the events are dropped and the next batch is a resync too.
* The replay endpoint (ROUTER, vLLM's protocol: a request is ``(b"", start_seq)``, 8 bytes
  big-endian; the reply is the messages then ``(b"", END_SEQ, b"")``) answers from the
  last ``buffer_batches`` batches when they hold every batch from ``start_seq`` on, and
  otherwise (too old, from another process of the node, or ``SNAPSHOT_SEQ``) with a
  snapshot: one batch, tagged with the seq of the last batch published before it, of
  ``AllBlocksCleared`` and one ``BlockStored`` per block. Events the snapshot includes are
  published first, so the snapshot is exactly the state after that seq.
* Who may connect: the sockets bind a loopback address, an ``ipc://`` path, or any other
  address only with CURVE keys (``secret_key`` and ``client_keys``, files of
  ``kvstore.auth.curve``) or ``insecure``, the rule the node's gRPC port follows for TLS
  (``tcp://*:PORT``, every interface, is not loopback). With keys both sockets are CURVE
  servers: traffic is encrypted, and pyzmq's ZAP handler (a thread on the publisher's
  context) admits only the listed client public keys; any other connection fails its
  handshake and receives nothing.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kvstore.auth.curve import KeyPair, load_keypair, load_public_keys
from kvstore.auth.security import is_loopback
from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey
from kvstore.protocol.kv_event_wire import (
    END_SEQ,
    Cleared,
    Event,
    Stored,
    encoder,
    medium_of,
    seq_bytes,
)

if TYPE_CHECKING:
    from kvstore.node.semantics import Node

log = logging.getLogger("kvstore.node.kv_events")


@dataclass(slots=True, kw_only=True)
class KVEventSettings:
    endpoint: str  # PUB socket, bound: tcp://HOST:PORT (port 0: any free port)
    replay_endpoint: str = ""  # ROUTER socket, bound; "": no replay
    topic: str = ""
    int_hashes: bool = False  # hashes as 64-bit ints (vLLM's VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    max_queue: int = 100_000  # events waiting for the thread; past it: dropped, then a resync
    max_batch: int = 1_000  # events per live batch
    flush_interval_s: float = 0.005  # the longest an event waits for its batch
    buffer_batches: int = 10_000  # batches kept for replay
    hwm: int = 100_000  # PUB high-water mark (messages per subscriber)
    secret_key: str = ""  # CURVE: this node's .key_secret file; "": no CURVE
    client_keys: str = ""  # CURVE: the admitted clients' public .key file, or a directory
    insecure: bool = False  # allow a non-loopback bind without CURVE keys


def check_exposure(endpoint: str, *, keyed: bool, insecure: bool) -> None:
    """Raises InvalidArgument for a bind beyond this host's loopback (``tcp://*``, another
    interface) without CURVE keys, unless ``insecure``."""
    if keyed or insecure or endpoint.startswith("ipc://"):
        return
    host = endpoint.removeprefix("tcp://").rpartition(":")[0]
    if not is_loopback(host):
        raise InvalidArgument(
            f"refusing to serve KV events on {endpoint} without authentication: bind a "
            f"loopback address, give --kv-events-secret-key and --kv-events-client-keys "
            f"(CURVE), or --insecure to accept anyone who can connect")


class _KeyGate:
    """The ZAP credentials provider: admits the listed client public keys (Z85). pyzmq's
    authenticator thread calls it once per connection handshake; it alone writes
    ``denied``. Each refused key is logged once (up to ``_TOLD`` keys): a refused
    subscriber reconnects every 100 ms."""

    _TOLD = 1_000

    def __init__(self, allowed: frozenset[bytes]) -> None:
        self._allowed = allowed
        self._told: set[bytes] = set()
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self._allowed:
            return True
        self.denied += 1
        if key not in self._told and len(self._told) < self._TOLD:
            self._told.add(key)
            log.warning("KV events: refused a connection with an unknown CURVE client key "
                        "%s (not in --kv-events-client-keys)", key.decode())
        return False


Item = tuple[BlockKey, BlockKey | None, str] | tuple[BlockKey, str]
"""A queued index change: (key, parent, medium) stored, or (key, medium) removed: plain
tuples of the shapes of ``Stored`` and ``Removed`` (the observer runs under the node's
lock on every put)."""


class _Enqueue:
    """The TierObserver: appends index changes to a bounded deque. Called under the
    node's lock only, which also guards ``lost`` (the thread pops without it: deque
    appends and pops are atomic). It wakes nobody: the thread polls every
    ``flush_interval_s``, since waking it per put hands the GIL back and forth between
    the putting thread and the publisher (measured: ~40% fewer puts/s over the channel)."""

    __slots__ = ("_limit", "_media", "_q", "lost")

    def __init__(self, q: deque[Item], limit: int, media: Sequence[str]) -> None:
        self._q = q
        self._media = list(media)
        self._limit = limit
        self.lost = False

    def _put(self, item: Item) -> None:
        if self.lost:
            return  # a resync replaces everything after the first lost event
        if len(self._q) >= self._limit:
            self.lost = True
            return
        self._q.append(item)

    def stored(self, key: BlockKey, parent: BlockKey | None, level: int) -> None:
        self._put((key, parent, self._media[level]))

    def removed(self, key: BlockKey, level: int) -> None:
        self._put((key, self._media[level]))

    def moved(self, key: BlockKey, parent: BlockKey | None, src: int, dst: int) -> None:
        self._put((key, parent, self._media[dst]))
        self._put((key, self._media[src]))


class KVEventPublisher:
    """Publishes a node's index changes; ``close()`` before the node closes."""

    def __init__(self, node: Node, settings: KVEventSettings, *,
                 clock: Callable[[], float] = time.time) -> None:
        import zmq

        self._node = node
        self._s = settings
        self._topic = settings.topic.encode()
        self._encode = encoder(int_hashes=settings.int_hashes, clock=clock)
        if bool(settings.secret_key) != bool(settings.client_keys):
            raise InvalidArgument("KV events over CURVE need both a secret key file "
                                  "(--kv-events-secret-key) and client public keys "
                                  "(--kv-events-client-keys)")
        keyed = bool(settings.secret_key)
        for ep in (settings.endpoint, settings.replay_endpoint):
            if ep:
                check_exposure(ep, keyed=keyed, insecure=settings.insecure)
        pair = load_keypair(settings.secret_key) if keyed else None
        self._gate = _KeyGate(load_public_keys(settings.client_keys)) if keyed else None
        self._ctx = zmq.Context()
        self._auth: Any = None
        self._replay: Any = None
        try:
            if self._gate is not None:
                from zmq.auth.thread import ThreadAuthenticator

                # Started before any bind: a CURVE handshake with no ZAP handler present
                # admits every client.
                self._auth = ThreadAuthenticator(self._ctx, log=log.getChild("zap"))
                self._auth.start()
                self._auth.configure_curve_callback("*", self._gate)
            self._pub = self._ctx.socket(zmq.PUB)
            self._pub.set_hwm(settings.hwm)
            self._pub.setsockopt(zmq.LINGER, 0)
            _curve_server(self._pub, pair)
            self.endpoint = _bind(self._pub, settings.endpoint)
            self.replay_endpoint = ""
            if settings.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                # A ROUTER drops what passes its high-water mark: room for a whole replay.
                self._replay.set_hwm(settings.buffer_batches + 2)
                _curve_server(self._replay, pair)
                self.replay_endpoint = _bind(self._replay, settings.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"cannot bind KV events endpoint: {exc}") from None
        except BaseException:
            self._close_sockets()
            raise
        self._next_seq = int(clock() * 1_000_000)
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=settings.buffer_batches)
        self._q: deque[Item] = deque()
        self._media = [medium_of(name) for name in node.stats()["tiers"]]
        self._observer = _Enqueue(self._q, settings.max_queue, self._media)
        self._stop = threading.Event()
        self.ready = threading.Event()  # set once the first batch (the resync) is out
        self.resyncs = 0  # batches that restated every block (the first one included)
        node.add_stat_source(self._stats)
        node.observe(self._observer)
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()

    # ---- the publisher thread ------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._resync()
            self.ready.set()
            while not self._stop.is_set():
                if self._replay is not None and self._replay.poll(0):
                    self._serve_replay()
                q = self._q
                if len(q) < self._s.max_batch:
                    # Events wait up to this long to share a batch (as a replay request does).
                    self._stop.wait(self._s.flush_interval_s)
                items: list[Item] = []
                while q and len(items) < self._s.max_batch:
                    items.append(q.popleft())
                if items:
                    self._send(items)
                if self._observer.lost:  # read without the lock: at worst one loop late
                    self._resync()
        except Exception:  # the node keeps serving; routers see silence (and a gap)
            log.exception("KV event publisher stopped")

    def _take_pending(self) -> tuple[list[Item], bool]:
        """Runs under the node's lock: the queued changes and whether any were lost."""
        pending = list(self._q)
        self._q.clear()
        lost, self._observer.lost = self._observer.lost, False
        return pending, lost

    def _state(self) -> tuple[list[Event], list[Item], bool]:
        """The node's blocks as a resync (Cleared + Stored each), what was queued before,
        and whether events were lost; one consistent cut of the index."""
        blocks, (pending, lost) = self._node.index_snapshot(self._take_pending)
        media = self._media
        resync: list[Event] = [Cleared()]
        resync += [Stored(k, p, media[level]) for k, p, level in parents_first(blocks)]
        return resync, pending, lost

    def _resync(self) -> None:
        resync, _, _ = self._state()  # what was queued is in the snapshot already
        self._send(resync)
        self.resyncs += 1

    def _stats(self) -> dict[str, object]:
        # Read from other threads without a lock: ints, each at worst one batch old. The
        # endpoints (as bound: the port chosen for port 0) let a router find the events
        # from the node's address alone (the Conductor's durability wait does).
        return {"kv_events_seq": self._next_seq - 1, "kv_events_resyncs": self.resyncs,
                "kv_events_endpoint": self.endpoint,
                "kv_events_replay_endpoint": self.replay_endpoint,
                "kv_events_denied": 0 if self._gate is None else self._gate.denied}

    def _send(self, events: Sequence[Event | Item]) -> None:
        seq = self._next_seq
        self._next_seq += 1
        payload = self._encode(events)
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload), copy=False)
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("malformed KV event replay request (%d frames): want an empty "
                        "frame and an 8-byte big-endian start seq", len(frames))
            if len(frames) >= 2:
                self._replay.send_multipart((frames[0], b"", b"", END_SEQ, b""))
            return
        client, _, raw = frames
        start = int.from_bytes(raw, "big")
        if self._buffer and self._buffer[0][0] <= start <= self._next_seq:
            for seq, payload in self._buffer:
                if seq >= start:
                    self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq),
                                                 payload), copy=False)
        else:
            resync, pending, lost = self._state()
            if lost:
                self._send(resync)  # the live stream needs it as much as this client
                self.resyncs += 1
            else:
                for i in range(0, len(pending), self._s.max_batch):
                    self._send(pending[i:i + self._s.max_batch])
            seq = self._next_seq - 1
            payload = self._buffer[-1][1] if lost else self._encode(resync)
            self._replay.send_multipart((client, b"", self._topic, seq_bytes(seq), payload),
                                        copy=False)
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    # ---- lifecycle -----------------------------------------------------------------------

    def close(self) -> None:
        self._node.observe(None)
        self._stop.set()
        self._thread.join(timeout=5.0)
        self._close_sockets()

    def _close_sockets(self) -> None:
        if self._auth is not None:
            self._auth.stop()
        self._ctx.destroy(linger=0)


def _curve_server(sock: Any, pair: KeyPair | None) -> None:
    """Makes ``sock`` a CURVE server with ``pair`` (before it binds); None: left open."""
    import zmq

    if pair is not None:
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, pair.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, pair.secret)


def _bind(sock: Any, endpoint: str) -> str:
    """Binds ``endpoint``; returns it with the port the OS chose for port 0."""
    import zmq

    sock.bind(endpoint)
    return sock.getsockopt(zmq.LAST_ENDPOINT).decode()


def parents_first(blocks: Sequence[tuple[BlockKey, BlockKey | None, int]]
                  ) -> list[tuple[BlockKey, BlockKey | None, int]]:
    """``blocks`` (key, parent, level) with every block after its parent when the parent is
    among them: a subscriber applying a snapshot in order always knows a block's parent
    first. Ordered by depth in its chain, then as given (the index's slot order, which says
    nothing of when a block came)."""
    parent_of = {k: p for k, p, _ in blocks}
    depth: dict[BlockKey, int] = {}
    for k, _, _ in blocks:
        chain: list[BlockKey] = []
        seen: set[BlockKey] = set()  # a cycle cannot loop (keys are hashes: none in practice)
        at: BlockKey | None = k
        while at is not None and at in parent_of and at not in depth and at not in seen:
            chain.append(at)
            seen.add(at)
            at = parent_of[at]
        d = depth.get(at, -1) + 1 if at is not None else 0
        for c in reversed(chain):
            depth[c] = d
            d += 1
    return sorted(blocks, key=lambda b: depth[b[0]])
