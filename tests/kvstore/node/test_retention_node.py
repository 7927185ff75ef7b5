"""retain_s end to end: every transport, caps, tenant quotas, stat, metrics, replication copies.

The node runs in process with an injected clock, so expiry is exact: a retained block
survives eviction pressure until the clock passes its deadline, then leaves in LRU order.
"""

from __future__ import annotations

import math
import os
import socket
import struct
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import TRANSPORTS, ManualClock, ServedNode, wait_until, write_auth_file

from kvstore import Client, InvalidArgument
from kvstore.auth.security import TenantRegistry
from kvstore.core.retention import MAX_RETAIN_S
from kvstore.node.metrics import NodeMetrics
from kvstore.node.semantics import Node, NodeSettings
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import wire
from replication.copies.replicator import push_blocks

KiB = 1 << 10
BLOCK = 64 * KiB  # at SHM_PUT_MIN_BYTES: a shared-memory client puts by RESERVE + COMMIT
SLOTS = 16  # the DRAM tier holds 16 blocks




def key() -> bytes:
    return os.urandom(16)


def serve(*, fraction: float = 0.5, auth: TenantRegistry | None = None) -> ServedNode:
    """A served node of SLOTS blocks of BLOCK bytes (``max_retained_fraction=fraction``)."""
    return ServedNode(dram_bytes=SLOTS * BLOCK, max_retained_fraction=fraction, auth=auth)


@pytest.fixture
def served() -> Iterator[ServedNode]:
    s = serve()
    yield s
    s.close()


@pytest.fixture(params=TRANSPORTS)
def transport(request: pytest.FixtureRequest) -> str:
    return request.param


def fill(c: Client, n: int) -> list[bytes]:
    keys = [key() for _ in range(n)]
    for k in keys:
        assert c.put(k, os.urandom(BLOCK)) is True
    return keys


def node_stats(c: Client) -> dict:
    return c.stats()["node"]


def test_retained_block_survives_pressure_until_the_clock_passes(served: ServedNode,
                                                                  transport: str) -> None:
    with Client(served.addr, transport=transport, timeout=30) as c:
        assert c.transport == transport
        kept, value = key(), os.urandom(BLOCK)
        assert c.put(kept, value, retain_s=60) is True
        st = node_stats(c)
        assert (st["retained_blocks"], st["retained_bytes"]) == (1, BLOCK)
        assert st["retained_cap_bytes"] == SLOTS * BLOCK // 2
        first = fill(c, 2 * SLOTS)  # twice the tier: every unretained early block goes
        assert c.exists([kept]) == [True]
        assert c.exists(first[:SLOTS]) == [False] * SLOTS
        served.clock.now += 59.999
        fill(c, SLOTS)
        assert c.get(kept) == value  # a read: kept 60 s from now again
        served.clock.now += 59.999
        fill(c, SLOTS)
        assert c.exists([kept]) == [True]
        served.clock.now += 0.001  # 60 s after the read: ordinary, and the LRU block
        assert node_stats(c)["retained_blocks"] == 0
        assert c.put(key(), os.urandom(BLOCK)) is True
        assert c.exists([kept]) == [False]


def test_put_batch_retains_each_block_and_a_later_put_refreshes(served: ServedNode,
                                                                transport: str) -> None:
    with Client(served.addr, transport=transport, timeout=30) as c:
        ks = [key() for _ in range(3)]
        assert c.put_batch(ks, [os.urandom(BLOCK) for _ in ks], retain_s=10) == [True] * 3
        assert node_stats(c)["retained_blocks"] == 3
        served.clock.now += 5
        assert c.put(ks[0], os.urandom(BLOCK), retain_s=10) is False  # stored: refreshed
        served.clock.now += 5
        st = node_stats(c)
        assert (st["retained_blocks"], st["retained_bytes"]) == (1, BLOCK)


@pytest.mark.parametrize("bad", [-1.0, math.inf, math.nan, MAX_RETAIN_S + 1])
def test_bad_retain_s_is_refused_before_sending(served: ServedNode, transport: str,
                                                bad: float) -> None:
    with Client(served.addr, transport=transport, timeout=30) as c:
        k = key()
        with pytest.raises(InvalidArgument, match="retain_s"):
            c.put(k, b"x" * 100, retain_s=bad)
        with pytest.raises(InvalidArgument, match="retain_s"):
            c.put_batch([k], [b"x" * 100], retain_s=bad)
        assert c.exists([k]) == [False]


def test_the_node_refuses_bad_retain_s_on_grpc(served: ServedNode) -> None:
    with grpc.insecure_channel(served.addr) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        good, bad = key(), key()
        for call, request in (
            (stub.Put, pb.PutRequest(key=bad, value=b"v", retain_s=MAX_RETAIN_S * 2)),
            (stub.Put, pb.PutRequest(key=bad, value=b"v", retain_s=-0.5)),
            (stub.BatchPut, pb.BatchPutRequest(items=[
                pb.PutRequest(key=good, value=b"v", retain_s=5),
                pb.PutRequest(key=bad, value=b"v", retain_s=math.inf)])),
        ):
            with pytest.raises(grpc.RpcError) as info:
                call(request)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert "retain_s" in info.value.details()
        # The batch was refused whole: not even its good item was stored.
        assert stub.Exists(pb.ExistsRequest(keys=[good, bad])).exists == [False, False]
        assert stub.Put(pb.PutRequest(key=good, value=b"v")).stored  # an old client's put
    assert served.node.stats()["node"]["retained_blocks"] == 0


