"""LMCache's own ``MooncakestoreConnector`` on kvstore's Mooncake-compatible module.

Runs in the LMCache environment (``make test-lmcache``; ``scripts/setup-lmcache-env.sh``);
where LMCache is not installed this module collects no test.

LMCache 0.5.6 reaches Mooncake Store through ``from mooncake.store import
MooncakeDistributedStore, ReplicateConfig`` (``lmcache.v1.storage_backend.connector.
mooncakestore_connector``). Here ``mooncake.store`` is kvstore's module
(``kvstore.integrations.mooncake_compat``), put in ``sys.modules`` before the connector is
built, as docs/engines/lmcache.md tells a user to do. LMCache then calls, on kvstore's class:
``setup(dict)`` (its config keys, among them ``master_server_address``, the pre-0.3.13
name of ``master_server_addr``; it never checks the returned code), ``register_buffer``
over its CPU pool, ``batch_put_from`` (``save_chunk_meta: false``) or ``put_parts``
(``true``), ``is_exist`` per key, and ``batch_get_into`` or ``batch_get_buffer``.

The engine is LMCache's standalone ``LMCacheEngine`` with the CPU GPU-connector of
``lmcache_fixtures``: engine A stores a 167-token prompt, the node must then hold its
11 chunks under ``mooncake_key(CacheEngineKey string)``, and engine B (empty local cache)
looks up and retrieves every token with A's bytes.
"""

from __future__ import annotations

import sys
import types
import uuid
from collections.abc import Iterator

import lmcache_fixtures as lm
import main_conftest  # the engines conftest put this folder on sys.path
import pytest

PROMPT = 167  # the prompt: 10 full chunks of 16 and a partial one
CHUNKS = -(-PROMPT // lm.CHUNK)

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning:opentelemetry.*")


@pytest.fixture
def kvstore_as_mooncake(monkeypatch: pytest.MonkeyPatch) -> None:
    """``import mooncake.store`` gives kvstore's Mooncake-compatible module."""
    import kvstore.integrations.mooncake_compat as compat

    package = types.ModuleType("mooncake")
    package.__path__ = []  # a package, so ``mooncake.store`` resolves as a submodule
    package.store = compat  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake", package)
    monkeypatch.setitem(sys.modules, "mooncake.store", compat)


@pytest.fixture
def node(tmp_path) -> Iterator:
    n = main_conftest.main.start_node(tmp_path, dram="128MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


def mooncake_engine(addr: str, save_chunk_meta: bool):
    """An LMCache engine whose remote backend is LMCache's MooncakestoreConnector, set up
    the way LMCache's docs show (legacy key names, passed through to ``setup(dict)``)."""
    from lmcache.v1.cache_engine import LMCacheEngineBuilder
    from lmcache.v1.config import LMCacheEngineConfig

    cfg = LMCacheEngineConfig.from_defaults(
        chunk_size=lm.CHUNK, local_cpu=True, max_local_cpu_size=0.05, save_unfull_chunk=True,
        remote_url=f"mooncakestore://{addr}/",
        extra_config={"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
                      "master_server_address": addr, "protocol": "tcp", "device_name": "",
                      "global_segment_size": "0", "save_chunk_meta": save_chunk_meta,
                      "transfer_timeout": 20})
    name = f"kvstore-mc-{uuid.uuid4().hex[:8]}"
    engine = LMCacheEngineBuilder.get_or_create(
        name, cfg, lm.metadata(), lm.cpu_gpu_connector(), lambda t, src: None,
        lambda obj, src: obj)
    engine.post_init()
    return name, engine


def mooncake_connector(engine):
    from lmcache.v1.storage_backend.connector.mooncakestore_connector import (
        MooncakestoreConnector,
    )

    backend = engine.storage_manager.storage_backends["RemoteBackend"]
    conn = backend.connection
    while not isinstance(conn, MooncakestoreConnector):  # audit / instrumented wrappers
        conn = conn._connector
    return conn


class TestLMCacheMooncakestoreConnector:
    __test__ = lm.HAVE_LMCACHE  # no test at all where LMCache is not installed

    @pytest.mark.parametrize("save_chunk_meta", [False, True])
    def test_store_then_retrieve_through_a_node(self, kvstore_as_mooncake, node,
                                                save_chunk_meta):
        import torch
        from lmcache.v1.cache_engine import LMCacheEngineBuilder

        from kvstore import Client
        from kvstore.integrations.mooncake.store import (
            MooncakeDistributedStore,
            mooncake_key,
        )

        tokens, kv = lm.tokens_and_kv(PROMPT, seed=PROMPT)
        names = []
        try:
            name, a = mooncake_engine(node.addr, save_chunk_meta)
            names.append(name)
            conn_a = mooncake_connector(a)
            assert isinstance(conn_a.store, MooncakeDistributedStore)  # kvstore's class
            assert conn_a.save_chunk_meta is save_chunk_meta
            assert conn_a.store.health_check() == 0  # set up against the node
            a.store(tokens, kvcaches=kv)
            keys = [lm.key_of(a, tokens, i).to_string() for i in range(CHUNKS)]
            with Client(node.addr) as c:
                lm.wait_for(lambda: all(c.exists([mooncake_key(k) for k in keys])),
                            what=f"{CHUNKS} chunks in the node")

            name, b = mooncake_engine(node.addr, save_chunk_meta)
            names.append(name)
            local_b = b.storage_manager.storage_backends["LocalCPUBackend"]
            assert not any(local_b.contains(lm.key_of(b, tokens, i)) for i in range(CHUNKS))
            hits0 = lm.node_hits(node.addr)
            assert b.lookup(tokens) == PROMPT
            out = torch.zeros_like(kv)
            ret = b.retrieve(tokens, kvcaches=out)
            assert int(ret.sum()) == PROMPT
            assert torch.equal(out, kv)
            assert lm.node_hits(node.addr) - hits0 >= CHUNKS  # read from the node
        finally:
            for name in names:
                LMCacheEngineBuilder.destroy(name)
