"""kvstore as SGLang's HiCache L3 storage, with SGLang's own classes and a real node.

Runs in the SGLang environment (``make test-sglang``; ``scripts/setup-sglang-env.sh``).
Where SGLang is not installed (the main ``.venv``) this module collects no test; with
``KVSTORE_SGLANG_TESTS=1`` (set by ``make test-sglang``) a missing SGLang fails the run.

The backend is created as SGLang's cache controller creates it
(``StorageBackendFactory.create_backend("dynamic", ...)``, then
``register_mem_pool_host``) over a real ``MHATokenToKVPoolHost`` sized from a real
``MHATokenToKVPool`` on CPU. SGLang's device-to-host copy kernels are CUDA-only, so
the tests copy device rows into host pages with torch indexing (``to_host``).
"""

from __future__ import annotations

import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
import main_conftest
import sglang_fixtures as sf

if sf.REQUIRED and not sf.HAVE_SGLANG:
    raise ImportError(
        f"KVSTORE_SGLANG_TESTS=1 but SGLang is not importable from {sys.executable}: build "
        "the engine environment with scripts/setup-sglang-env.sh (make test-sglang does)")

LAYOUTS = ["layer_first", "page_first", "page_first_direct", "page_head"]
ALLOCATORS = ["default", "shm"]


def _keys(n: int) -> list[str]:
    tag = uuid.uuid4().hex[:8]
    return [f"{tag}{i:056x}" for i in range(n)]  # 64 hex chars, as SGLang's page hashes