def _channel(served: ServedNode) -> socket.socket:
    with grpc.insecure_channel(served.addr) as ch:
        info = pb_grpc.KVStoreStub(ch).OpenChannel(pb.OpenChannelRequest(client_host_id=""))
    s = socket.create_connection((info.tcp_host or "127.0.0.1", info.tcp_port), timeout=10)
    s.sendall(wire.HELLO.pack(wire.MAGIC, info.token, wire.Mode.TCP))
    status, _ = wire.HELLO_REPLY.unpack(wire.recv_exact(s, wire.HELLO_REPLY.size))
    assert status == 0
    return s


def _call(s: socket.socket, op: wire.Op, count: int, meta: bytes, payload: bytes = b""
          ) -> tuple[int, bytes]:
    s.sendall(wire.header(op, count, len(meta)) + meta + payload)
    status, _, n = wire.HEADER.unpack(wire.recv_exact(s, wire.HEADER.size))
    return status, wire.recv_exact(s, n)


def test_channel_put_items_carry_retain_ms_in_their_padding(served: ServedNode) -> None:
    k1, k2, k3 = key(), key(), key()
    meta = wire.pack_put_items([k1], [100], [None], False, retain_s=1.5)
    assert len(meta) == wire.PUT_ITEM.size == 48
    assert struct.unpack_from("<I", meta, wire.RETAIN_AT) == (1500,)
    assert wire.item_retain_s(meta, 0, wire.PUT_ITEM.size) == 1.5
    old = wire.PUT_ITEM.pack(k2, bytes(16), 100, 0)  # as a writer before retain_s packs it
    assert wire.item_retain_s(old, 0, wire.PUT_ITEM.size) == 0.0
    assert wire.retain_ms(0.0001) == 1  # any positive ask keeps at least 1 ms
    s = _channel(served)
    try:
        assert _call(s, wire.Op.PUT, 2, meta + old, os.urandom(200)) == (0, b"\x01\x01")
        too_long = bytearray(wire.PUT_ITEM.pack(k3, bytes(16), 100, 0))
        struct.pack_into("<I", too_long, wire.RETAIN_AT, int(MAX_RETAIN_S * 1000) + 1)
        status, text = _call(s, wire.Op.PUT, 1, bytes(too_long), os.urandom(100))
        assert status == grpc.StatusCode.INVALID_ARGUMENT.value[0]
        assert "retain_s" in text.decode()
        assert _call(s, wire.Op.EXISTS, 1, k3) == (0, b"\x00")  # nothing stored; in frame
    finally:
        s.close()
    held = served.node._manager.retention.held
    assert set(held) == {k1} and held[k1].seconds == 1.5


def test_over_the_node_cap_a_put_is_stored_without_retention() -> None:
    served = serve(fraction=2 / SLOTS)  # room for two retained blocks
    try:
        with Client(served.addr, transport="tcp", timeout=30) as c:
            ks = [key() for _ in range(3)]
            assert c.put_batch(ks, [os.urandom(BLOCK) for _ in ks], retain_s=30) == [True] * 3
            st = node_stats(c)
            assert (st["retained_blocks"], st["retained_bytes"], st["retention_denied"],
                    st["retained_cap_bytes"]) == (2, 2 * BLOCK, 1, 2 * BLOCK)
            fill(c, 2 * SLOTS)
            assert c.exists(ks) == [True, True, False]  # the refused one was evicted
    finally:
        served.close()


def test_tenant_retention_is_capped_by_its_quota_and_seen_only_by_it(tmp_path: Path) -> None:
    auth = TenantRegistry.load(write_auth_file(
        tmp_path / "auth.toml", {"a": "token-of-tenant-a", "b": "token-of-tenant-b"},
        cluster="token-of-the-cluster", quotas={"a": 4 * BLOCK}))
    served = serve(fraction=0.5, auth=auth)  # tenant a: 2 blocks retained at most
    try:
        with Client(served.addr, transport="grpc", token="token-of-tenant-a") as a, \
                Client(served.addr, transport="tcp", token="token-of-tenant-b") as b, \
                Client(served.addr, transport="grpc", token="token-of-the-cluster") as op:
            assert a.put_batch([key() for _ in range(3)], [os.urandom(BLOCK)] * 3,
                               retain_s=30) == [True] * 3
            assert b.put_batch([key() for _ in range(3)], [os.urandom(BLOCK)] * 3,
                               retain_s=30) == [True] * 3  # no quota: the node cap only
            st = op.stats()["node"]
            assert st["namespace_retained_bytes"] == {"a": 2 * BLOCK, "b": 3 * BLOCK}
            assert (st["retained_blocks"], st["retention_denied"]) == (5, 1)
            mine = a.stats()["node"]
            assert mine["namespace_retained_bytes"] == {"a": 2 * BLOCK}
            assert "retained_bytes" not in mine  # the node-wide sums are not a tenant's
    finally:
        served.close()


