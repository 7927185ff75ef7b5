"""Mooncake 0.3.13's ranged and session transfers (``mooncake_ranges``) on real nodes: the
scenario the real wheel also runs (tests/engines/test_mooncake_wheel.py), on one node and on
a 3-node cluster, then kvstore's own edges (space at ``end``, configs, registered tails)."""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Iterator

import mooncake_scenario as scenario
import pytest
from conftest import start_node, start_static_cluster

from kvstore import Client
from kvstore.integrations.mooncake.store import (
    DFS_SERVICE_UNAVAILABLE,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_NOT_FOUND,
    OK,
    MooncakeDistributedStore,
    ReplicateConfig,
    mooncake_key,
)
from replication.placement.rendezvous import Member, NodeId

MiB = 1 << 20


@pytest.fixture(scope="module")
def single_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    node = start_node(tmp_path_factory.mktemp("mc-ranges"), dram="8MiB")
    yield node.addr
    node.stop()


@pytest.fixture(scope="module")
def cluster_addrs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    nodes = start_static_cluster(tmp_path_factory.mktemp("mc-ranges-cluster"), 3)
    yield [n.addr for n in nodes]
    for n in nodes:
        n.stop()


def _setup_dict(target: str) -> dict[str, str]:
    return {"local_hostname": "127.0.0.1", "metadata_server": "http://127.0.0.1:1/metadata",
            "global_segment_size": "64MB", "local_buffer_size": "32MB", "protocol": "tcp",
            "master_server_addr": target}


@pytest.mark.parametrize("where", ["single", "cluster"])
def test_the_wheel_scenario(where: str, request: pytest.FixtureRequest) -> None:
    target = (request.getfixturevalue("single_addr") if where == "single"
              else ",".join(request.getfixturevalue("cluster_addrs")))
    got: dict[str, object] = {}
    s = scenario.open_store(MooncakeDistributedStore, _setup_dict(target), got)
    scenario.basic_steps(s, f"scenario-{where}-basic/", got)
    scenario.tensor_steps(s, f"scenario-{where}-tensor/", got)
    scenario.ranged_steps(s, ReplicateConfig, f"scenario-{where}/", got)
    assert got == scenario.expected(got, kvstore=True)
    assert len(got) == 95


@pytest.fixture
def store(single_addr: str) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup(_setup_dict(single_addr)) == OK
    yield s
    s.remove_all()
    s.close()


@pytest.fixture
def buf(store: MooncakeDistributedStore) -> Iterator[tuple[ctypes.Array, int]]:
    b = (ctypes.c_ubyte * (1 * MiB))()
    ptr = ctypes.addressof(b)
    assert store.register_buffer(ptr, len(b)) == OK
    yield b, ptr
    store.unregister_buffer(ptr)


def test_not_set_up_answers_like_the_wheel() -> None:
    s = MooncakeDistributedStore()
    assert s.batch_put_session_start(["k"], [10]) == []
    assert s.batch_put_from_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]) == []
    assert s.batch_put_session_end(["k"]) == []
    assert s.batch_put_session_revoke(["k"]) == []
    assert s.batch_get_session_start(["k"]) == []
    assert s.batch_get_into_multi_buffer_ranges(["k"], [[1]], [[1]], [[0]]) == []
    assert s.batch_get_session_end(["k"]) == -1
    assert s.get_into_ranges([1], [["k"]], [[[0]]], [[[0]]], [[[1]]]) == [[[INVALID_PARAMS]]]


def test_layer_by_layer_put_then_get(store: MooncakeDistributedStore,
                                     buf: tuple[ctypes.Array, int]) -> None:
    """Four layers of 1 KiB per key written into two objects, read back layer by layer."""
    b, ptr = buf
    keys, layers, width = ["layers/a", "layers/b"], 4, 1024
    assert store.batch_put_session_start(keys, [layers * width] * 2) == [OK, OK]
    for layer in range(layers):
        for i in range(2 * width):
            b[i] = (layer * 7 + i) % 256
        got = store.batch_put_from_multi_buffer_ranges(
            keys, [[ptr], [ptr + width]], [[width], [width]],
            [[layer * width], [layer * width]])
        assert got == [width, width]
    assert store.batch_is_exist(keys) == [0, 0]
    assert store.batch_put_session_end(keys) == [OK, OK]
    want_a = b"".join(bytes((lay * 7 + i) % 256 for i in range(width)) for lay in range(layers))
    want_b = b"".join(bytes((lay * 7 + i) % 256 for i in range(width, 2 * width))
                      for lay in range(layers))
    assert store.get_batch(keys) == [want_a, want_b]
    assert store.batch_get_session_start(keys) == [OK, OK]
    for layer in reversed(range(layers)):
        got = store.batch_get_into_multi_buffer_ranges(
            keys, [[ptr], [ptr + 4096]], [[width], [width]], [[layer * width], [layer * width]])
        assert got == [width, width]
        assert bytes(b[0:width]) == want_a[layer * width : (layer + 1) * width]
        assert bytes(b[4096 : 4096 + width]) == want_b[layer * width : (layer + 1) * width]
    assert store.batch_get_session_end(keys) == OK
    assert sorted(store.written_keys()) == keys  # end's put is an ordinary write