def to_host(host, kv, host_idx, dev_idx) -> None:
    """Copies device rows ``dev_idx`` into host slots ``host_idx`` (any MHA layout)."""
    p = host.page_size
    for layer in range(kv.layer_num):
        for dst, src in ((host.k_buffer, kv.k_buffer[layer]), (host.v_buffer, kv.v_buffer[layer])):
            rows = src[dev_idx]
            if host.layout == "layer_first":
                dst[layer, host_idx] = rows
            elif host.layout == "page_first":
                dst[host_idx, layer] = rows
            elif host.layout == "page_first_direct":
                dst[host_idx // p, layer, host_idx % p] = rows
            else:  # page_head
                dst[host_idx // p, :, host_idx % p, layer] = rows


def from_host(host, kv, host_idx) -> list:
    """The rows of host slots ``host_idx``, per layer and K/V, as device-shaped tensors."""
    p = host.page_size
    out = []
    for layer in range(kv.layer_num):
        for src in (host.k_buffer, host.v_buffer):
            if host.layout == "layer_first":
                out.append(src[layer, host_idx].clone())
            elif host.layout == "page_first":
                out.append(src[host_idx, layer].clone())
            elif host.layout == "page_first_direct":
                out.append(src[host_idx // p, layer, host_idx % p].clone())
            else:
                out.append(src[host_idx // p, :, host_idx % p, layer].clone())
    return out


def device_rows(kv, dev_idx) -> list:
    return [buf[layer][dev_idx].clone() for layer in range(kv.layer_num)
            for buf in (kv.k_buffer, kv.v_buffer)]


def assert_bytes_equal(got: list, want: list) -> None:
    import torch

    assert len(got) == len(want)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        assert torch.equal(g.contiguous().view(torch.uint8), w.contiguous().view(torch.uint8))


@pytest.fixture(scope="module")
def sgl() -> None:
    sf.import_torchvision_without_ops()


@pytest.fixture(scope="module")
def node(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    n = main_conftest.main.start_node(tmp_path_factory.mktemp("sgl-node"), dram="256MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


@pytest.fixture(scope="module")
def kv(sgl):
    """A real device pool on CPU, filled with random rows."""
    import torch

    pool = sf.device_pool()
    g = torch.Generator().manual_seed(7)
    for layer in range(pool.layer_num):
        for buf in (pool.k_buffer[layer], pool.v_buffer[layer]):
            buf.copy_(torch.randn(buf.shape, generator=g).to(buf.dtype))
    return pool


class TestSGLangHiCache:
    __test__ = sf.HAVE_SGLANG  # no test at all where SGLang is not installed

    @pytest.mark.parametrize("allocator", ALLOCATORS)
    @pytest.mark.parametrize("layout", LAYOUTS)
    def test_pages_round_trip_byte_exact(self, node, kv, layout, allocator):
        import torch

        from kvstore.integrations.sglang_hicache import KVStoreHiCacheStorage

        host = sf.host_pool(kv, layout, allocator)
        backend = sf.create_backend(sf.dynamic_extra(node.addr, allocator=allocator), host)
        try:
            assert isinstance(backend, KVStoreHiCacheStorage)
            assert backend.mem_pool_host is host
            assert backend.client.transport == "shm"  # same host: the node's memfd region
            if allocator == "shm":
                assert host.allocator.fd is not None
                assert backend.memory_source() == "memfd"
            else:
                assert backend.memory_source() == "address"

            pages = 4
            keys = _keys(pages)
            dev = torch.arange(32, 32 + pages * sf.PAGE)
            src = host.alloc(pages * sf.PAGE)
            to_host(host, kv, src, dev)
            assert_bytes_equal(from_host(host, kv, src), device_rows(kv, dev))

            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, src) == [False] * pages
            assert backend.batch_set_v1(keys, src) == [True] * pages
            assert backend.batch_exists(keys) == pages
            assert backend.exists(keys[0])

            # other slots, first overwritten with device row 0, then loaded from kvstore
            dst = host.alloc(pages * sf.PAGE)
            to_host(host, kv, dst, torch.zeros_like(dst))
            assert backend.batch_get_v1(keys, dst) == [True] * pages
            assert_bytes_equal(from_host(host, kv, dst), device_rows(kv, dev))
            for i in range(pages):
                a = host.get_data_page(int(src[i * sf.PAGE]), flat=True)
                b = host.get_data_page(int(dst[i * sf.PAGE]), flat=True)
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
        finally:
            backend.close()

    def test_prefix_counts_and_per_page_results(self, node, kv):
        import torch

        host = sf.host_pool(kv, "page_first", "shm")
        backend = sf.create_backend(sf.dynamic_extra(node.addr, allocator="shm"), host)
        try:
            keys = _keys(4)
            src = host.alloc(4 * sf.PAGE)
            to_host(host, kv, src, torch.arange(100, 100 + 4 * sf.PAGE))
            stored = [0, 1, 3]
            sel = torch.cat([src[i * sf.PAGE : (i + 1) * sf.PAGE] for i in stored])
            assert backend.batch_set_v1([keys[i] for i in stored], sel) == [True] * 3
            assert backend.batch_exists(keys) == 2  # leading pages only
            assert backend.batch_exists(keys[3:]) == 1
            dst = host.alloc(4 * sf.PAGE)
            assert backend.batch_get_v1(keys, dst) == [True, True, False, True]
            # pages already stored are not sent again
            n = backend.written_keys()
            assert backend.batch_set_v1(keys[:2], src[: 2 * sf.PAGE]) == [True, True]
            assert backend.written_keys() == n
            assert backend.batch_set_v1([], src[:0]) == []
            assert backend.batch_exists([]) == 0
        finally:
            backend.close()

    def test_another_server_reads_and_shards_stay_apart(self, node, kv):
        """A second backend (a restarted or another server: new client, new host pool)
        loads the pages; another TP rank, layout or model sees none of them."""
        import torch

        dev = torch.arange(200, 200 + 2 * sf.PAGE)
        keys = _keys(2)
        host_a = sf.host_pool(kv, "page_first", "shm")
        a = sf.create_backend(sf.dynamic_extra(node.addr, allocator="shm"), host_a)
        src = host_a.alloc(2 * sf.PAGE)
        to_host(host_a, kv, src, dev)
        assert a.batch_set_v1(keys, src) == [True, True]
        a.close()

        host_b = sf.host_pool(kv, "page_first", "default")
        b = sf.create_backend(sf.dynamic_extra(node.addr), host_b)
        try:
            assert b.batch_exists(keys) == 2
            dst = host_b.alloc(2 * sf.PAGE)
            assert b.batch_get_v1(keys, dst) == [True, True]
            assert_bytes_equal(from_host(host_b, kv, dst), device_rows(kv, dev))
        finally:
            b.close()
        others = [(dict(tp_rank=1, tp_size=2), "page_first"),
                  (dict(tp_rank=0, tp_size=2), "page_first"),
                  (dict(model="another-model"), "page_first"),
                  ({}, "page_first_direct")]
        for cfg, layout in others:
            host = sf.host_pool(kv, layout, "default")
            c = sf.create_backend(sf.dynamic_extra(node.addr), host, **cfg)
            try:
                assert c.batch_exists(keys) == 0, (cfg, layout)
            finally:
                c.close()

    def test_tcp_transport_round_trip(self, node, kv):
        import torch

        host = sf.host_pool(kv, "layer_first", "shm")
        backend = sf.create_backend(
            sf.dynamic_extra(node.addr, allocator="shm", kvstore_transport="tcp"), host)
        try:
            assert backend.client.transport == "tcp"
            keys = _keys(3)
            dev = torch.arange(300, 300 + 3 * sf.PAGE)
            src = host.alloc(3 * sf.PAGE)
            to_host(host, kv, src, dev)
            assert backend.batch_set_v1(keys, src) == [True] * 3
            dst = host.alloc(3 * sf.PAGE)
            assert backend.batch_get_v1(keys, dst) == [True] * 3
            assert_bytes_equal(from_host(host, kv, dst), device_rows(kv, dev))
        finally:
            backend.close()

    def test_copy_interface_without_v1(self, node, kv):
        """Without ``interface_v1`` SGLang calls batch_set / batch_get with flat pages."""
        import torch

        host = sf.host_pool(kv, "page_first", "default")
        extra = sf.dynamic_extra(node.addr)
        del extra["interface_v1"]
        backend = sf.create_backend(extra, host)
        try:
            keys = _keys(2)
            src = host.alloc(2 * sf.PAGE)
            to_host(host, kv, src, torch.arange(400, 400 + 2 * sf.PAGE))
            pages = [host.get_data_page(int(src[i * sf.PAGE])) for i in range(2)]
            assert not backend.exists(keys[0])
            assert backend.batch_set(keys, pages)
            assert backend.exists(keys[0]) and backend.batch_exists(keys) == 2
            outs = [host.get_dummy_flat_data_page() for _ in keys]
            got = backend.batch_get(keys, outs)
            for g, want in zip(got, pages, strict=True):
                assert g is not None
                assert torch.equal(g.view(torch.uint8), want.view(torch.uint8))
            assert backend.get(_keys(1)[0], host.get_dummy_flat_data_page()) is None
            whole = backend.batch_get(keys)
            assert whole[0] is not None
            assert torch.equal(whole[0], pages[0].contiguous().view(torch.uint8))
        finally:
            backend.close()

    def test_v2_pool_transfers_and_clear(self, node, kv):
        """The v2 calls (hybrid models): the KV pool plus a sidecar pool."""
        import torch
        from sglang.srt.mem_cache.hicache_storage import PoolHitPolicy, PoolName, PoolTransfer

        host = sf.host_pool(kv, "page_first", "shm")
        side = sf.host_pool(kv, "page_first", "default")
        backend = sf.create_backend(sf.dynamic_extra(node.addr, allocator="shm"), host)
        backend.register_mem_host_pool_v2(host, PoolName.KV)
        backend.register_mem_host_pool_v2(side, PoolName.SWA)
        try:
            keys = _keys(3)
            src = host.alloc(3 * sf.PAGE)
            to_host(host, kv, src, torch.arange(440, 440 + 3 * sf.PAGE))
            s_src = side.alloc(sf.PAGE)  # the sidecar holds only the last page
            to_host(side, kv, s_src, torch.arange(60, 60 + sf.PAGE))
            res = backend.batch_set_v2([
                PoolTransfer(name=PoolName.KV, host_indices=src, keys=keys),
                PoolTransfer(name=PoolName.SWA, host_indices=s_src, keys=keys[2:])])
            assert res == {"kv": [True] * 3, "swa": [True]}
            hit = backend.batch_exists_v2(keys, [PoolTransfer(
                name=PoolName.SWA, keys=keys[2:], hit_policy=PoolHitPolicy.TRAILING_PAGES)])
            assert hit.kv_hit_pages == 3
            assert hit.extra_pool_hit_pages == {"kv": 3, "swa": 3}
            hit_all = backend.batch_exists_v2(keys, [PoolTransfer(
                name=PoolName.SWA, keys=keys, hit_policy=PoolHitPolicy.ALL_PAGES)])
            assert hit_all.kv_hit_pages == 0
            s_dst = side.alloc(sf.PAGE)
            dst = host.alloc(3 * sf.PAGE)
            res = backend.batch_get_v2([
                PoolTransfer(name=PoolName.KV, host_indices=dst, keys=keys),
                PoolTransfer(name=PoolName.SWA, host_indices=s_dst, keys=keys[2:])])
            assert res == {"kv": [True] * 3, "swa": [True]}
            assert_bytes_equal(from_host(host, kv, dst), from_host(host, kv, src))
            assert_bytes_equal(from_host(side, kv, s_dst), from_host(side, kv, s_src))

            assert backend.written_keys() == 3 * 2 + 2
            assert backend.clear() is True
            assert backend.written_keys() == 0
            assert backend.batch_exists(keys) == 0
        finally:
            backend.close()

    def test_node_down_gives_false_not_errors(self, tmp_path, kv):
        import torch

        down = main_conftest.main.start_node(tmp_path, dram="64MiB")
        host = sf.host_pool(kv, "page_first", "shm")
        backend = sf.create_backend(
            sf.dynamic_extra(down.addr, allocator="shm", kvstore_timeout=2.0), host)
        try:
            keys = _keys(2)
            src = host.alloc(2 * sf.PAGE)
            to_host(host, kv, src, torch.arange(480, 480 + 2 * sf.PAGE))
            assert backend.batch_set_v1(keys, src) == [True, True]
            assert down.stop() == 0
            assert backend.batch_exists(keys) == 0
            assert backend.batch_get_v1(keys, host.alloc(2 * sf.PAGE)) == [False, False]
            assert backend.batch_set_v1(_keys(2), src) == [False, False]
        finally:
            backend.close()
            if down.proc.poll() is None:
                down.stop()

    def test_config_errors(self, sgl):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        extra = sf.dynamic_extra("")
        del extra["kvstore_addr"]
        with pytest.raises(ValueError, match="kvstore_addr"):
            StorageBackendFactory.create_backend("dynamic", sf.storage_config(extra), None)


def documented_launch_command() -> list[str]:
    """The SGLang command line of docs/engines/sglang.md."""
    import shlex

    page = Path(__file__).resolve().parents[2] / "docs" / "engines" / "sglang.md"
    block = page.read_text().split("```bash\n", 1)[1].split("```", 1)[0]
    return shlex.split(block.replace("\\\n", " "))


class TestSGLangDocumentedConfig:
    __test__ = sf.HAVE_SGLANG

    def test_documented_command_parses_and_works(self, node, kv):
        """SGLang's own argument parser takes the documented flags; the extra config it
        yields (address pointed at the test node) builds a working backend."""
        import argparse
        import json

        import torch
        from sglang.srt.server_args import ServerArgs

        argv = documented_launch_command()
        assert argv[:3] == ["python", "-m", "sglang.launch_server"]
        parser = argparse.ArgumentParser()
        ServerArgs.add_cli_args(parser)
        args = parser.parse_args(argv[3:])
        assert args.enable_hierarchical_cache
        assert args.hicache_storage_backend == "dynamic"
        extra = json.loads(args.hicache_storage_backend_extra_config)
        assert extra["interface_v1"] == 1 and extra["allocator"] == "shm"
        extra["kvstore_addr"] = node.addr
        host = sf.host_pool(kv, args.hicache_mem_layout, extra["allocator"])
        backend = sf.create_backend(extra, host)
        try:
            assert backend.memory_source() == "memfd"
            keys = _keys(2)
            dev = torch.arange(64, 64 + 2 * sf.PAGE)
            src = host.alloc(2 * sf.PAGE)
            to_host(host, kv, src, dev)
            assert backend.batch_set_v1(keys, src) == [True, True]
            dst = host.alloc(2 * sf.PAGE)
            assert backend.batch_get_v1(keys, dst) == [True, True]
            assert_bytes_equal(from_host(host, kv, dst), device_rows(kv, dev))
        finally:
            backend.close()


CLUSTER_ARGS = ["--dram-bytes", "128MiB", "--no-prefault", "--lease-ttl", "30",
                "--replicas", "2", "--repair-interval", "600"]


def _fullest_node(cluster) -> str:
    """The node holding the most blocks: the one whose loss costs the most copies."""
    from kvstore import Client

    def blocks(addr: str) -> int:
        with Client(addr, transport="grpc") as c:
            return sum(int(t.get("blocks", 0)) for t in c.stats()["tiers"].values())

    return max(cluster.nodes, key=lambda rec: blocks(rec.addr)).id


class TestSGLangHiCacheOnACluster:
    __test__ = sf.HAVE_SGLANG

    @pytest.mark.parametrize("place", ["kvstore_etcd", "kvstore_members"])
    def test_pages_survive_a_killed_node_byte_exact(self, tmp_path, kv, place):
        """One server saves pages to a 3-node cluster (replicas 2, write quorum 2); the
        node holding most copies is SIGKILLed; another server loads every page."""
        import torch

        from replication.cluster_client import ClusterClient
        from replication.local_cluster import LocalCluster

        cluster = LocalCluster.up(tmp_path / "cluster", 3, node_args=CLUSTER_ARGS)
        try:
            where = (cluster.etcd if place == "kvstore_etcd"
                     else ",".join(rec.addr for rec in cluster.nodes))
            extra = sf.dynamic_extra("", allocator="shm", replicas=2, write_quorum=2,
                                     **{place: where})
            del extra["kvstore_addr"]
            pages = 6
            keys = _keys(pages)
            dev = torch.arange(64, 64 + pages * sf.PAGE)
            host_a = sf.host_pool(kv, "page_first", "shm")
            a = sf.create_backend(extra, host_a)
            try:
                assert isinstance(a.client, ClusterClient)
                src = host_a.alloc(pages * sf.PAGE)
                to_host(host_a, kv, src, dev)
                assert a.batch_set_v1(keys, src) == [True] * pages
            finally:
                a.close()
            cluster.kill_node(_fullest_node(cluster))

            host_b = sf.host_pool(kv, "page_first", "default")
            b = sf.create_backend({**extra, "kvstore_timeout": 5.0}, host_b)
            try:
                assert b.batch_exists(keys) == pages
                dst = host_b.alloc(pages * sf.PAGE)
                assert b.batch_get_v1(keys, dst) == [True] * pages
                assert_bytes_equal(from_host(host_b, kv, dst), device_rows(kv, dev))
            finally:
                b.close()
        finally:
            cluster.down(timeout=10)

    def test_cluster_config_errors(self, sgl):
        from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

        both = sf.dynamic_extra("127.0.0.1:1", kvstore_etcd="127.0.0.1:2")
        with pytest.raises(ValueError, match="exactly one of kvstore_addr"):
            StorageBackendFactory.create_backend("dynamic", sf.storage_config(both), None)
        lone = sf.dynamic_extra("127.0.0.1:1", replicas=2)
        with pytest.raises(ValueError, match="replicas and write_quorum need a cluster"):
            StorageBackendFactory.create_backend("dynamic", sf.storage_config(lone), None)


class TestDocumentedPath:
    __test__ = sf.HAVE_SGLANG  # no test at all where the engine is not installed

    def test_the_documented_module_path_is_the_module(self) -> None:
        """``kvstore.integrations.sglang_hicache`` (the path configs name) is the module itself."""
        import importlib

        old = importlib.import_module("kvstore.integrations.sglang_hicache")
        new = importlib.import_module("kvstore.integrations.sglang.hicache")
        assert old is new and old.KVStoreHiCacheStorage is new.KVStoreHiCacheStorage


def write_checkpoint(path: Path, seed: int) -> Path:
    """A checkpoint directory: a config and one safetensors file of random weights (the
    same names and shapes for every seed)."""
    import json

    import torch
    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({"model_type": "llama"}))
    g = torch.Generator().manual_seed(seed)
    save_file({"w": torch.randn(64, 64, generator=g)}, str(path / "model.safetensors"))
    return path


class TestIdentity:
    __test__ = sf.HAVE_SGLANG

    def test_weights_overwritten_in_place_miss_and_a_weights_id_shares(self, node, kv,
                                                                       tmp_path):
        """Pages are named after the weights' fingerprint, not the model's name: a
        checkpoint overwritten in place by other weights finds none of the old pages."""
        import torch

        ckpt = write_checkpoint(tmp_path / "model", seed=0)
        keys = _keys(2)
        dev = torch.arange(400, 400 + 2 * sf.PAGE)

        def backend(**extra):
            host = sf.host_pool(kv, "page_first", "default")
            b = sf.create_backend(sf.dynamic_extra(node.addr, **extra), host,
                                  model=str(ckpt))
            return host, b

        host, a = backend()
        try:
            assert a.weights.kind == "fingerprint"
            src = host.alloc(2 * sf.PAGE)
            to_host(host, kv, src, dev)
            assert a.batch_set_v1(keys, src) == [True, True]
        finally:
            a.close()
        _, b = backend()  # another server on the same weights
        try:
            assert b.identity == a.identity and b.batch_exists(keys) == 2
        finally:
            b.close()

        size = (ckpt / "model.safetensors").stat().st_size
        write_checkpoint(ckpt, seed=1)  # a fine-tune written over it: same path and size
        assert (ckpt / "model.safetensors").stat().st_size == size
        _, c = backend()
        try:
            assert c.identity != a.identity and c.batch_exists(keys) == 0
        finally:
            c.close()

        # the operator's name for the weights stands for them, whatever the files say
        host, d = backend(kvstore_weights_id="ft-7")
        try:
            assert str(d.weights) == "given:ft-7"
            src = host.alloc(2 * sf.PAGE)
            to_host(host, kv, src, dev)
            assert d.batch_set_v1(keys, src) == [True, True]
        finally:
            d.close()
        write_checkpoint(ckpt, seed=2)
        _, e = backend(kvstore_weights_id="ft-7")
        try:
            assert e.batch_exists(keys) == 2
        finally:
            e.close()

    def test_the_model_path_setting_names_the_checkpoint(self, node, kv, tmp_path):
        ckpt = write_checkpoint(tmp_path / "elsewhere", seed=3)
        host = sf.host_pool(kv, "page_first", "default")
        b = sf.create_backend(sf.dynamic_extra(node.addr, kvstore_model_path=str(ckpt)), host,
                              model="served-name")
        try:
            from kvstore.integrations.identity import fingerprint_checkpoint

            assert str(b.weights) == f"fingerprint:{fingerprint_checkpoint(ckpt).digest}"
        finally:
            b.close()
