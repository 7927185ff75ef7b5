"""The Mooncake-compatible module against real node processes: one node and a 3-node
static-member cluster (replicas=2)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import mooncake_scenario
import numpy as np
import pytest
import torch
import xxhash
from conftest import free_port, start_node, start_static_cluster, wait_until

from kvstore import Client, namespace_root_key
from kvstore.integrations.mooncake.store import (
    INVALID_PARAMS,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    BufferHandle,
    MooncakeDistributedStore,
    ReplicateConfig,
    mooncake_key,
)
from replication.placement.rendezvous import Member, NodeId

if TYPE_CHECKING:
    from replication.membership.etcd_server import EtcdServer

pytest_plugins = ["etcd_fixtures"]
MiB = 1 << 20


@pytest.fixture(scope="module")
def single_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    node = start_node(tmp_path_factory.mktemp("mc-single"))
    yield node.addr
    node.stop()


@pytest.fixture(scope="module")
def cluster_addrs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    tmp = tmp_path_factory.mktemp("mc-cluster")
    nodes = start_static_cluster(tmp, 3)
    yield [n.addr for n in nodes]
    for n in nodes:
        n.stop()


def _members(addrs: list[str]) -> list[Member]:
    return [Member(node_id=NodeId(a), addr=a) for a in addrs]


@pytest.fixture(params=["single", "cluster"])
def store(request: pytest.FixtureRequest) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    if request.param == "single":
        target = request.getfixturevalue("single_addr")
    else:
        target = ",".join(request.getfixturevalue("cluster_addrs"))
    assert s.setup("localhost", "P2PHANDSHAKE", 512 * MiB, 128 * MiB, "tcp", "", target,
                   replicas=2) == OK
    yield s
    s.remove_all()
    s.close()


def _uid(request: pytest.FixtureRequest, name: str) -> str:
    return f"{request.node.name}/{name}"


# ---- key mapping and setup ------------------------------------------------------------------


def test_key_mapping_is_the_documented_hash() -> None:
    key = "vllm@model@tp0@" + "é" * 300  # any length, any characters
    want = xxhash.xxh3_128(b"kvstore-mooncake-v1\x00" + key.encode()).digest()
    assert mooncake_key(key) == want and len(want) == 16
    assert mooncake_key(key.encode()) == want  # bytes keys as pybind passes them
    assert mooncake_key("a") != mooncake_key("b")
    assert mooncake_key("m") != namespace_root_key("m")


def test_setup_errors_and_fallbacks(single_addr: str, caplog: pytest.LogCaptureFixture) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("h", "http://x/metadata", 1, 1, "tcp", "", "") == INVALID_PARAMS
    assert s.setup("h", "", 1, 1, "tcp", "", f"127.0.0.1:{free_port()}") == RPC_FAIL
    with caplog.at_level(logging.WARNING):
        assert s.setup("h:123", "http://x/metadata", 1, 1, "rdma", "mlx5_0",
                       master_server_address=single_addr) == OK
    assert "no rdma transport" in caplog.text
    assert s.get_hostname() == "h:123"
    assert s.put("k", b"v") == OK and s.get("k") == b"v"
    assert s.remove_all() == 1
    assert s.close() == OK
    assert s.close() == OK


def test_not_set_up_follows_the_conventions() -> None:
    s = MooncakeDistributedStore()
    assert s.put("k", b"v") == INVALID_PARAMS
    assert s.get("k") == b""
    assert s.is_exist("k") == -1
    assert s.batch_is_exist(["a", "b"]) == [-1, -1]
    assert s.get_buffer("k") is None
    assert s.remove("k") == INVALID_PARAMS
    assert s.remove_all() == -1
    assert s.close() == OK


# ---- every method, single node and cluster --------------------------------------------------


def test_copying_api(store: MooncakeDistributedStore, request: pytest.FixtureRequest) -> None:
    k1, k2, missing = (_uid(request, n) for n in ("k1", "k2", "missing"))
    value = np.random.default_rng(1).integers(0, 256, 100_000, dtype=np.uint8).tobytes()
    assert store.put(k1, value) == OK
    assert store.put(k1, value) == OK  # an existing key is success, as in Mooncake
    assert store.get(k1) == value
    assert store.get(missing) == b""
    assert store.is_exist(k1) == 1 and store.is_exist(missing) == 0
    assert store.put_batch([k2, missing + "x"], [b"two", bytearray(b"three")]) == OK
    assert store.batch_is_exist([k1, missing, k2]) == [1, 0, 1]
    assert store.get_batch([k2, missing, k1]) == [b"two", b"", value]
    assert store.get_size(k2) == 3 and store.get_size(missing) == OBJECT_NOT_FOUND
    assert store.put(missing + "empty", b"") == INVALID_PARAMS
    assert store.put_batch([k1], [b"a", b"b"]) == INVALID_PARAMS
    assert store.remove(k2) == OK
    assert store.remove(k2) == OBJECT_NOT_FOUND
    assert store.batch_remove([missing + "x", missing]) == [OK, OBJECT_NOT_FOUND]
    assert store.is_exist(k2) == 0 and store.get(k2) == b""


def test_put_parts_and_buffers(store: MooncakeDistributedStore,
                               request: pytest.FixtureRequest) -> None:
    k, missing = _uid(request, "greeting"), _uid(request, "missing")
    arr = np.arange(10, dtype=np.int32)
    assert store.put_parts(k, b"Hello, ", memoryview(b"World!"), arr) == OK
    want = b"Hello, World!" + arr.tobytes()
    assert store.get(k) == want
    handle = store.get_buffer(k)
    assert isinstance(handle, BufferHandle)
    assert handle.size() == len(handle) == len(want) and bytes(handle) == want
    assert np.asarray(memoryview(handle)).tobytes() == want
    assert (np.ctypeslib.as_array((np.ctypeslib.ctypes.c_uint8 * len(want))
                                  .from_address(handle.ptr())).tobytes() == want)
    assert store.get_buffer(missing) is None
    handles = store.batch_get_buffer([missing, k])
    assert handles[0] is None and bytes(handles[1]) == want
    assert store.put_parts(k + "bad", b"x", 3) == INVALID_PARAMS


def test_zero_copy_numpy_round_trip(store: MooncakeDistributedStore,
                                    request: pytest.FixtureRequest) -> None:
    rng = np.random.default_rng(2)
    src = rng.integers(0, 256, 4 * MiB, dtype=np.uint8)
    dst = np.zeros(4 * MiB, dtype=np.uint8)
    for a in (src, dst):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == OK
    base, out = src.ctypes.data, dst.ctypes.data
    keys = [_uid(request, f"blk{i}") for i in range(4)]
    size = MiB
    assert store.put_from(keys[0], base, size) == OK
    assert store.get_into(keys[0], out, size) == size
    assert np.array_equal(dst[:size], src[:size])
    assert store.batch_put_from(keys[1:], [base + i * size for i in (1, 2, 3)],
                                [size] * 3) == [OK] * 3
    dst[:] = 0
    got = store.batch_get_into(keys[::-1], [out + i * size for i in range(4)], [size] * 4)
    assert got == [size] * 4
    for i in range(4):
        assert np.array_equal(dst[i * size : (i + 1) * size],
                              src[(3 - i) * size : (4 - i) * size])
    # a buffer larger than the value: bytes read is the value's length
    assert store.get_into(keys[0], out, 2 * size) == size
    assert store.unregister_buffer(base) == OK and store.unregister_buffer(out) == OK


def test_zero_copy_torch_tensors(store: MooncakeDistributedStore,
                                 request: pytest.FixtureRequest) -> None:
    torch.manual_seed(0)
    # a KV-cache-like layout: [layers, blocks, block_bytes] in bf16
    src = torch.randn(2, 8, 4096, dtype=torch.bfloat16)
    dst = torch.zeros_like(src)
    for t in (src, dst):
        assert store.register_buffer(t.data_ptr(), t.numel() * t.element_size()) == OK
    block = src[0, 0].numel() * src.element_size()
    keys = [_uid(request, f"b{i}") for i in range(8)]
    ptrs = [src[0, i].data_ptr() for i in range(8)]
    assert store.batch_put_from(keys, ptrs, [block] * 8) == [OK] * 8
    assert store.batch_get_into(keys, [dst[1, i].data_ptr() for i in range(8)],
                                [block] * 8) == [block] * 8
    assert torch.equal(dst[1], src[0])
    assert store.get(keys[3]) == src[0, 3].view(torch.uint8).numpy().tobytes()
    assert store.unregister_buffer(src.data_ptr()) == OK
    assert store.unregister_buffer(dst.data_ptr()) == OK


def test_buffers_outside_registered_memory(store: MooncakeDistributedStore,
                                           request: pytest.FixtureRequest) -> None:
    reg = np.arange(4096, dtype=np.uint8)
    other = np.zeros(4096, dtype=np.uint8)
    p = reg.ctypes.data
    assert store.register_buffer(p, reg.nbytes) == OK
    k, missing = _uid(request, "k"), _uid(request, "missing")
    assert store.put_from(k, other.ctypes.data, 100) == INVALID_PARAMS  # never registered
    assert store.put_from(k, p + 4000, 200) == INVALID_PARAMS  # runs past the end
    assert store.is_exist(k) == 0
    assert store.put_from(k, p, 1000) == OK
    assert store.get_into(k, other.ctypes.data, 1000) == INVALID_PARAMS
    assert store.get_into(k, p + 2000, 999) == INVALID_PARAMS  # value larger than buffer
    assert store.get_into(missing, p + 2000, 1000) == OBJECT_NOT_FOUND
    # per-key codes in one batch: good, unregistered, too small, missing, good
    codes = store.batch_get_into([k, k, k, missing, k],
                                 [p + 1000, other.ctypes.data, p + 2000, p + 3000, p + 3000],
                                 [1000, 1000, 10, 1000, 1000])
    assert codes == [1000, INVALID_PARAMS, INVALID_PARAMS, OBJECT_NOT_FOUND, 1000]
    first = (np.arange(1000) % 256).astype(np.uint8)
    assert np.array_equal(reg[1000:2000], first) and np.array_equal(reg[3000:4000], first)
    assert store.batch_put_from([k + "a", k + "b"], [p, other.ctypes.data],
                                [10, 10]) == [OK, INVALID_PARAMS]
    assert store.batch_put_from([k], [p, p], [1, 1]) == [INVALID_PARAMS]
    assert store.batch_get_into([k, k], [p], [1]) == [INVALID_PARAMS] * 2
    assert store.register_buffer(0, 10) == INVALID_PARAMS
    assert store.unregister_buffer(p) == OK
    assert store.unregister_buffer(p) == INVALID_PARAMS
    assert store.get_into(k, p, 4096) == INVALID_PARAMS  # no longer registered


def test_multi_buffer_variants(store: MooncakeDistributedStore,
                               request: pytest.FixtureRequest) -> None:
    rng = np.random.default_rng(3)
    layers, chunk = 4, 8192
    src = rng.integers(0, 256, (layers, 2, chunk), dtype=np.uint8)
    adj = np.zeros(layers * chunk, dtype=np.uint8)  # one key's chunks side by side
    gap = np.zeros((layers, 2, chunk), dtype=np.uint8)  # non-adjacent chunks
    for a in (src, adj, gap):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == OK
    keys = [_uid(request, "k0"), _uid(request, "k1")]
    # each key gathers its chunk from every layer (non-adjacent source buffers)
    ptrs = [[src[layer, b].ctypes.data for layer in range(layers)] for b in range(2)]
    sizes = [[chunk] * layers for _ in range(2)]
    assert store.batch_put_from_multi_buffers(keys, ptrs, sizes) == [OK, OK]
    want = [b"".join(src[layer, b].tobytes() for layer in range(layers)) for b in range(2)]
    assert store.get_batch(keys) == want
    # into adjacent buffers (zero copy) and into scattered ones (staged)
    adj_ptrs = [[adj.ctypes.data + i * chunk for i in range(layers)]]
    assert store.batch_get_into_multi_buffers(keys[:1], adj_ptrs, [[chunk] * layers]) == \
        [layers * chunk]
    assert adj.tobytes() == want[0]
    gap_ptrs = [[gap[layer, b].ctypes.data for layer in range(layers)] for b in range(2)]
    assert store.batch_get_into_multi_buffers(keys, gap_ptrs, sizes, True) == \
        [layers * chunk] * 2
    assert np.array_equal(gap, src)
    # adjacent source buffers are one zero-copy value as well
    assert store.batch_put_from_multi_buffers([keys[0] + "adj"], adj_ptrs,
                                              [[chunk] * layers]) == [OK]
    assert store.get(keys[0] + "adj") == want[0]
    # errors per key: missing, buffers smaller than the value, unregistered, bad shapes
    missing = _uid(request, "missing")
    small = [[gap[0, 0].ctypes.data], [gap[0, 1].ctypes.data]]
    assert store.batch_get_into_multi_buffers([missing, keys[1]], small,
                                              [[chunk], [chunk]]) == \
        [OBJECT_NOT_FOUND, INVALID_PARAMS]
    stray = np.zeros(chunk, dtype=np.uint8)
    assert store.batch_put_from_multi_buffers([missing], [[stray.ctypes.data]],
                                              [[chunk]]) == [INVALID_PARAMS]
    assert store.batch_get_into_multi_buffers(keys, [[1, 2]], [[1]]) == [INVALID_PARAMS] * 2
    assert store.batch_put_from_multi_buffers(keys, [[1], [2]], [[1, 1], [1]]) == \
        [INVALID_PARAMS] * 2
    for a in (src, adj, gap):
        assert store.unregister_buffer(a.ctypes.data) == OK


def test_remove_all_removes_what_this_instance_wrote(
        store: MooncakeDistributedStore, request: pytest.FixtureRequest) -> None:
    keys = [_uid(request, f"k{i}") for i in range(5)]
    for k in keys:
        assert store.put(k, k.encode()) == OK
    assert store.remove(keys[0]) == OK
    assert sorted(store.written_keys()) == sorted(keys[1:])
    assert store.remove_all() == 4
    assert store.batch_is_exist(keys) == [0] * 5
    assert store.remove_all() == 0


def test_concurrent_zero_copy(store: MooncakeDistributedStore,
                              request: pytest.FixtureRequest) -> None:
    n, size = 8, 64 * 1024
    src = np.random.default_rng(4).integers(0, 256, (n, size), dtype=np.uint8)
    dst = np.zeros_like(src)
    for a in (src, dst):
        assert store.register_buffer(a.ctypes.data, a.nbytes) == OK
    errors: list[object] = []

    def work(i: int) -> None:
        k = _uid(request, f"t{i}")
        for _ in range(5):
            if store.put_from(k, src[i].ctypes.data, size) != OK:
                errors.append(("put", i))
            if store.get_into(k, dst[i].ctypes.data, size) != size:
                errors.append(("get", i))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == [] and np.array_equal(src, dst)


# ---- cluster specifics ----------------------------------------------------------------------


def test_cluster_replicas_and_replicate_config(cluster_addrs: list[str]) -> None:
    s = MooncakeDistributedStore()
    assert s.setup("localhost", "", 0, 0, "tcp", "", ",".join(cluster_addrs), replicas=2) == OK
    cfg3 = ReplicateConfig()
    cfg3.replica_num = 3
    cfg1 = ReplicateConfig()
    pinned = ReplicateConfig()
    pinned.replica_num, pinned.with_hard_pin = 2, True
    try:
        assert s.put("rc/default", b"d" * 1000) == OK
        assert s.put("rc/three", b"t" * 1000, cfg3) == OK
        assert s.put_from("rc/one", 0, 1, cfg1) == INVALID_PARAMS
        assert s.put("rc/one", b"o" * 1000, cfg1) == OK
        assert s.put("rc/pinned", b"p" * 1000, pinned) == OK
        with Client(members=_members(cluster_addrs), replicas=2) as direct:
            holders = direct.holders([mooncake_key(k) for k in
                                      ("rc/default", "rc/three", "rc/one", "rc/pinned")])
            assert [len(h) for h in holders] == [2, 3, 1, 2]
            # the same data is visible to a plain kvstore client under the mapped key
            assert direct.get(mooncake_key("rc/three")) == b"t" * 1000
        assert s.remove_all() == 4
    finally:
        s.close()


def test_injected_cluster_client(cluster_addrs: list[str]) -> None:
    client = Client(members=_members(cluster_addrs), replicas=2)
    s = MooncakeDistributedStore(client=client)
    assert s.setup("me", "", 0, 0, "tcp", "", "ignored:1") == OK
    assert s.get_hostname() == "me"
    assert s.put("inj/k", b"value") == OK
    assert s.get("inj/k") == b"value"
    assert len(client.holders([mooncake_key("inj/k")])[0]) == 2
    assert s.remove_all() == 1
    assert s.close() == OK
    assert s.get("inj/k") == b""  # closed


def test_etcd_cluster_from_the_metadata_server(etcd: EtcdServer, tmp_path: Path) -> None:
    nodes = [start_node(tmp_path, "--etcd", etcd.endpoint, "--node-id", f"n{i}")
             for i in range(2)]
    s = MooncakeDistributedStore()
    try:
        # master_server_addr empty: the etcd named as Mooncake's metadata server is used
        assert s.setup("localhost", f"etcd://{etcd.endpoint}", 0, 0, "tcp", "", "",
                       replicas=2) == OK
        wait_until(lambda: s.put("etcd/k", b"v" * 100) == OK, what="two live nodes")
        assert s.get("etcd/k") == b"v" * 100 and s.is_exist("etcd/k") == 1
        with Client(etcd=etcd.endpoint) as direct:
            assert len(direct.holders([mooncake_key("etcd/k")])[0]) == 2
        assert s.remove_all() == 1
    finally:
        s.close()
        for n in nodes:
            n.stop()


# ---- the whole 0.3.13 surface -----------------------------------------------------------------

def test_every_0_3_13_method_exists_or_refuses_with_its_reason() -> None:
    from kvstore.integrations.mooncake.unsupported import UNSUPPORTED

    WHEEL_METHODS = mooncake_scenario.WHEEL_METHODS

    assert len(WHEEL_METHODS) == 98
    missing = [n for n in WHEEL_METHODS
               if not callable(getattr(MooncakeDistributedStore, n, None))]
    assert missing == []
    assert set(UNSUPPORTED) <= set(WHEEL_METHODS)
    s = MooncakeDistributedStore()
    for name, reason in UNSUPPORTED.items():
        with pytest.raises(NotImplementedError) as info:
            getattr(s, name)("k", 1, 2)
        assert str(info.value) == (f"MooncakeDistributedStore.{name} is not supported by "
                                   f"kvstore: {reason}")
    assert len(UNSUPPORTED) == 52  # so 46 methods work


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_cuda_reads_without_cuda_fail_clearly(store: MooncakeDistributedStore,
                                             caplog: pytest.LogCaptureFixture) -> None:
    assert store.put("cuda/k", b"x" * 16) == OK
    t = torch.zeros(4, dtype=torch.float32)
    with caplog.at_level(logging.ERROR):
        assert store.get_tensor_into_cuda("cuda/k", t) == INVALID_PARAMS
        assert store.batch_get_tensor_into_cuda(["cuda/k", "x"], [t, t]) == [INVALID_PARAMS] * 2
    assert ("batch_get_tensor_into_cuda is not available here: no CUDA device "
            "(torch.cuda.is_available() is False)") in caplog.text
    assert torch.count_nonzero(t) == 0


def test_soft_pin_enable_retains_through_eviction(tmp_path: Path) -> None:
    """ENABLE with a TTL becomes kvstore retention: filling an 8 MiB node twice over evicts
    the ordinary and the DISABLE'd object and keeps the soft-pinned one."""
    from kvstore.integrations.mooncake.store import SoftPinAction

    node = start_node(tmp_path, dram="8MiB")
    s = MooncakeDistributedStore()
    try:
        assert s.setup("h", "", 0, 0, "tcp", "", node.addr) == OK
        keep = ReplicateConfig()
        keep.soft_pin_action, keep.soft_pin_ttl_ms = SoftPinAction.ENABLE, 600_000
        off = ReplicateConfig()
        off.soft_pin_action = SoftPinAction.DISABLE
        assert s.put("ret/keep", b"k" * 1000, keep) == OK
        assert s.put("ret/plain", b"p" * 1000) == OK
        assert s.put("ret/off", b"o" * 1000, off) == OK
        filler = b"f" * (1 << 20)
        assert s.put_batch([f"ret/fill{i}" for i in range(16)], [filler] * 16) == OK
        assert s.batch_is_exist(["ret/keep", "ret/plain", "ret/off"]) == [1, 0, 0]
        assert s.get("ret/keep") == b"k" * 1000
    finally:
        s.close()
        node.stop()
