"""kvstore as an LMCache remote storage plugin, with LMCache's own standalone engine.

Runs in the LMCache environment (``make test-lmcache``; ``scripts/setup-lmcache-env.sh``).
Where LMCache is not installed (the main ``.venv``) this module collects no test; with
``KVSTORE_LMCACHE_TESTS=1`` (set by ``make test-lmcache``) a missing LMCache fails the run.

The engine is LMCache's ``LMCacheEngine`` built by ``LMCacheEngineBuilder`` from an
``LMCacheEngineConfig`` whose ``remote_storage_plugins`` loads
``kvstore.integrations.lmcache_connector.KVStoreRemoteConnector`` against a real node.
There is no GPU: the engine's GPU connector is ``lmcache_fixtures.cpu_gpu_connector``.
"""

from __future__ import annotations

import asyncio
import threading
import uuid
from collections.abc import Iterator

import main_conftest  # the engines conftest put this folder on sys.path
import pytest
from lmcache_fixtures import (
    CHUNK,
    HAVE_LMCACHE,
    HIDDEN,
    LAYERS,
    cpu_gpu_connector,
    key_of,
    metadata,
    node_hits,
    tokens_and_kv,
    wait_for,
)

PLUGIN = "kvstore"

# LMCache's logging goes through opentelemetry's deprecated LoggingHandler.
pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry.*")


def engine_config(addr: str, **extra):
    from lmcache.v1.config import LMCacheEngineConfig

    return LMCacheEngineConfig.from_defaults(
        chunk_size=CHUNK, local_cpu=True, max_local_cpu_size=0.05, save_unfull_chunk=True,
        remote_storage_plugins=[PLUGIN],
        extra_config={
            f"remote_storage_plugin.{PLUGIN}.module_path":
                "kvstore.integrations.lmcache_connector",
            f"remote_storage_plugin.{PLUGIN}.class_name": "KVStoreRemoteConnector",
            "kvstore_addr": addr, **extra})


def build_engine(addr: str, **extra):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    name = f"kvstore-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, engine_config(addr, **extra), metadata(), cpu_gpu_connector(),
        lambda t, src: None, lambda obj, src: obj)
    engine.post_init()
    return name, engine


def remote_connector(engine):
    """The KVStoreRemoteConnector inside the engine's RemoteBackend."""
    from kvstore.integrations.lmcache_connector import KVStoreRemoteConnector

    backends = engine.storage_manager.storage_backends
    backend = backends[f"RemoteBackend-{PLUGIN}"]
    conn = backend.connection
    while not isinstance(conn, KVStoreRemoteConnector):  # audit / instrumented wrappers
        conn = conn._connector
    return backend, conn


