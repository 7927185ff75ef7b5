"""``conductor.front.store_view``: the durability wait against a real node."""

from __future__ import annotations

import asyncio
import threading

import pytest

from conductor.front.store_view import NotDurable, StoreView
from kvstore import Client, block_keys


def _keys(n_blocks: int, seed: int) -> list[bytes]:
    return [bytes(k) for k in block_keys([seed + i for i in range(n_blocks * 4)], 4, "sv")]


def test_wait_returns_only_once_every_block_is_stored(node) -> None:
    keys = _keys(3, 1)
    with Client(node.addr) as c:
        c.put(keys[0], b"a")
        view = StoreView(c)
        polled = threading.Event()
        real = view._durable_len

        def counting(ks):  # the first poll has seen the partial prefix
            n = real(ks)
            polled.set()
            return n

        view._durable_len = counting  # type: ignore[method-assign]

        async def run() -> float:
            task = asyncio.ensure_future(view.wait_durable(keys, timeout_s=30, namespace="sv"))
            await asyncio.to_thread(polled.wait, 10)
            assert not task.done()
            await asyncio.to_thread(c.put, keys[1], b"b")
            await asyncio.sleep(0.06)  # several polls with 2 of 3 blocks
            assert not task.done()
            await asyncio.to_thread(c.put, keys[2], b"c")
            return await task

        waited = asyncio.run(run())
        assert waited > 0
        assert asyncio.run(view.prefix_len(keys)) == 3


def test_wait_is_bounded_and_says_what_to_check(node) -> None:
    keys = _keys(4, 100)
    with Client(node.addr) as c:
        view = StoreView(c)
        with pytest.raises(NotDurable) as e:
            asyncio.run(view.wait_durable(keys, timeout_s=0.05, namespace="ns-x"))
        assert e.value.found == 0 and e.value.want == 4
        assert "0 of 4 blocks stored" in str(e.value)
        assert "none at all under namespace 'ns-x'" in str(e.value)
        c.put(keys[0], b"x")
        with pytest.raises(NotDurable) as e:
            asyncio.run(view.wait_durable(keys, timeout_s=0.05, namespace="ns-x"))
        assert str(e.value) == "prefill's KV cache not in the store within 0.05 s: " \
            "1 of 4 blocks stored"


def test_an_unreachable_store_is_a_miss_for_lookups_and_an_error_for_the_wait() -> None:
    from conductor.front.vllm_procs import free_port

    with Client(f"127.0.0.1:{free_port()}", timeout=0.5) as c:
        view = StoreView(c)
        keys = _keys(2, 7)
        assert asyncio.run(view.prefix_len(keys)) == 0
        with pytest.raises(NotDurable, match="store unreachable"):
            asyncio.run(view.wait_durable(keys, timeout_s=1, namespace="x"))


def test_on_a_cluster_the_wait_counts_copies_not_presence(tmp_path) -> None:
    """``conductor serve --etcd`` waits for ``--write-quorum`` copies of every block: a
    prefix stored once on a real etcd cluster is not durable until its copies exist."""
    from replication.local_cluster import LocalCluster

    # The nodes' repair keeps one copy: only the writers below make the second.
    cluster = LocalCluster.up(tmp_path / "cluster", 3, node_args=[
        "--dram-bytes", "32MiB", "--no-prefault", "--replicas", "1",
        "--repair-interval", "600"])
    try:
        keys = _keys(3, 300)
        values = [bytes([i]) * 1000 for i in range(3)]
        with Client(etcd=cluster.etcd, replicas=1) as once, \
                Client(etcd=cluster.etcd, replicas=2, write_quorum=2) as twice:
            assert once.put_batch(keys, values) == [True] * 3
            view = StoreView(twice, write_quorum=2)
            assert asyncio.run(view.prefix_len(keys)) == 3
            with pytest.raises(NotDurable) as e:
                asyncio.run(view.wait_durable(keys, timeout_s=0.2, namespace="sv"))
            assert (e.value.found, e.value.want) == (0, 3)
            assert "0 of 3 blocks stored with 2 copies" in str(e.value)
            twice.put_batch(keys, values)  # each master forwards to the owner that lacks it
            assert asyncio.run(view.wait_durable(keys, timeout_s=10, namespace="sv")) >= 0
            assert [len(h) for h in twice.holders(keys)] == [2, 2, 2]
    finally:
        cluster.down(timeout=10)


def test_with_shards_a_block_is_stored_only_when_every_shard_is(node) -> None:
    from kvstore.core.keys import shard_key

    keys = _keys(3, 300)
    shards = ("tp0of2.pp0of1", "tp1of2.pp0of1")
    with Client(node.addr) as c:
        view = StoreView(c)
        c.put_batch(keys, [b"k"] * 3)  # a one-rank engine's blocks
        assert asyncio.run(view.prefix_len(keys, shards)) == 0
        c.put_batch([shard_key(k, shards[0]) for k in keys], [b"0"] * 3)
        c.put_batch([shard_key(k, shards[1]) for k in keys[:2]], [b"1"] * 2)
        assert asyncio.run(view.prefix_len(keys, shards)) == 2
        assert asyncio.run(view.prefix_len(keys)) == 3
