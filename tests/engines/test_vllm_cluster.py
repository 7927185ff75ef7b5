"""vLLM's own engine (CPU) with KVStoreConnector on a real 3-node cluster with real etcd.

``kv_connector_extra_config={"kvstore_etcd": ..., "replicas": 2, "write_quorum": 2}``:
the connector's clients are cluster clients. A node SIGKILLed while the engine serves
costs no request: blocks with a surviving copy still load (vLLM counts them as
external prefix-cache hits), the others are recomputed; greedy tokens stay identical.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_llm import generate

from kvstore import Client, block_keys
from replication.cluster_client import ClusterClient
from replication.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
NAMESPACE = f"cluster-test-{time.time_ns()}"
PROMPT_TOKENS = 200
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # 192: 6 blocks
NODE_ARGS = ["--dram-bytes", "128MiB", "--no-prefault", "--lease-ttl", "60",
             "--replicas", "2", "--repair-interval", "600"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path_factory.mktemp("cluster") / "c", 3, node_args=NODE_ARGS)
    try:
        yield c
    finally:
        c.down(timeout=10)


def make_llm(model: Path, extra: dict) -> Any:
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm_connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"namespace": NAMESPACE, **extra})
    return LLM(model=str(model), skip_tokenizer_init=True, block_size=BLOCK,
               max_model_len=512, dtype="float32", enforce_eager=True, seed=0,
               disable_log_stats=False, kv_cache_memory_bytes=64 << 20,
               kv_transfer_config=ktc)


def close_llm(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()




def blocks_on(addr: str, keys: list[bytes]) -> int:
    with Client(addr, transport="grpc") as c:
        return sum(c.exists(keys))


def test_a_killed_node_costs_no_request_and_a_second_llm_shares_the_prefix(
        tiny_llama: Path, cluster: LocalCluster) -> None:
    extra = {"kvstore_etcd": cluster.etcd, "replicas": 2, "write_quorum": 2, "timeout": 10}
    tokens = [int(t) for t in np.random.default_rng(5).integers(3, 500, PROMPT_TOKENS)]
    keys = [bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK, NAMESPACE)]
    with ClusterClient(etcd=cluster.etcd, replicas=2) as store:
        assert store.prefix_match(keys) == 0
        a = make_llm(tiny_llama, extra)
        try:
            first, hits = generate(a, tokens)
            assert hits == 0
            deadline = time.monotonic() + 60
            # Saves are asynchronous (a saver thread in the worker): wait for both copies.
            while sum(blocks_on(r.addr, keys) for r in cluster.nodes) < 2 * len(keys):
                assert time.monotonic() < deadline, "the prompt's blocks were not saved twice"
                time.sleep(0.1)

            fullest = max(cluster.nodes, key=lambda r: blocks_on(r.addr, keys))
            assert blocks_on(fullest.addr, keys) >= 4  # 12 copies over 3 nodes
            cluster.kill_node(fullest.id)  # still listed in etcd: clients find it dead

            assert a.reset_prefix_cache()
            second, hits = generate(a, tokens)
            assert hits == LOADABLE, "every block still has a copy: all external hits"
            assert second == first
        finally:
            close_llm(a)

        b = make_llm(tiny_llama, extra)  # another engine on the same cluster
        try:
            third, hits = generate(b, tokens)
            assert hits == LOADABLE
            assert third == first

            # Lose a second node: blocks without a copy left are recomputed, not errors.
            alive = [r for r in cluster.nodes if r.id != fullest.id]
            cluster.kill_node(alive[0].id)
            with Client(alive[1].addr, transport="grpc") as last:
                survivors = last.prefix_match(keys)
            assert b.reset_prefix_cache()
            fourth, hits = generate(b, tokens)
            assert hits == survivors * BLOCK
            assert fourth == first
        finally:
            close_llm(b)