@pytest.fixture(scope="module")
def store_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator:
    n = main_conftest.main.start_node(tmp_path_factory.mktemp("node"), dram="128MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


@pytest.fixture
def engines(store_node):
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    names: list[str] = []

    def make(**extra):
        name, engine = build_engine(store_node.addr, **extra)
        names.append(name)
        return engine

    yield make
    for name in names:
        LMCacheEngineBuilder.destroy(name)


class TestLMCacheRemotePlugin:
    __test__ = HAVE_LMCACHE  # no test at all where LMCache is not installed

    def test_plugin_is_loaded(self, engines):
        from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

        from kvstore.integrations.lmcache_connector import KVStoreRemoteConnector

        _, conn = remote_connector(engines())
        assert isinstance(conn, KVStoreRemoteConnector)
        assert isinstance(conn, RemoteConnector)
        assert conn.full_chunk_size_bytes == 2 * LAYERS * CHUNK * HIDDEN * 4

    @pytest.mark.parametrize("n", [3 * CHUNK, 3 * CHUNK + 5])
    def test_store_lookup_retrieve_through_kvstore(self, engines, store_node, n):
        """Engine A stores; engine B (empty local cache, same model) finds every token
        in kvstore, retrieves the same count, and the bytes are A's."""
        import torch

        from kvstore import Client
        from kvstore.integrations.lmcache_connector import lmcache_key

        tokens, kv = tokens_and_kv(n, seed=n)
        a = engines()
        a.store(tokens, kvcaches=kv)
        _, conn_a = remote_connector(a)
        chunks = -(-n // CHUNK)
        written = wait_for(lambda: (k := asyncio.run(conn_a.list())) and len(k) == chunks and k,
                           what="remote puts")
        with Client(store_node.addr) as c:
            assert all(c.exists([lmcache_key(k, conn_a.identity) for k in written]))
            assert not any(c.exists([lmcache_key(k) for k in written]))  # never bare

        b = engines()
        local_b = b.storage_manager.storage_backends["LocalCPUBackend"]
        keys = [key_of(b, tokens, i) for i in range(len(written))]
        assert not any(local_b.contains(k) for k in keys)  # nothing of A's in B's memory
        hits0 = node_hits(store_node.addr)
        assert b.lookup(tokens) == n
        out = torch.zeros_like(kv)
        ret = b.retrieve(tokens, kvcaches=out)
        assert int(ret.sum()) == n
        assert torch.equal(out, kv)
        assert node_hits(store_node.addr) - hits0 >= len(keys)  # read from kvstore

    def test_prefix_hit_and_miss(self, engines):
        """A longer request that shares the stored prefix hits only that prefix; an
        unrelated one misses."""
        import torch

        tokens, kv = tokens_and_kv(2 * CHUNK, seed=7)
        a = engines()
        a.store(tokens, kvcaches=kv)
        _, conn_a = remote_connector(a)
        wait_for(lambda: len(asyncio.run(conn_a.list())) == 2, what="remote puts")

        b = engines()
        more, _ = tokens_and_kv(2 * CHUNK, seed=8)
        assert b.lookup(torch.cat([tokens, more])) == 2 * CHUNK
        other, _ = tokens_and_kv(2 * CHUNK, seed=9)
        assert b.lookup(other) == 0

    def test_connector_methods(self, engines, store_node):
        """get / put / exists / exists_sync / batched variants / list / remove / ping /
        close on the engine's own connector instance."""
        from kvstore import Client
        from kvstore.integrations.lmcache_connector import lmcache_key

        tokens, kv = tokens_and_kv(2 * CHUNK + 3, seed=11)
        a = engines()
        a.store(tokens, kvcaches=kv)
        _, conn = remote_connector(a)
        names = wait_for(lambda: (k := asyncio.run(conn.list())) and len(k) == 3 and k,
                         what="remote puts")
        keys = [key_of(a, tokens, i) for i in range(3)]
        assert sorted(k.to_string() for k in keys) == names

        async def run():
            assert all([await conn.exists(k) for k in keys])
            assert all(conn.exists_sync(k) for k in keys)
            assert conn.batched_contains(keys) == 3
            assert await conn.batched_async_contains("l", keys) == 3
            objs = await conn.batched_get(keys)
            sizes = [o.get_size() for o in objs]
            full = conn.full_chunk_size_bytes
            assert sizes == [full, full, 3 * full // CHUNK]
            for i, o in enumerate(objs):  # chunk i holds tokens i*CHUNK..
                want = kv[:, :, i * CHUNK:(i + 1) * CHUNK].contiguous()
                assert o.tensor.reshape(want.shape).equal(want)
            one = await conn.get(keys[0])
            assert one.tensor.equal(objs[0].tensor)
            # a put under a new key of the bytes of chunk 0, read back
            new = keys[0].with_new_worker_id(1) if hasattr(keys[0], "with_new_worker_id") \
                else None
            assert new is not None
            assert not await conn.exists(new)
            await conn.put(new, objs[0])
            assert await conn.exists(new)
            back = await conn.get(new)
            assert back.tensor.equal(objs[0].tensor)
            await conn.batched_put([new], [objs[1]])  # existing key: the value stays
            again = await conn.get(new)
            assert again.tensor.equal(objs[0].tensor)
            assert new.to_string() in await conn.list()
            # the non-blocking batched get stops at the first miss
            assert conn.remove_sync(keys[1])
            assert conn.batched_contains(keys) == 1
            prefix = await conn.batched_get_non_blocking("l", keys)
            assert len(prefix) == 1 and prefix[0].tensor.equal(objs[0].tensor)
            assert await conn.get(keys[1]) is None
            assert keys[1].to_string() not in await conn.list()
            assert await conn.ping() == 0
            for o in [*objs, one, back, again, *prefix]:
                o.ref_count_down()

        asyncio.run(run())
        with Client(store_node.addr) as c:
            assert c.exists([lmcache_key(keys[0], conn.identity),
                             lmcache_key(keys[1], conn.identity)]) == [True, False]

    def test_node_down_is_a_miss(self, engines, tmp_path):
        """A connector whose node is gone answers False / None / 1 and drops puts; the
        engine then looks up nothing."""
        node = main_conftest.main.start_node(tmp_path)
        try:
            b = engines(kvstore_addr=node.addr, kvstore_timeout=2)
            _, conn = remote_connector(b)
        finally:
            assert node.stop() == 0
        tokens, kv = tokens_and_kv(CHUNK, seed=21)
        key = key_of(b, tokens, 0)

        async def run():
            assert not await conn.exists(key)
            assert conn.batched_contains([key]) == 0
            assert await conn.get(key) is None
            assert await conn.ping() == 1

        asyncio.run(run())
        done = threading.Event()
        put_many = conn._put_many

        def put_and_tell(*args):
            try:
                put_many(*args)
            finally:
                done.set()

        conn._put_many = put_and_tell
        b.store(tokens, kvcaches=kv)  # kept in B's CPU memory; the remote put fails
        assert done.wait(20), "no remote put"
        assert asyncio.run(conn.list()) == []


CLUSTER_ARGS = ["--dram-bytes", "128MiB", "--no-prefault", "--lease-ttl", "30",
                "--replicas", "2", "--repair-interval", "600"]


def cluster_engine(place: str, where: str, **extra):
    """An engine whose plugin reaches a cluster (no kvstore_addr)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder

    cfg = engine_config("", **{place: where, **extra})
    del cfg.extra_config["kvstore_addr"]
    name = f"kvstore-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, cfg, metadata(), cpu_gpu_connector(), lambda t, src: None, lambda obj, src: obj)
    engine.post_init()
    return name, engine


def fullest_node(cluster) -> str:
    from kvstore import Client

    def blocks(addr: str) -> int:
        with Client(addr, transport="grpc") as c:
            return sum(int(t.get("blocks", 0)) for t in c.stats()["tiers"].values())

    return max(cluster.nodes, key=lambda rec: blocks(rec.addr)).id


class TestLMCacheOnACluster:
    __test__ = HAVE_LMCACHE

    @pytest.mark.parametrize("place", ["kvstore_etcd", "kvstore_members"])
    def test_chunks_survive_a_killed_node_byte_exact(self, tmp_path, place):
        """Engine A stores through a 3-node cluster (replicas 2, write quorum 2); the node
        holding most copies is SIGKILLed; engine B retrieves every token, bytes exact."""
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        from replication.cluster_client import ClusterClient
        from replication.local_cluster import LocalCluster

        cluster = LocalCluster.up(tmp_path / "cluster", 3, node_args=CLUSTER_ARGS)
        names = []
        try:
            where = (cluster.etcd if place == "kvstore_etcd"
                     else ",".join(rec.addr for rec in cluster.nodes))
            n = 5 * CHUNK + 3
            tokens, kv = tokens_and_kv(n, seed=11)
            name, a = cluster_engine(place, where, replicas=2, write_quorum=2)
            names.append(name)
            _, conn_a = remote_connector(a)
            assert isinstance(conn_a.client, ClusterClient)
            a.store(tokens, kvcaches=kv)
            wait_for(lambda: len(asyncio.run(conn_a.list())) == 6, what="remote puts")
            cluster.kill_node(fullest_node(cluster))

            name, b = cluster_engine(place, where, replicas=2, write_quorum=2,
                                     kvstore_timeout=5)
            names.append(name)
            assert b.lookup(tokens) == n
            out = torch.zeros_like(kv)
            ret = b.retrieve(tokens, kvcaches=out)
            assert int(ret.sum()) == n
            assert torch.equal(out, kv)
        finally:
            for name in names:
                LMCacheEngineBuilder.destroy(name)
            cluster.down(timeout=10)


class TestDocumentedPath:
    __test__ = HAVE_LMCACHE  # no test at all where the engine is not installed

    def test_the_documented_module_path_is_the_module(self) -> None:
        """``kvstore.integrations.lmcache_connector`` (the path configs name) is the module."""
        import importlib

        old = importlib.import_module("kvstore.integrations.lmcache_connector")
        new = importlib.import_module("kvstore.integrations.lmcache.connector")
        assert old is new and old.KVStoreRemoteConnector is new.KVStoreRemoteConnector


def write_checkpoint(path, seed: int):
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
    __test__ = HAVE_LMCACHE

    def test_weights_overwritten_in_place_miss(self, engines, tmp_path):
        """Chunks are named after the weights' fingerprint too (LMCache's own key names
        the model by name only): after the checkpoint is overwritten in place by other
        weights, an engine finds none of the old chunks; one on the same weights does."""
        ckpt = write_checkpoint(tmp_path / "model", seed=0)
        tokens, kv = tokens_and_kv(2 * CHUNK, seed=41)
        a = engines(kvstore_model_path=str(ckpt))
        _, conn_a = remote_connector(a)
        assert conn_a.weights.kind == "fingerprint"
        a.store(tokens, kvcaches=kv)
        wait_for(lambda: len(asyncio.run(conn_a.list())) == 2, what="remote puts")

        b = engines(kvstore_model_path=str(ckpt))
        assert remote_connector(b)[1].identity == conn_a.identity
        assert b.lookup(tokens) == 2 * CHUNK

        write_checkpoint(ckpt, seed=1)
        c = engines(kvstore_model_path=str(ckpt))
        assert remote_connector(c)[1].identity != conn_a.identity
        assert c.lookup(tokens) == 0

    def test_a_weights_id_names_the_weights(self, engines):
        a = engines(kvstore_weights_id="ft-7")
        b = engines(kvstore_weights_id="ft-8")
        conn_a, conn_b = remote_connector(a)[1], remote_connector(b)[1]
        assert str(conn_a.weights) == "given:ft-7"
        assert conn_a.identity != conn_b.identity
