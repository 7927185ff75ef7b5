"""The node's budget for inbound gRPC requests (``--max-request-bytes``): the class, then
many concurrent large BatchPuts against a real node process."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, start_node

from kvstore.client import Client
from kvstore.core.errors import ResourceExhausted
from kvstore.node.config import NodeConfig
from kvstore.node.request_budget import (
    MIN_REQUEST_BYTES,
    RequestBudget,
    default_request_bytes,
    max_message_bytes,
)
from kvstore.protocol.grpc_options import MAX_MESSAGE_BYTES

MiB = 1 << 20


def test_a_hold_past_the_limit_is_refused_and_every_hold_ends_with_its_scope() -> None:
    budget = RequestBudget(100)
    with budget.hold(60, "BatchPut"):
        with budget.hold(40, "Put"):  # exactly at the limit
            assert budget.held == 100
            with pytest.raises(ResourceExhausted) as refused, budget.hold(1, "Exists"):
                pass
        assert "Exists request of 1 bytes" in str(refused.value)
        assert "hold 100 bytes" in str(refused.value) and "100-byte" in str(refused.value)
        with pytest.raises(KeyError), budget.hold(40, "Put"):  # a failing call ends too
            raise KeyError
        assert budget.held == 60
    assert budget.stats() == {"request_bytes_held": 0, "request_bytes_limit": 100,
                              "requests_refused_for_memory": 1}
    with pytest.raises(ValueError):
        RequestBudget(0)


def test_concurrent_holds_never_pass_the_limit() -> None:
    budget = RequestBudget(1000)
    start = threading.Barrier(8)
    peak: list[int] = []
    refused = []

    def worker(n: int) -> None:
        start.wait()
        for _ in range(2000):
            try:
                with budget.hold(n, "x"):
                    peak.append(budget.held)
            except ResourceExhausted:
                refused.append(n)

    threads = [threading.Thread(target=worker, args=(150 + 10 * i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert max(peak) <= 1000 and budget.held == 0
    assert budget.stats()["requests_refused_for_memory"] == len(refused)


def test_the_default_grows_with_the_node_within_bounds() -> None:
    assert default_request_bytes(64 * MiB) == MIN_REQUEST_BYTES == 64 * MiB
    assert default_request_bytes(1 << 30) == 256 * MiB
    assert default_request_bytes(1 << 40) == 1 << 30
    assert max_message_bytes(256 * MiB) == 256 * MiB  # one larger could never be held
    assert max_message_bytes(4 << 30) == MAX_MESSAGE_BYTES
    assert NodeConfig(max_request_bytes=64 * MiB).max_request_bytes == 64 * MiB
    with pytest.raises(ValueError, match="max_request_bytes"):
        NodeConfig(max_request_bytes=MiB)


# ---- a real node -------------------------------------------------------------------------

WORKERS = 4
BUDGET = 64 * MiB
VALUE = 4096
ITEMS = 8192  # 32 MiB a call (the client's largest gRPC batch): two never fit at once, and
# a handler stores thousands of blocks, so the calls the node serves overlap
CALLS = 24
DRAM = 128 * MiB
LIMIT_AS = 4 << 30  # the node's address space: the storm must not need more
VALUES = [hashlib.sha256(b"%d" % j).digest() * (VALUE // 32) for j in range(ITEMS)]


def _key(call: int, item: int) -> bytes:
    return hashlib.sha256(b"key %d/%d" % (call, item)).digest()[:16]


def _status(addr: str) -> dict[str, int]:
    with Client(addr, transport="grpc") as c:
        node = c.stats()["node"]
    return {k: node[k] for k in ("request_bytes_held", "request_bytes_limit",
                                 "requests_refused_for_memory")}


def _rss_kib(node: NodeProcess, field: str) -> int:
    for line in Path(f"/proc/{node.proc.pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} for the node")


@pytest.fixture
def small_node(tmp_path: Path) -> Iterator[NodeProcess]:
    n = start_node(tmp_path, "--grpc-workers", str(WORKERS), "--max-request-bytes", "64MiB",
                   dram="128MiB", limit_as=LIMIT_AS)
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


def test_many_concurrent_large_batch_puts_hold_at_most_the_budget(
        small_node: NodeProcess) -> None:
    addr = small_node.addr
    assert _status(addr) == {"request_bytes_held": 0, "request_bytes_limit": BUDGET,
                             "requests_refused_for_memory": 0}
    with Client(addr, transport="grpc") as c:  # a block stored before the storm (pinned:
        before = b"before" * 1000                # the storm's puts evict everything else)
        assert c.put(_key(-1, 0), before, pin=True) is True
    rss_before = _rss_kib(small_node, "VmRSS")
    go = threading.Barrier(CALLS)
    outcome: dict[int, str] = {}

    def call(i: int) -> None:
        keys = [_key(i, j) for j in range(ITEMS)]
        with Client(addr, transport="grpc", timeout=120) as c:
            go.wait()  # every call is sent at once
            try:
                assert c.put_batch(keys, VALUES) == [True] * ITEMS
                outcome[i] = "stored"
            except ResourceExhausted as exc:
                outcome[i] = "refused: " + str(exc)

    threads = [threading.Thread(target=call, args=(i,)) for i in range(CALLS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert small_node.proc.poll() is None, small_node.output()
    stored = [i for i, o in outcome.items() if o == "stored"]
    refused = [o for o in outcome.values() if o != "stored"]
    assert len(outcome) == CALLS and stored and refused
    assert all("--max-request-bytes" in o for o in refused)
    # The node held at most its DRAM tier, the budget (decoded: twice) and the messages its
    # handler threads were receiving (each in memory whole, about three times over, before
    # a handler runs: docs/security.md), never the 24 calls' 768 MiB at once.
    grew = (_rss_kib(small_node, "VmHWM") - rss_before) * 1024
    assert grew < DRAM + 2 * BUDGET + 3 * WORKERS * ITEMS * VALUE, grew
    status = _status(addr)  # the budget is whole again
    assert status["request_bytes_held"] == 0
    assert status["requests_refused_for_memory"] == len(refused)
    with Client(addr, transport="tcp") as c:  # nothing stored was touched
        assert c.get(_key(-1, 0)) == before
        for i in stored:  # what is still there (128 MiB of DRAM: most were evicted) is exact
            got = c.get_batch([_key(i, j) for j in range(ITEMS)])
            assert all(g is None or g == v for g, v in zip(got, VALUES, strict=True)), i
    with Client(addr, transport="grpc") as c:  # and a large put goes through again
        assert c.put_batch([_key(99, j) for j in range(ITEMS)], VALUES) == [True] * ITEMS
