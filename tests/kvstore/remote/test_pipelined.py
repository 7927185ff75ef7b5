"""Pipelined puts and gets on a real 3-node cluster (etcd + node processes): a batch that
spans several masters reaches every one of them before the client reads any reply, over
streams and over the nodes' shared memory."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator

import pytest

from kvstore.client import Client
from kvstore.core.checks import check_key
from kvstore.core.errors import BufferTooSmall, Unavailable
from kvstore.protocol import native_channel
from kvstore.remote.channel_client import ChannelConnection
from kvstore.remote.node_client import NodeClient, PutBatch
from kvstore.remote.pipelined import (
    PIPELINED_STREAM_GET_BYTES,
    PendingShmPut,
    start_get,
    start_put,
)
from replication.local_cluster import LocalCluster

NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--replicas", "2"]
KEYS = [i.to_bytes(16, "big") for i in range(1, 49)]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path_factory.mktemp("pipelined") / "cluster", 3,
                        node_args=NODE_ARGS)
    try:
        yield c
    finally:
        c.down(timeout=10)


def _holds_all(cluster: LocalCluster, parts: dict[str, list[bytes]]) -> bool:
    """True once every node holds every key of its part (asked over gRPC, not the
    channel the put is on)."""
    for addr, keys in parts.items():
        with NodeClient(addr, transport="grpc") as n:
            if not all(n.exists(keys)):
                return False
    return True


@pytest.mark.slow
@pytest.mark.parametrize("replicas", [1, 2])
def test_every_master_holds_its_part_before_any_reply_is_read(
        cluster: LocalCluster, replicas: int, monkeypatch: pytest.MonkeyPatch) -> None:
    tag = replicas.to_bytes(1, "big")
    keys = [tag + k[1:] for k in KEYS]
    values = [os.urandom(4096) for _ in keys]
    parts: dict[str, list[bytes]] = {}
    order: list[str] = []
    reply = ChannelConnection.put_reply

    def recorded(conn: ChannelConnection, count: int, *, replicated: bool = False
                 ) -> tuple[list[bool], int, str]:
        if not order:
            # The barrier: the first reply is read only once every master holds its part.
            # A client that read a master's reply before sending the next master its part
            # would wait here for a part it has not sent, and the deadline would fail it.
            deadline = time.monotonic() + 20
            while not _holds_all(cluster, parts):
                assert time.monotonic() < deadline, "a master lacked its part before a reply"
                time.sleep(0.05)
        order.append(f"{conn.session.tcp_host}:{conn.session.tcp_port}")
        return reply(conn, count, replicated=replicated)

    monkeypatch.setattr(ChannelConnection, "put_reply", recorded)
    with Client(etcd=cluster.etcd, replicas=replicas, write_quorum=replicas,
                transport="tcp") as c:
        view = c._current()
        for k in keys:
            master = view.by_id[view.candidates(check_key(k))[0][0]].addr
            parts.setdefault(master, []).append(k)
        assert len(parts) == 3  # the batch spans every master
        assert c.put_batch(keys, values) == [True] * len(keys)
        assert len(order) == 3  # one pipelined reply per master, read after the barrier
        assert c.get_batch(keys) == values
        for k in keys:
            assert c.remove(k)


def test_start_put_does_not_pipeline_a_grpc_client(cluster: LocalCluster) -> None:
    addr = cluster.nodes[0].addr
    with NodeClient(addr, transport="grpc") as n:
        batch = PutBatch.check([KEYS[0]], [b"v"], parents=None, pin=False, retain_s=None)
        assert start_put(n, batch) is None
        assert n.put_checked(batch) == [True]
        assert n.remove(KEYS[0])


def test_a_pipelined_put_answers_what_the_node_stored(cluster: LocalCluster) -> None:
    addr = cluster.nodes[1].addr
    with NodeClient(addr, transport="tcp") as n:
        batch = PutBatch.check(KEYS[:3], [b"a", b"b", b"c"], parents=None, pin=False,
                               retain_s=None)
        first = start_put(n, batch)
        assert first is not None
        assert first.finish() == ([True] * 3, 1, [])
        again = start_put(n, batch)
        assert again is not None
        assert again.finish() == ([False] * 3, 1, [])  # stored already: an idempotent no-op
        with pytest.raises(RuntimeError):
            again.finish()
        assert n.get_batch(KEYS[:3]) == [b"a", b"b", b"c"]
        assert [n.remove(k) for k in KEYS[:3]] == [True] * 3


# ---- same host: gets and puts through the nodes' shared memory ---------------------------

BIG = 24 << 10  # three values pass SHM_PUT_MIN_BYTES: a put reserves, fills and commits


def _shm_client(cluster: LocalCluster, i: int, transport: str = "shm") -> NodeClient:
    n = NodeClient(cluster.nodes[i].addr, transport=transport)
    n.put_batch([b"\xee" * 16], [b"x"])  # connects: the channel is negotiated
    assert n.maps_node_memory == (transport == "shm")
    return n


def _record_calls(monkeypatch: pytest.MonkeyPatch, *names: str) -> list[tuple[str, int]]:
    """Each call of the ``ChannelConnection`` methods ``names``, in order: (its name, its
    session, standing for the node), the real method run."""
    events: list[tuple[str, int]] = []

    def recorded(name: str) -> object:
        original = getattr(ChannelConnection, name)

        def call(conn: ChannelConnection, *args: object, **kwargs: object) -> object:
            events.append((name, id(conn.session)))
            return original(conn, *args, **kwargs)
        return call

    for name in names:
        monkeypatch.setattr(ChannelConnection, name, recorded(name))
    return events


@pytest.mark.slow
def test_a_same_host_batch_asks_every_node_before_reading_any_answer(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """The exact order of a batch spanning three nodes: every RESERVE sent, then every
    node's room filled and COMMIT sent, then every COMMIT answered; a get likewise sends
    every LEASE before it reads any answer. The values read back equal."""
    keys = [b"\x5a" + k[1:] for k in KEYS]
    values = [os.urandom(BIG) for _ in keys]
    events = _record_calls(monkeypatch, "send_reserve", "fill_and_commit", "commit_reply",
                           "send_get", "get_reply")
    with Client(etcd=cluster.etcd, replicas=1, transport="auto") as c:
        c.put_batch([b"\xef" * 16], [b"x"])  # resolves every node's channel (shared memory)
        c.put_batch([b"\xef" * 15 + bytes([i]) for i in range(1, 40)], [b"x"] * 39)
        assert all(c._client(c._current(), n).maps_node_memory for n in c._current().by_id)
        events.clear()
        assert c.put_batch(keys, values) == [True] * len(keys)
        steps = [name for name, _ in events]
        assert steps == ["send_reserve"] * 3 + ["fill_and_commit"] * 3 + ["commit_reply"] * 3
        assert len({node for _, node in events}) == 3  # the batch spans every node
        events.clear()
        bufs = [bytearray(BIG) for _ in keys]
        assert c.get_batch_into(keys, bufs) == [BIG] * len(keys)
        assert [bytes(b) for b in bufs] == values
        assert [name for name, _ in events] == ["send_get"] * 3 + ["get_reply"] * 3
        events.clear()
        assert c.get_batch([*keys, b"\x5b" * 16]) == [*values, None]
        # the miss is asked of its next candidate too, in a round of its own
        assert [name for name, _ in events] == (["send_get"] * 3 + ["get_reply"] * 3
                                                + ["send_get", "get_reply"])
        for k in keys:
            assert c.remove(k)


def test_a_stream_get_asks_every_node_before_reading_any_answer(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    """Over TCP: every node is sent its GET, then every answer is read, in one thread."""
    keys = [b"\x5b" + k[1:] for k in KEYS]
    values = [os.urandom(BIG) for _ in keys]
    events = _record_calls(monkeypatch, "send_get", "get_reply")
    with Client(etcd=cluster.etcd, replicas=1, transport="tcp") as c:
        assert c.put_batch(keys, values) == [True] * len(keys)
        bufs = [bytearray(BIG) for _ in keys]
        assert c.get_batch_into(keys, bufs) == [BIG] * len(keys)
        assert [bytes(b) for b in bufs] == values
        assert [name for name, _ in events] == ["send_get"] * 3 + ["get_reply"] * 3
        assert len({node for _, node in events}) == 3
        for k in keys:
            assert c.remove(k)


def test_a_pipelined_same_host_put_answers_what_the_node_stored(cluster: LocalCluster) -> None:
    keys = [b"\x5c" + k[1:] for k in KEYS[:3]]
    values = [os.urandom(BIG) for _ in keys]
    with _shm_client(cluster, 2) as n:
        batch = PutBatch.check(keys, values, parents=None, pin=False, retain_s=None)
        first = start_put(n, batch)
        assert isinstance(first, PendingShmPut)
        first.advance()
        assert first.finish() == ([True] * 3, 1, [])
        again = start_put(n, batch)
        assert again is not None
        assert again.finish() == ([False] * 3, 1, [])  # stored already: nothing reserved
        with pytest.raises(RuntimeError):
            again.finish()
        small = PutBatch.check(keys, [b"a", b"b", b"c"], parents=None, pin=False,
                               retain_s=None)
        assert start_put(n, small) is None  # under SHM_PUT_MIN_BYTES: the ordinary call
        assert n.get_batch(keys) == values
        assert [n.remove(k) for k in keys] == [True] * 3


def _break_after_reading(monkeypatch: pytest.MonkeyPatch, method: str) -> None:
    """The next ``ChannelConnection.<method>`` reads its answer, then the stream resets
    (ConnectionResetError), as a connection that breaks just then; later calls are real."""
    real = getattr(ChannelConnection, method)
    armed = [True]

    def read_then_reset(conn: ChannelConnection, *args: object, **kwargs: object) -> object:
        answer = real(conn, *args, **kwargs)
        if armed:
            armed.clear()
            raise ConnectionResetError("the stream broke")
        return answer

    monkeypatch.setattr(ChannelConnection, method, read_then_reset)


def test_a_same_host_put_whose_stream_breaks_is_unavailable_and_the_client_reconnects(
        cluster: LocalCluster, monkeypatch: pytest.MonkeyPatch) -> None:
    keys = [b"\x5d" + k[1:] for k in KEYS[:3]]
    values = [os.urandom(BIG) for _ in keys]
    with _shm_client(cluster, 0) as n:
        pending = start_put(n, PutBatch.check(keys, values, parents=None, pin=False,
                                              retain_s=None))
        assert isinstance(pending, PendingShmPut)
        _break_after_reading(monkeypatch, "_response")  # the RESERVE's answer, then a reset
        pending.advance()  # never raises: the error waits for finish
        with pytest.raises(Unavailable, match="transfer channel failed"):
            pending.finish()
        assert n.put_batch(keys, values) == [True] * 3  # the room was never committed
        assert n.get_batch(keys) == values
        assert [n.remove(k) for k in keys] == [True] * 3


@pytest.mark.parametrize(("transport", "path"), [("shm", "python"), ("tcp", "native"),
                                               ("tcp", "python")])
def test_a_pipelined_get_answers_as_the_ordinary_call(
        cluster: LocalCluster, transport: str, path: str,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Over shared memory and over a stream (the native helper's ``get_reply`` and the
    pure-Python path): hits, a miss, a buffer too small, a stream that broke."""
    monkeypatch.setenv(native_channel.ENV, "1" if path == "native" else "0")
    keys = [b"\x5e" + k[1:] for k in KEYS[:3]]
    values = [os.urandom(BIG) for _ in keys]
    with _shm_client(cluster, 1, transport) as n:
        assert n.put_batch(keys, values) == [True] * 3
        asked = [*keys, b"\x5f" * 16]
        pending = start_get(n, asked, None)
        if transport == "tcp":  # the answer's size unknown: a thread per node copies it
            assert pending is None
        else:
            assert pending is not None
            assert pending.finish() == [*values, None]
        bufs = [memoryview(bytearray(BIG)) for _ in asked]
        pending = start_get(n, asked, bufs)
        assert pending is not None
        assert pending.finish() == [BIG] * 3 + [None]
        assert [bytes(b) for b in bufs[:3]] == values
        small = [memoryview(bytearray(BIG - 1)) for _ in asked]
        pending = start_get(n, asked, small)
        assert pending is not None
        with pytest.raises(BufferTooSmall):
            pending.finish()
        # the leases were released and the stream is in step: the next call answers
        assert n.get_batch(keys) == values
        broken = start_get(n, keys, bufs[:3])
        assert broken is not None
        _break_after_reading(monkeypatch, "get_reply")
        assert broken.finish() is None  # the caller makes the ordinary call
        assert n.get_batch(keys) == values
        assert [n.remove(k) for k in keys] == [True] * 3


def test_start_get_does_not_pipeline_a_grpc_client_nor_a_large_stream_get(
        cluster: LocalCluster) -> None:
    with NodeClient(cluster.nodes[0].addr, transport="grpc") as n:
        assert start_get(n, KEYS[:2], None) is None
    with NodeClient(cluster.nodes[0].addr, transport="tcp") as n:
        half = PIPELINED_STREAM_GET_BYTES // 2
        fits = start_get(n, KEYS[:2], [memoryview(bytearray(half)) for _ in range(2)])
        assert fits is not None
        assert fits.finish() == n.get_batch_into(KEYS[:2], [bytearray(half)] * 2)
        assert start_get(n, KEYS[:2], [memoryview(bytearray(half + 1))] * 2) is None
