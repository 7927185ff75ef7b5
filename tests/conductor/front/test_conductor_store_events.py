"""``conductor.front.store_events``: the durability wait follows a real node's KV events."""

from __future__ import annotations

import asyncio
import time

import pytest

from conductor.front.store_events import (
    BlockEvents,
    EventSource,
    NoEvents,
    event_sources,
    reachable,
)
from conductor.front.store_view import NotDurable, StoreView
from kvstore import Client, block_keys


def _keys(n_blocks: int, seed: int) -> list[bytes]:
    return [bytes(k) for k in block_keys([seed + i for i in range(n_blocks * 4)], 4, "ev")]


@pytest.fixture
def events_node(tmp_path):
    from conftest import start_node

    n = start_node(tmp_path, "--kv-events-endpoint", "tcp://127.0.0.1:0")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


async def _live(events: BlockEvents, c: Client, key: bytes) -> None:
    """Puts ``key`` until the subscription has seen a batch: it is connected (a SUB
    socket misses what was published before it joined)."""
    while events.batches == 0:
        await asyncio.to_thread(c.put, key, b"warm-up")
        await asyncio.sleep(0.02)


def test_the_node_names_its_events_and_the_front_finds_them(events_node) -> None:
    with Client(events_node.addr) as c:
        endpoint = c.stats()["node"]["kv_events_endpoint"]
        assert endpoint.startswith("tcp://127.0.0.1:")
        assert event_sources(c, events_node.addr) == [
            EventSource(node=events_node.addr, endpoint=endpoint)]


def test_a_node_without_events_means_polling(node) -> None:
    with Client(node.addr) as c, pytest.raises(NoEvents, match="publishes no KV events"):
        event_sources(c, node.addr)


def test_a_wildcard_bind_is_reached_at_the_nodes_host() -> None:
    assert reachable("tcp://0.0.0.0:5557", "10.0.0.7:7600") == "tcp://10.0.0.7:5557"
    assert reachable("tcp://[::]:5557", "node-a:7600") == "tcp://node-a:5557"
    assert reachable("tcp://127.0.0.1:5557", "10.0.0.7:7600") == "tcp://127.0.0.1:5557"
    assert reachable("ipc:///tmp/ev", "10.0.0.7:7600") == "ipc:///tmp/ev"


def test_the_wait_asks_the_store_once_and_is_woken_by_the_events(events_node) -> None:
    keys = _keys(3, 1)
    with Client(events_node.addr) as c:
        async def run() -> tuple[float, int]:
            view = StoreView(c)
            events = BlockEvents(event_sources(c, events_node.addr))
            view.use_events(events)
            try:
                await _live(events, c, _keys(1, 900)[0])
                await asyncio.to_thread(c.put, keys[0], b"a")
                task = asyncio.ensure_future(view.wait_durable(keys, timeout_s=30,
                                                               namespace="ev"))
                while view.store_checks == 0:  # the wait asked the store (1 of 3 there)
                    await asyncio.sleep(0.001)
                batches = events.batches
                await asyncio.to_thread(c.put, keys[1], b"b")
                while events.batches == batches:  # key 1's event arrived: not done yet
                    await asyncio.sleep(0.001)
                await asyncio.sleep(0)
                assert not task.done()
                await asyncio.to_thread(c.put, keys[2], b"c")
                t0 = time.monotonic()
                waited = await task
                return waited, view.store_checks, time.monotonic() - t0
            finally:
                events.close()

        waited, checks, after_last = asyncio.run(run())
        assert waited > 0
        # One store call: the wait's own; the rest came by events, well before the
        # safety re-check (RECHECK_S) would have asked again.
        assert checks == 1
        assert after_last < 0.5


def test_without_the_blocks_the_event_wait_is_bounded_and_names_what_it_found(
        events_node) -> None:
    keys = _keys(4, 100)
    with Client(events_node.addr) as c:
        c.put(keys[0], b"x")

        async def run() -> None:
            events = BlockEvents(event_sources(c, events_node.addr))
            try:
                view = StoreView(c, events=events)
                with pytest.raises(NotDurable) as e:
                    await view.wait_durable(keys, timeout_s=0.2, namespace="ev")
                assert (e.value.found, e.value.want) == (1, 4)
                assert str(e.value) == ("prefill's KV cache not in the store within "
                                        "0.2 s: 1 of 4 blocks stored")
            finally:
                events.close()

        asyncio.run(run())
