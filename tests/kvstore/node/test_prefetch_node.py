"""Prefetch in real node processes: over gRPC and the client library, the bounds, tenants,
retention, stat and metrics.

Each node has 4 MiB of DRAM (16 blocks of 256 KiB) over an SSD tier, with its high
watermark at 1.0 and its low one at 0.75: the mover then never demotes in the background,
and a put into a full DRAM demotes exactly the 5 oldest blocks (17 - 12) before it
returns. So where every block is, before and after a prefetch, is exact.
"""

from __future__ import annotations

import os
import urllib.request
from pathlib import Path

import grpc
import pytest
from conftest import NodeProcess, free_port, start_node, wait_until, write_auth_file
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client, InvalidArgument, PrefetchOutcome
from kvstore.core.keys import salt_key
from kvstore.core.prefetch import MAX_PREFETCH_KEYS
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc

BLOCK = 256 << 10
SLOTS = 16
NONE_YET = {"present": 0, "promoted": 0, "missing": 0, "no_room": 0, "busy": 0, "undone": 0}


def tiered(tmp_path: Path, *extra: str) -> NodeProcess:
    return start_node(tmp_path, "--ssd-path", str(tmp_path / f"kv-{free_port()}.img"),
                      "--ssd-bytes", "64MiB", "--ssd-io", "python", "--high-watermark", "1.0",
                      "--low-watermark", "0.75", *extra, dram="4MiB")


def fill(c: Client, n: int, retain_s: float | None = None) -> list[bytes]:
    keys = [os.urandom(16) for _ in range(n)]
    for k in keys:
        assert c.put(k, os.urandom(BLOCK), retain_s=retain_s) is True
    return keys


def counted(c: Client) -> dict[str, int]:
    return c.stats()["node"]["prefetch_blocks"]


def test_a_block_demoted_to_ssd_comes_back_to_dram(tmp_path: Path) -> None:
    node = tiered(tmp_path)
    try:
        with Client(node.addr, transport="tcp") as c:
            values = {os.urandom(16): os.urandom(BLOCK) for _ in range(SLOTS + 1)}
            for k, v in values.items():
                assert c.put(k, v)
            keys = list(values)
            assert c.locate(keys) == ["ssd"] * 5 + ["dram"] * 12
            assert counted(c) == NONE_YET
            # Waited: the answer is the move's result.
            assert c.prefetch([keys[0]], wait=True) == [PrefetchOutcome.PROMOTED]
            assert c.locate(keys[:2]) == ["dram", "ssd"]
            # Not waited: answered once planned, moved by the node's mover.
            assert c.prefetch([keys[1]]) == ["queued"]
            wait_until(lambda: counted(c)["promoted"] == 2, what="the queued prefetch")
            assert c.locate(keys[:2]) == ["dram", "dram"]
            stray = os.urandom(16)
            assert c.prefetch([keys[0], keys[1], stray, keys[0]]) == [
                "present", "present", "missing", "present"]
            stats = c.stats()
            assert stats["tiers"]["dram"]["promotions"] == 2
            assert [t["hits"] for t in stats["tiers"].values()] == [0, 0]  # no read counted
            assert stats["node"]["prefetch_blocks"] == {**NONE_YET, "promoted": 2,
                                                        "present": 2, "missing": 1}
            assert stats["node"]["prefetch_bytes_in_flight"] == 0
            assert all(c.get(k) == v for k, v in values.items())
    finally:
        assert node.stop() == 0, node.output()


def test_retained_blocks_of_another_session_are_never_its_room(tmp_path: Path) -> None:
    metrics = free_port()
    node = tiered(tmp_path, "--metrics-listen", f"127.0.0.1:{metrics}")
    try:
        with Client(node.addr, transport="tcp") as c:
            session = fill(c, 5)  # one session's previous turn
            others = fill(c, 11, retain_s=600)  # another live session's turns, retained
            others += fill(c, 1, retain_s=600)  # DRAM was full: the 5 oldest went to SSD
            others += fill(c, 4, retain_s=600)  # full again, of retained blocks only
            assert c.locate(session) == ["ssd"] * 5
            assert c.locate(others) == ["dram"] * 16
            assert c.prefetch(session, wait=True) == ["no_room"] * 5
            assert c.locate(session) == ["ssd"] * 5 and c.locate(others) == ["dram"] * 16
            # A put demotes by the policy alone (retention allows demotion): DRAM has room
            # for 4 and one ordinary block, its room for the fifth.
            (plain,) = fill(c, 1)
            assert c.locate(others) == ["ssd"] * 5 + ["dram"] * 11
            assert c.prefetch(session, wait=True) == ["promoted"] * 5
            assert c.locate(session) == ["dram"] * 5
            assert c.locate(others) == ["ssd"] * 5 + ["dram"] * 11  # not one more demoted
            assert c.locate([plain]) == ["ssd"]
            stats = c.stats()
            assert stats["node"]["retained_blocks"] == 16
            assert stats["tiers"]["ssd"]["evictions"] == 0
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics}/metrics", timeout=10) as r:
            text = r.read().decode()
        samples = {(s.name, tuple(s.labels.items())): s.value
                   for f in text_string_to_metric_families(text) for s in f.samples}
        by_outcome = {dict(labels)["outcome"]: v for (n, labels), v in samples.items()
                      if n == "kvstore_prefetch_blocks_total"}
        assert by_outcome == {**NONE_YET, "no_room": 5, "promoted": 5}
        assert samples[("kvstore_prefetch_bytes_in_flight", ())] == 0
    finally:
        assert node.stop() == 0, node.output()


