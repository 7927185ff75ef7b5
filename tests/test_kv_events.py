"""KV events from a real ``kvstore serve`` process: exact ordered events for puts,
removals, evictions and moves between tiers; gaps recovered from the replay buffer;
snapshots; a restart seen as a sequence jump and recovered by snapshot."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from conftest import NodeProcess, start_node, wait_until
from kvstore import Client
from kvstore.kv_event_subscriber import BlockLocations, KVEventSubscriber, decode

pytest.importorskip("zmq")
pytest.importorskip("msgspec")

BLOCK = 256 << 10  # four of these fill the 1 MiB DRAM tier past its high watermark
EVENTS = ("--kv-events-endpoint", "tcp://127.0.0.1:0",
          "--kv-events-replay-endpoint", "tcp://127.0.0.1:0")


def key(i: int) -> bytes:
    return bytes([i]) * 16


def endpoints(node: NodeProcess) -> tuple[str, str]:
    m = re.findall(r"kvstore: KV events on (\S+) \(replay (\S+)\)", node.output())
    assert m, node.output()
    return m[-1]


def flat(batches: list[tuple[int, bytes]]) -> list[tuple[Any, ...]]:
    """Events as tuples (type, hash, parent or medium...), across batches, in order."""
    out: list[tuple[Any, ...]] = []
    for _seq, payload in batches:
        for e in decode(payload):
            if e["type"] == "BlockStored":
                assert e["token_ids"] == [] and e["block_size"] == 0 and e["lora_id"] is None
                out.append(("S", e["block_hashes"][0], e["parent_block_hash"], e["medium"]))
            elif e["type"] == "BlockRemoved":
                out.append(("R", e["block_hashes"][0], e["medium"]))
            else:
                out.append(("C",))
    return out


def replay_all(sub: KVEventSubscriber, first: int, n_events: int) -> list[tuple[int, bytes]]:
    """The node's buffered batches from ``first`` once they hold ``n_events`` events (the
    publisher thread sends shortly after each change: polled, across processes)."""
    got: list[tuple[int, bytes]] = []

    def enough() -> bool:
        nonlocal got
        got = sub.replay(first)
        return len(flat(got)) >= n_events

    wait_until(enough, what=f"{n_events} KV events")
    assert [s for s, _ in got] == list(range(first, first + len(got)))  # no gaps
    return got


@pytest.fixture
def dram_node(tmp_path: Path) -> Iterator[tuple[NodeProcess, KVEventSubscriber, float]]:
    before = time.time()
    node = start_node(tmp_path, *EVENTS, dram="1MiB")
    sub = KVEventSubscriber(*endpoints(node))
    try:
        yield node, sub, before
    finally:
        sub.close()
        code = node.stop()
    assert code == 0, node.output()


def test_put_remove_evict_in_order(dram_node: tuple[NodeProcess, KVEventSubscriber, float]
                                   ) -> None:
    node, sub, before = dram_node
    start, payload = sub.snapshot()  # nothing but the start batch is out yet
    assert before * 1e6 <= start <= time.time() * 1e6  # the seq base is the start time
    assert flat([(start, payload)]) == [("C",)]
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key(1), b"a" * BLOCK)
        assert c.put(key(2), b"b" * BLOCK, parent=key(1))
        assert c.put(key(3), b"c" * BLOCK, parent=key(2))
        assert not c.put(key(3), b"c" * BLOCK, parent=key(2))  # already stored: no event
        assert c.remove(key(2))
        assert not c.remove(key(2))
        assert c.put(key(4), b"d" * BLOCK)
        # 1 MiB used > 95%: LRU evicts key 1 (the oldest) before key 5 is committed.
        assert c.put(key(5), b"e" * BLOCK)
    batches = replay_all(sub, start, 8)
    assert flat(batches) == [
        ("C",),
        ("S", key(1), None, "CPU"),
        ("S", key(2), key(1), "CPU"),
        ("S", key(3), key(2), "CPU"),
        ("R", key(2), "CPU"),
        ("S", key(4), None, "CPU"),
        ("R", key(1), "CPU"),
        ("S", key(5), None, "CPU"),
    ]
    seq, snap = sub.snapshot()
    assert seq == batches[-1][0]  # the state as of the last published batch
    assert flat([(seq, snap)]) == [("C",), ("S", key(3), key(2), "CPU"),
                                   ("S", key(4), None, "CPU"), ("S", key(5), None, "CPU")]