def test_a_session_larger_than_the_node_fails_at_end(store: MooncakeDistributedStore,
                                                     buf: tuple[ctypes.Array, int]) -> None:
    """The reservation is this client's memory: the node (8 MiB) says no at end, -200,
    and nothing is stored."""
    assert store.batch_put_session_start(["big", "small"], [16 * MiB, 100]) == [OK, OK]
    assert store.batch_put_session_end(["big", "small"]) == [NO_AVAILABLE_HANDLE, OK]
    assert store.batch_is_exist(["big", "small"]) == [0, 1]
    assert store.batch_put_session_end(["big"]) == [INVALID_PARAMS]  # the session is gone


def test_a_range_is_all_or_nothing_per_key(store: MooncakeDistributedStore,
                                           buf: tuple[ctypes.Array, int]) -> None:
    b, ptr = buf
    b[0:4] = (ctypes.c_ubyte * 4)(1, 2, 3, 4)
    assert store.batch_put_session_start(["aon"], [8]) == [OK]
    # the second range overflows the object: the first is not written either
    assert store.batch_put_from_multi_buffer_ranges(["aon"], [[ptr, ptr]], [[4, 4]],
                                                    [[0, 6]]) == [INVALID_PARAMS]
    assert store.batch_put_from_multi_buffer_ranges(["aon"], [[ptr]], [[4]], [[4]]) == [4]
    assert store.batch_put_session_end(["aon"]) == [OK]
    assert store.get("aon") == bytes(4) + b"\x01\x02\x03\x04"  # unwritten bytes are zero


def test_sessions_refuse_configs_kvstore_cannot_honour(store: MooncakeDistributedStore) -> None:
    dfs = ReplicateConfig()
    dfs.dfs_replica_num = 1
    nof = ReplicateConfig()
    nof.nof_replica_num = 1
    ttl = ReplicateConfig()
    ttl.soft_pin_ttl_ms = 5  # a TTL without ENABLE
    for config, code in ((dfs, DFS_SERVICE_UNAVAILABLE), (nof, INVALID_PARAMS),
                         (ttl, INVALID_PARAMS)):
        assert store.batch_put_session_start(["cfg/a", "cfg/b"], [10, 10], config) == [
            code, code]
    assert store.batch_put_session_revoke(["cfg/a"]) == [INVALID_PARAMS]  # none was opened
    assert store.batch_put_session_start(["cfg/a"], [0]) == [INVALID_PARAMS]
    assert store.batch_put_session_start(["cfg/a", "cfg/b"], [10]) == [INVALID_PARAMS] * 2


def test_hard_pin_from_the_session_config(store: MooncakeDistributedStore) -> None:
    """``with_hard_pin`` at start reaches the put at end: filling the 8 MiB node twice over
    evicts the unpinned object and keeps the pinned one."""
    pinned = ReplicateConfig()
    pinned.with_hard_pin = True
    assert store.batch_put_session_start(["pin/a"], [100], pinned) == [OK]
    assert store.batch_put_session_start(["pin/b"], [100]) == [OK]
    assert store.batch_put_session_end(["pin/a", "pin/b"]) == [OK, OK]
    filler = b"f" * MiB
    assert store.put_batch([f"pin/fill{i}" for i in range(16)], [filler] * 16) == OK
    assert store.batch_is_exist(["pin/a", "pin/b"]) == [1, 0]
    assert store.remove("pin/a") == OK


