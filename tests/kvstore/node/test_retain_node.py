"""``retain`` of blocks already stored, over gRPC with a real node server: retain and
release, the node's cap and a tenant's quota share, tenants' salted keys, bad input as a
gRPC status, and an older client's calls unchanged.

The node runs in process with an injected clock (as tests/kvstore/node/test_retention_node.py
does), so expiry is exact: DRAM holds 16 blocks, LRU, and a retained block survives pressure.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import ServedNode, write_auth_file

from kvstore import Client, InvalidArgument, RetainOutcome
from kvstore.auth.security import TenantRegistry
from kvstore.core.retention import MAX_RETAIN_KEYS, MAX_RETAIN_S
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

BLOCK = 64 << 10
SLOTS = 16
R, D, REL, M = (RetainOutcome.RETAINED, RetainOutcome.DENIED, RetainOutcome.RELEASED,
                RetainOutcome.MISSING)




def serve(*, fraction: float = 0.5, auth: TenantRegistry | None = None) -> ServedNode:
    """A served node of SLOTS blocks of BLOCK bytes (``max_retained_fraction=fraction``)."""
    return ServedNode(dram_bytes=SLOTS * BLOCK, max_retained_fraction=fraction, auth=auth)


@pytest.fixture
def served() -> Iterator[ServedNode]:
    s = serve()
    yield s
    s.close()


def fill(c: Client, n: int) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for k in keys:
        assert c.put(k, os.urandom(BLOCK)) is True
    return keys


def test_retained_blocks_survive_pressure_until_released(served: ServedNode) -> None:
    with Client(served.addr, transport="grpc") as c:
        turn = fill(c, 4)
        stray = os.urandom(16)
        assert c.retain([*turn, stray], 60) == [R, R, R, R, M]
        st = c.stats()["node"]
        assert (st["retained_blocks"], st["retained_bytes"]) == (4, 4 * BLOCK)
        fill(c, 2 * SLOTS)  # twice the tier: every ordinary block before goes
        assert c.exists(turn) == [True] * 4
        served.clock.now += 30
        assert c.retain(turn[:2], 60) == [R, R]  # refreshed: 60 s from now
        served.clock.now += 45  # turn[2:] expired at 60 s; turn[:2] are kept to 90 s
        assert c.stats()["node"]["retained_blocks"] == 2
        assert c.retain([turn[0], stray], 0) == [REL, M]
        assert c.stats()["node"]["retained_blocks"] == 1
        fill(c, SLOTS)
        assert c.exists(turn) == [False, True, False, False]
        assert c.retain(turn, 0) == [M, REL, M, M]
        assert c.stats()["node"]["retained_blocks"] == 0


def test_over_the_node_cap_a_block_is_denied_and_stays_ordinary() -> None:
    served = serve(fraction=2 / SLOTS)  # room for two retained blocks
    try:
        with Client(served.addr, transport="tcp") as c:
            ks = fill(c, 3)
            assert c.retain(ks, 10) == [R, R, D]
            st = c.stats()["node"]
            assert (st["retained_blocks"], st["retention_denied"]) == (2, 1)
            assert c.retain(ks[:1], 0) == [REL]
            assert c.retain(ks[2:], 10) == [R]  # the release made room under the cap
    finally:
        served.close()


def test_tenants_retain_only_their_own_blocks_within_their_quota_share(tmp_path: Path
                                                                        ) -> None:
    auth = TenantRegistry.load(write_auth_file(
        tmp_path / "auth.toml", {"a": "token-of-tenant-a", "b": "token-of-tenant-b"},
        cluster="token-of-the-cluster", quotas={"a": 4 * BLOCK}))
    served = serve(fraction=0.5, auth=auth)  # tenant a: 2 blocks retained at most
    try:
        with Client(served.addr, transport="grpc", token="token-of-tenant-a") as a, \
                Client(served.addr, transport="grpc", token="token-of-tenant-b") as b, \
                Client(served.addr, transport="grpc", token="token-of-the-cluster") as op:
            ka = fill(a, 3)
            assert b.retain(ka, 30) == [M, M, M]  # salted: b cannot name a's blocks
            assert a.retain(ka, 30) == [R, R, D]
            assert b.retain(ka, 0) == [M, M, M]  # nor release them
            st = op.stats()["node"]
            assert st["namespace_retained_bytes"] == {"a": 2 * BLOCK}
            assert st["retention_denied"] == 1
            assert a.retain(ka, 0) == [REL] * 3
            assert "namespace_retained_bytes" not in op.stats()["node"]
    finally:
        served.close()


def test_bad_input_is_refused_by_the_client_before_sending(served: ServedNode) -> None:
    with Client(served.addr, transport="grpc") as c:
        k = fill(c, 1)
        for bad in (-1.0, math.inf, math.nan, MAX_RETAIN_S + 1):
            with pytest.raises(InvalidArgument, match="retain_s"):
                c.retain(k, bad)
        with pytest.raises(InvalidArgument, match=f"at most {MAX_RETAIN_KEYS} keys"):
            c.retain(k * (MAX_RETAIN_KEYS + 1), 5)
        assert c.stats()["node"]["retained_blocks"] == 0


def test_the_node_answers_bad_requests_with_invalid_argument(served: ServedNode) -> None:
    with grpc.insecure_channel(served.addr) as ch:
        stub = pb_grpc.KVStoreStub(ch)
        good = os.urandom(16)
        assert stub.Put(pb.PutRequest(key=good, value=b"v")).stored  # an older client's put
        for request, words in (
            (pb.RetainRequest(keys=[good], retain_s=-1), "retain_s"),
            (pb.RetainRequest(keys=[good], retain_s=math.nan), "retain_s"),
            (pb.RetainRequest(keys=[good], retain_s=MAX_RETAIN_S * 2), "retain_s"),
            (pb.RetainRequest(keys=[good] * (MAX_RETAIN_KEYS + 1), retain_s=5),
             f"at most {MAX_RETAIN_KEYS} keys per retain"),
            (pb.RetainRequest(keys=[b"short"], retain_s=5), "key"),
        ):
            with pytest.raises(grpc.RpcError) as info:
                stub.Retain(request)
            assert info.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            assert words in info.value.details()
        assert served.node.stats()["node"]["retained_blocks"] == 0
        reply = stub.Retain(pb.RetainRequest(keys=[good, good], retain_s=5))
        assert list(reply.outcomes) == ["retained", "retained"]


def test_node_retain_in_process_bounds_its_keys(served: ServedNode) -> None:
    with pytest.raises(InvalidArgument, match="at most"):
        served.node.retain([os.urandom(16)] * (MAX_RETAIN_KEYS + 1), 5)
    with pytest.raises(InvalidArgument, match="retain_s"):
        served.node.retain([os.urandom(16)], -2)
