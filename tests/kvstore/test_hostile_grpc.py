"""A hostile client against the gRPC API of a node with tenants, run under RLIMIT_AS.

Each test asserts a clear status, a node that keeps answering, and the blocks
stored before it intact and byte-exact (``intact`` runs after every test).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from conftest import REPO, NodeProcess, start_node, write_auth_file

from kvstore.auth.security import salt_key
from kvstore.client import Client
from kvstore.core.errors import (
    REASON_HEADER,
    REPLY_BOUND,
    InvalidArgument,
    PermissionDenied,
    ReplyTooLarge,
    ResourceExhausted,
)
from kvstore.core.logs import REQUEST_ID_HEADER
from kvstore.core.prefetch import MAX_PREFETCH_KEYS
from kvstore.node.semantics import MAX_BATCH
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.server import MAX_REPLY_VALUE_BYTES

MiB = 1 << 20
LIMIT_AS = 3 << 30  # the node's address space: a 192 GiB reply cannot be built in it
TOKENS = {"a": "hostile-tenant-a-0123456789", "b": "hostile-tenant-b-0123456789",
          "cluster": "hostile-cluster-0123456789"}
BIG = 4 * MiB
BIG_KEY = b"B" * 16
SMALL_KEY = b"s" * 16


def _value(seed: bytes, n: int) -> bytes:
    out = bytearray()
    while len(out) < n:
        out += hashlib.sha256(seed + len(out).to_bytes(8, "little")).digest()
    return bytes(out[:n])


BIG_VALUE = _value(b"big", BIG)
SMALL_VALUE = _value(b"small", 1000)


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    tmp = tmp_path_factory.mktemp("hostile-grpc")
    auth = write_auth_file(tmp / "tenants.toml", {"a": TOKENS["a"], "b": TOKENS["b"]},
                           cluster=TOKENS["cluster"], quotas={"a": "16MiB"})
    n = start_node(tmp, "--auth-file", str(auth), dram="64MiB", limit_as=LIMIT_AS)
    with Client(n.addr, transport="grpc", token=TOKENS["a"]) as a:
        assert a.put(BIG_KEY, BIG_VALUE) and a.put(SMALL_KEY, SMALL_VALUE)
    yield n
    assert n.stop() == 0, n.output()


@pytest.fixture
def a(node: NodeProcess) -> Iterator[Client]:
    with Client(node.addr, transport="grpc", token=TOKENS["a"]) as c:
        yield c


@pytest.fixture(autouse=True)
def intact(node: NodeProcess) -> Iterator[None]:
    yield
    assert node.proc.poll() is None, node.output()
    with Client(node.addr, transport="tcp", token=TOKENS["a"]) as c:
        assert c.get_batch([BIG_KEY, SMALL_KEY]) == [BIG_VALUE, SMALL_VALUE]


def test_one_big_block_named_many_times_is_refused_before_any_allocation(a: Client) -> None:
    # ~1 MiB of request asking for 65536 x 4 MiB = 256 GiB of reply.
    with pytest.raises(ReplyTooLarge, match=REPLY_BOUND) as err:
        a._grpc("BatchGet", pb.BatchGetRequest(keys=[BIG_KEY] * MAX_BATCH))
    assert f"BatchGet reply would be {MAX_BATCH * BIG} bytes" in str(err.value)
    assert "(request id " in str(err.value)  # the reason rides beside the id, not instead


def test_the_refusal_an_old_client_reads_is_unchanged(node: NodeProcess) -> None:
    # A client before reasons sees the code and the words it splits on; the reason is
    # one more trailing-metadata entry beside the request id.
    with grpc.insecure_channel(node.addr) as ch, pytest.raises(grpc.RpcError) as err:
        pb_grpc.KVStoreStub(ch).BatchGet(
            pb.BatchGetRequest(keys=[BIG_KEY] * MAX_BATCH), timeout=30,
            metadata=(("authorization", f"Bearer {TOKENS['a']}"),))
    call = err.value
    assert call.code() is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert REPLY_BOUND in call.details()
    trailing = dict(call.trailing_metadata())
    assert trailing[REASON_HEADER] == ReplyTooLarge.reason
    assert REQUEST_ID_HEADER in trailing


def test_reply_bound_is_exact_in_bytes(a: Client) -> None:
    fit = MAX_REPLY_VALUE_BYTES // BIG  # repeats of the big block that fit
    over = MAX_REPLY_VALUE_BYTES - fit * BIG + 1  # then this many more bytes are one too many
    assert over <= len(SMALL_VALUE)
    with pytest.raises(ResourceExhausted, match=f"would be {fit * BIG + len(SMALL_VALUE)} "):
        a._grpc("BatchGet", pb.BatchGetRequest(keys=[BIG_KEY] * fit + [SMALL_KEY]))
    # misses count nothing: the same request with a miss instead is inside the bound
    reply = a._grpc("BatchGet", pb.BatchGetRequest(keys=[b"m" * 16, SMALL_KEY]))
    assert [i.found for i in reply.items] == [False, True]


def test_the_client_splits_a_read_the_node_refuses(a: Client) -> None:
    n = MAX_REPLY_VALUE_BYTES // BIG + 1  # one past: refused whole, fetched in two halves
    got = a.get_batch([BIG_KEY] * n)
    assert len(got) == n and all(v == BIG_VALUE for v in got)


@pytest.mark.parametrize("method, request_", [
    ("BatchGet", pb.BatchGetRequest(keys=[SMALL_KEY] * (MAX_BATCH + 1))),
    ("Exists", pb.ExistsRequest(keys=[SMALL_KEY] * (MAX_BATCH + 1))),
    ("PrefixMatch", pb.PrefixMatchRequest(keys=[SMALL_KEY] * (MAX_BATCH + 1))),
    ("Locate", pb.LocateRequest(keys=[SMALL_KEY] * (MAX_BATCH + 1))),
    ("BatchPut", pb.BatchPutRequest(items=[pb.PutRequest(key=b"x" * 16, value=b"v")]
                                    * (MAX_BATCH + 1))),
    ("Get", pb.GetRequest(key=b"short")),
    ("Put", pb.PutRequest(key=b"k" * 17, value=b"v")),
    ("Put", pb.PutRequest(key=b"k" * 16, value=b"")),
    ("Put", pb.PutRequest(key=b"k" * 16, value=b"v", parent=b"k" * 16)),
    ("Remove", pb.RemoveRequest(key=b"")),
    ("BatchGet", pb.BatchGetRequest(keys=[SMALL_KEY, b"\x00"])),
    ("Prefetch", pb.PrefetchRequest(keys=[SMALL_KEY] * (MAX_PREFETCH_KEYS + 1))),
    ("Prefetch", pb.PrefetchRequest(keys=[SMALL_KEY, b"short"])),
    ("Prefetch", pb.PrefetchRequest(keys=[SMALL_KEY], tier="ssd")),  # none, and not memory
    ("Prefetch", pb.PrefetchRequest(keys=[SMALL_KEY], tier="x" * 100_000)),
])
def test_counts_past_the_limit_and_malformed_keys_are_invalid(a: Client, method: str,
                                                              request_: object) -> None:
    with pytest.raises(InvalidArgument):
        a._grpc(method, request_)


def test_exactly_max_batch_keys_are_answered(a: Client) -> None:
    assert a._grpc("Exists", pb.ExistsRequest(keys=[SMALL_KEY] * MAX_BATCH)).exists == (
        [True] * MAX_BATCH)
    reply = a._grpc("BatchGet", pb.BatchGetRequest(keys=[SMALL_KEY] * MAX_BATCH))
    assert len(reply.items) == MAX_BATCH and reply.items[-1].value == SMALL_VALUE


def test_a_value_larger_than_the_node_is_refused(a: Client) -> None:
    with pytest.raises(ResourceExhausted):
        a.put(b"L" * 16, bytes(65 * MiB))


@pytest.mark.parametrize("tenant", ["a", "b"])
def test_cluster_calls_are_refused_to_tenants(node: NodeProcess, tenant: str) -> None:
    with Client(node.addr, transport="grpc", token=TOKENS[tenant]) as t:
        with pytest.raises(PermissionDenied, match="Replicate needs a cluster-role token"):
            t.replicate([SMALL_KEY], [node.addr], copies=2, write_quorum=1)
        with pytest.raises(PermissionDenied, match="Drain needs a cluster-role token"):
            t.drain()


def test_stats_show_a_tenant_only_its_own_usage(node: NodeProcess, a: Client) -> None:
    with Client(node.addr, transport="grpc", token=TOKENS["b"]) as b:
        assert b.put(b"b" * 16, b"b" * 5000)
        mine = b.stats()
        assert mine["node"]["namespace_bytes"] == {"b": 5000}
        assert set(mine["tiers"]["dram"]) == {"name", "capacity"}
        assert b.remove(b"b" * 16)
        assert b.stats()["node"]["namespace_bytes"] == {"b": 0}
    assert a.stats()["node"]["namespace_bytes"] == {"a": BIG + len(SMALL_VALUE)}
    with Client(node.addr, transport="grpc", token=TOKENS["cluster"]) as cl:
        full = cl.stats()
    assert full["node"]["namespace_bytes"] == {"a": BIG + len(SMALL_VALUE)}
    assert full["tiers"]["dram"]["blocks"] == 2


@pytest.mark.parametrize("transports", [("grpc", "grpc"), ("grpc", "tcp"), ("tcp", "tcp")])
def test_concurrent_same_key_puts_with_a_quota_are_values(node: NodeProcess,
                                                          transports: tuple[str, str]) -> None:
    with Client(node.addr, transport="grpc", token=TOKENS["cluster"]) as cl:
        base_used = cl.stats()["tiers"]["dram"]["used"]
    key, value = os.urandom(16), os.urandom(3 * MiB)
    clients = [Client(node.addr, transport=transports[i % 2], token=TOKENS["a"])
               for i in range(4)]
    try:
        for c in clients:
            c.exists([key])  # connected before the race starts
        barrier = threading.Barrier(len(clients))
        results: list[object] = [None] * len(clients)

        def put(i: int) -> None:
            barrier.wait(timeout=30)
            try:
                results[i] = clients[i].put(key, value)
            except Exception as exc:
                results[i] = exc

        threads = [threading.Thread(target=put, args=(i,)) for i in range(len(clients))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert sorted(results, key=str) == [False, False, False, True], results
        assert clients[0].get(key) == value
        gets = [c.get(key) for c in clients]
        assert gets == [value] * len(clients)
        assert clients[1].remove(key) and not clients[0].remove(key)
    finally:
        for c in clients:
            c.close()
    with Client(node.addr, transport="grpc", token=TOKENS["cluster"]) as cl:
        stats = cl.stats()
    assert stats["tiers"]["dram"]["used"] == base_used
    assert stats["node"]["namespace_bytes"] == {"a": BIG + len(SMALL_VALUE)}


def test_a_tenant_cannot_reach_another_tenants_blocks(node: NodeProcess) -> None:
    with Client(node.addr, transport="grpc", token=TOKENS["b"]) as b:
        assert b.get(BIG_KEY) is None and b.exists([SMALL_KEY]) == [False]
        assert b.get(salt_key("a", SMALL_KEY)) is None  # salted again: not a's stored key
        assert b.remove(SMALL_KEY) is False


def test_undecodable_bodies_are_invalid_argument(node: NodeProcess) -> None:
    with grpc.insecure_channel(node.addr) as ch:
        for method in ("Get", "BatchGet", "Replicate", "Stats", "Drain"):
            call = ch.unary_unary(f"/kvstore.v1.KVStore/{method}")
            with pytest.raises(grpc.RpcError) as err:
                call(b"\xff\xff\xff\xff", timeout=10,
                     metadata=(("authorization", f"Bearer {TOKENS['a']}"),))
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, method


def test_wrong_or_missing_token_is_unauthenticated(node: NodeProcess) -> None:
    from kvstore.core.errors import Unauthenticated

    for token in (None, "x" * 30, TOKENS["a"] + "x"):
        with Client(node.addr, transport="grpc", token=token) as c, \
                pytest.raises(Unauthenticated):
            c._grpc("Replicate", pb.ReplicateRequest(keys=[SMALL_KEY], targets=[], copies=1))


def test_the_address_space_limit_was_in_force(node: NodeProcess) -> None:
    status = Path(f"/proc/{node.proc.pid}/status").read_text()
    peak = next(int(line.split()[1]) for line in status.splitlines()
                if line.startswith("VmPeak:"))
    assert peak * 1024 <= LIMIT_AS
    limits = Path(f"/proc/{node.proc.pid}/limits").read_text()
    assert f"Max address space         {LIMIT_AS}" in limits


def test_the_stat_command_shows_a_tenant_its_view(node: NodeProcess, tmp_path: Path) -> None:
    token = tmp_path / "token"
    token.write_text(TOKENS["a"])
    out = subprocess.run([sys.executable, "-m", "kvstore", "stat", "--addr", node.addr,
                          "--transport", "grpc", "--token-file", str(token)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 0, out.stderr
    assert f"namespace_bytes={{'a': {BIG + len(SMALL_VALUE)}}}" in out.stdout
    assert "tenant=a" in out.stdout and "'b'" not in out.stdout


def test_concurrent_puts_gets_and_removes_of_one_key_are_values(node: NodeProcess) -> None:
    with Client(node.addr, transport="grpc", token=TOKENS["cluster"]) as cl:
        base = cl.stats()
    key, value = os.urandom(16), os.urandom(MiB)
    clients = [Client(node.addr, transport=t, token=TOKENS["a"])
               for t in ("grpc", "tcp", "grpc", "tcp")]
    rounds = 30
    barrier = threading.Barrier(len(clients))
    seen: list[list[object]] = [[] for _ in clients]

    def churn(i: int) -> None:
        c = clients[i]
        barrier.wait(timeout=30)
        try:
            for n in range(rounds):
                op = (i + n) % 3
                if op == 0:
                    seen[i].append(c.put(key, value))
                elif op == 1:
                    got = c.get(key)
                    seen[i].append(got is None or got == value)  # never other bytes
                else:
                    seen[i].append(c.remove(key))
        except Exception as exc:
            seen[i].append(exc)

    threads = [threading.Thread(target=churn, args=(i,)) for i in range(len(clients))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    try:
        for i, got in enumerate(seen):
            assert len(got) == rounds and all(isinstance(v, bool) for v in got), (i, got)
            assert all(got[n] for n in range(rounds) if (i + n) % 3 == 1)  # every get exact
        clients[0].remove(key)
    finally:
        for c in clients:
            c.close()
    with Client(node.addr, transport="grpc", token=TOKENS["cluster"]) as cl:
        after = cl.stats()
    assert after["tiers"]["dram"]["used"] == base["tiers"]["dram"]["used"]
    assert after["node"]["namespace_bytes"] == base["node"]["namespace_bytes"]