def test_the_bounds(tmp_path: Path) -> None:
    node = tiered(tmp_path, "--max-prefetch-bytes", "512KiB")  # two blocks on the move
    try:
        # Refused before anything is sent: no node listens there.
        with Client(f"127.0.0.1:{free_port()}", transport="grpc", timeout=2) as nowhere, \
                pytest.raises(InvalidArgument, match=f"at most {MAX_PREFETCH_KEYS} keys"):
            nowhere.prefetch([os.urandom(16)] * (MAX_PREFETCH_KEYS + 1))
        with Client(node.addr, transport="tcp") as c:
            keys = fill(c, SLOTS + 1)
            assert c.prefetch(keys[:3], wait=True) == ["promoted", "promoted", "busy"]
            assert c.prefetch(keys[2:3], wait=True) == ["promoted"]  # the bound is per flight
            assert c.prefetch([os.urandom(16)] * MAX_PREFETCH_KEYS) == ["missing"] * 4096
            with pytest.raises(InvalidArgument, match="no memory tier named 'hbm'"):
                c.prefetch(keys[:1], "hbm")
        with grpc.insecure_channel(node.addr) as channel:
            stub = pb_grpc.KVStoreStub(channel)
            for bad in (pb.PrefetchRequest(keys=[os.urandom(16)] * (MAX_PREFETCH_KEYS + 1)),
                        pb.PrefetchRequest(keys=[keys[3]], tier="ssd"),
                        pb.PrefetchRequest(keys=[b"short"])):
                with pytest.raises(grpc.RpcError) as err:
                    stub.Prefetch(bad, timeout=10)
                assert err.value.code() is grpc.StatusCode.INVALID_ARGUMENT
            # A request that names no tier (an older writer of the message): DRAM.
            reply = stub.Prefetch(pb.PrefetchRequest(keys=[keys[3]], wait=True), timeout=10)
            assert list(reply.outcomes) == ["promoted"]
    finally:
        assert node.stop() == 0, node.output()


def test_a_tenant_prefetches_only_its_own_blocks(tmp_path: Path) -> None:
    auth = write_auth_file(tmp_path / "auth.toml", {"alice": "alice-token-0123456789",
                                                    "bob": "bob-token-0123456789ab"},
                           cluster="ops-token-0123456789ab", quotas={"alice": "8MiB"})
    node = tiered(tmp_path, "--auth-file", str(auth))
    try:
        with Client(node.addr, transport="grpc", token="alice-token-0123456789") as alice, \
                Client(node.addr, transport="grpc", token="bob-token-0123456789ab") as bob, \
                Client(node.addr, transport="grpc", token="ops-token-0123456789ab") as ops:
            keys = fill(alice, SLOTS + 1)
            stored = [salt_key("alice", k) for k in keys]  # what the node holds
            assert ops.locate(stored[:6]) == ["ssd"] * 5 + ["dram"]
            used = alice.stats()["node"]["namespace_bytes"]
            # Bob names alice's keys, raw or salted: neither is a block of his.
            assert bob.prefetch(keys[:2], wait=True) == ["missing"] * 2
            assert bob.prefetch(stored[:2], wait=True) == ["missing"] * 2
            assert ops.locate(stored[:2]) == ["ssd", "ssd"]
            assert alice.prefetch(keys[:2], wait=True) == ["promoted"] * 2
            assert ops.locate(stored[:2]) == ["dram", "dram"]
            # A move stores no new byte: her quota use is what it was.
            assert alice.stats()["node"]["namespace_bytes"] == used
            # The node's prefetch counters sum every tenant's calls: a tenant sees none.
            assert "prefetch_blocks" not in alice.stats()["node"]
            assert ops.stats()["node"]["prefetch_blocks"]["missing"] == 4
    finally:
        assert node.stop() == 0, node.output()