def test_metrics_show_retained_blocks_and_bytes(served: ServedNode) -> None:
    with Client(served.addr, transport="grpc") as c:
        c.put(key(), os.urandom(BLOCK), retain_s=5)
        c.put(key(), os.urandom(BLOCK))
    text = NodeMetrics(served.node).render().decode()
    assert "kvstore_retained_blocks 1.0\n" in text
    assert f"kvstore_retained_bytes {float(BLOCK)}\n" in text
    assert f"kvstore_retained_cap_bytes {float(SLOTS * BLOCK // 2)}\n" in text
    assert "kvstore_retention_denied_total 0.0\n" in text
    served.clock.now += 5
    assert "kvstore_retained_blocks 0.0\n" in NodeMetrics(served.node).render().decode()


def test_copies_to_a_replica_carry_the_masters_retention(served: ServedNode) -> None:
    replica = serve()
    try:
        with Client(served.addr, transport="tcp") as c:
            kept, plain = key(), key()
            c.put(kept, os.urandom(BLOCK), retain_s=40)
            c.put(plain, os.urandom(BLOCK))
        served.clock.now += 10
        with Client(replica.addr, transport="tcp") as peer:
            assert push_blocks(served.node, lambda _owner: peer, [kept, plain]) == 2 * BLOCK
        held = replica.node._manager.retention.held
        assert set(held) == {kept} and held[kept].seconds == 40.0
        assert held[kept].until == replica.clock.now + 40
    finally:
        replica.close()


def test_with_an_ssd_tier_a_retained_block_is_demoted_not_dropped(tmp_path: Path) -> None:
    clock = ManualClock()
    node = Node(NodeSettings(dram_bytes=8 * BLOCK, prefault=False, ssd_io="python",
                             ssd_path=str(tmp_path / "ssd.img"), ssd_bytes=16 * BLOCK),
                clock=clock)
    try:
        kept, value = key(), os.urandom(BLOCK)
        assert node.put(kept, memoryview(value), retain_s=60)
        for _ in range(4 * 24):  # four times the node: the SSD drops many blocks
            assert node.put(key(), memoryview(os.urandom(BLOCK)))
        wait_until(lambda: node.locate([kept]) == ["ssd"], what="the retained block demoted")
        assert node.stats()["tiers"]["ssd"]["evictions"] > 0
        assert node.get(kept) == value  # a read (and the retention restarts)
        clock.now += 60
        for _ in range(4 * 24):
            assert node.put(key(), memoryview(os.urandom(BLOCK)))
        wait_until(lambda: node.exists([kept]) == [False], what="the expired block dropped")
        assert node.stats()["node"]["retained_blocks"] == 0
    finally:
        node.close()


# ---- across a restart (issue 25): the SSD tier keeps each deadline as wall-clock time -----------


def _ssd_node(tmp_path: Path, clock: ManualClock) -> Node:
    # The fake clock is both clocks: the monotonic one restarts with the node in truth, but
    # only the wall clock carries a deadline across, and that is what the test moves.
    return Node(NodeSettings(dram_bytes=8 * BLOCK, prefault=False, ssd_io="python",
                             ssd_path=str(tmp_path / "ssd.img"), ssd_bytes=16 * BLOCK),
                clock=clock, wall_clock=clock)


def _retained(node: Node) -> int:
    return node.stats()["node"]["retained_blocks"]


def test_a_retained_block_on_ssd_stays_retained_across_restarts_until_its_deadline(
        tmp_path: Path) -> None:
    clock = ManualClock()
    start = clock.now
    node = _ssd_node(tmp_path, clock)
    kept, short, value = key(), key(), os.urandom(BLOCK)
    try:
        assert node.put(kept, memoryview(value), retain_s=100)
        assert node.put(short, memoryview(os.urandom(BLOCK)), retain_s=30)
        for _ in range(12):  # past the DRAM tier: both go down to SSD
            assert node.put(key(), memoryview(os.urandom(BLOCK)))
        wait_until(lambda: node.locate([kept, short]) == ["ssd", "ssd"], what="both on SSD")
        clock.now += 50
        assert node.get(kept) == value  # a read on SSD: kept until start + 150 now
    finally:
        node.close()
    clock.now = start + 90  # down 40 s: short's deadline (start + 30) passed meanwhile
    node = _ssd_node(tmp_path, clock)
    try:
        assert node.locate([kept, short]) == ["ssd", "ssd"]
        assert _retained(node) == 1
        clock.now = start + 149.999
        assert _retained(node) == 1
        clock.now = start + 150
        assert _retained(node) == 0
    finally:
        node.close()
    node = _ssd_node(tmp_path, clock)  # and after it passed, a restart keeps nothing
    try:
        assert _retained(node) == 0 and node.exists([kept]) == [True]
    finally:
        node.close()