def test_close_drops_open_sessions(single_addr: str, buf: tuple[ctypes.Array, int]) -> None:
    s = MooncakeDistributedStore()
    assert s.setup(_setup_dict(single_addr)) == OK
    assert s.put("closing/g", b"g") == OK
    assert s.batch_put_session_start(["closing/p"], [10]) == [OK]
    assert s.batch_get_session_start(["closing/g"]) == [OK]
    assert s.close() == OK
    assert s.setup(_setup_dict(single_addr)) == OK
    _, ptr = buf
    assert s.register_buffer(ptr, 16) == OK
    assert s.batch_put_session_end(["closing/p"]) == [INVALID_PARAMS]
    assert s.batch_get_into_multi_buffer_ranges(["closing/g"], [[ptr]], [[1]], [[0]]) == [
        INVALID_PARAMS]
    assert s.batch_is_exist(["closing/p"]) == [0]
    assert s.remove("closing/g") == OK
    s.close()


def test_get_session_is_a_snapshot(store: MooncakeDistributedStore,
                                   buf: tuple[ctypes.Array, int]) -> None:
    """Ranges come from the copy read at start: a removal after start does not reach them."""
    b, ptr = buf
    assert store.put("snap", b"abcdef") == OK
    assert store.batch_get_session_start(["snap", "snap-missing"]) == [OK, OBJECT_NOT_FOUND]
    assert store.remove("snap") == OK
    assert store.batch_get_into_multi_buffer_ranges(["snap"], [[ptr]], [[3]], [[2]]) == [3]
    assert bytes(b[0:3]) == b"cde"
    assert store.batch_get_session_end(["snap"]) == OK


def test_get_into_ranges_checks_against_the_registered_tail(
        store: MooncakeDistributedStore, buf: tuple[ctypes.Array, int]) -> None:
    """A destination pointer inside a registered range may use the rest of that range."""
    b, ptr = buf
    assert store.put("tail", bytes(range(100))) == OK
    end = ptr + len(b) - 8
    assert store.get_into_ranges([end], [["tail"]], [[[0, 4]]], [[[10, 20]]], [[[4, 4]]]) == [
        [[4, 4]]]
    assert bytes(b[len(b) - 8 :]) == bytes([10, 11, 12, 13, 20, 21, 22, 23])
    assert store.get_into_ranges([end], [["tail"]], [[[5]]], [[[0]]], [[[4]]]) == [
        [[INVALID_PARAMS]]]
    # one key named under two buffers is read once and serves both
    assert store.get_into_ranges([ptr, ptr + 50], [["tail"], ["tail", "nope"]],
                                 [[[0]], [[0], [10]]], [[[99]], [[0], [0]]],
                                 [[[1]], [[2], [1]]]) == [[[1]], [[2], [OBJECT_NOT_FOUND]]]
    assert b[0] == 99 and bytes(b[50:52]) == b"\x00\x01"


def test_cluster_session_put_keeps_replicas(cluster_addrs: list[str]) -> None:
    s = MooncakeDistributedStore()
    assert s.setup({**_setup_dict(",".join(cluster_addrs)), "replicas": 2}) == OK
    three = ReplicateConfig()
    three.replica_num = 3
    try:
        assert s.batch_put_session_start(["cs/two"], [64]) == [OK]
        assert s.batch_put_session_start(["cs/three"], [64], three) == [OK]
        assert s.batch_put_session_end(["cs/two", "cs/three"]) == [OK, OK]
        members = [Member(node_id=NodeId(a), addr=a) for a in cluster_addrs]
        with Client(members=members, replicas=2) as direct:
            holders = direct.holders([mooncake_key("cs/two"), mooncake_key("cs/three")])
            assert [len(h) for h in holders] == [2, 3]
        assert s.remove_all() == 2
    finally:
        s.close()


def test_concurrent_layers_into_one_session(store: MooncakeDistributedStore,
                                            buf: tuple[ctypes.Array, int]) -> None:
    """Eight threads write their own layer of the same two objects at once (released
    together by a barrier); end publishes every byte."""
    b, ptr = buf
    layers, width = 8, 4096
    for i in range(layers * width):
        b[i] = (i // width * 31 + i) % 256
    keys = ["conc/a", "conc/b"]
    assert store.batch_put_session_start(keys, [layers * width] * 2) == [OK, OK]
    barrier = threading.Barrier(layers)
    results: list[list[int]] = [[] for _ in range(layers)]

    def write(layer: int) -> None:
        barrier.wait()
        src = ptr + layer * width
        results[layer] = store.batch_put_from_multi_buffer_ranges(
            keys, [[src], [src]], [[width], [width]], [[layer * width], [layer * width]])

    threads = [threading.Thread(target=write, args=(lay,)) for lay in range(layers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert results == [[width, width]] * layers
    assert store.batch_put_session_end(keys) == [OK, OK]
    want = bytes(b[0 : layers * width])
    assert store.get_batch(keys) == [want, want]
