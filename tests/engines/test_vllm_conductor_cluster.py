"""``conductor serve --etcd`` in front of vLLM servers whose connectors use a real cluster.

A real etcd and three ``kvstore serve`` nodes; a prefill (kv_both) and a decode
(kv_consumer) vLLM server whose KVStoreConnector takes ``kvstore_etcd`` with
``replicas=2, write_quorum=2``; a Conductor with ``--etcd`` and ``--write-quorum 2``,
which asks the cluster for the prefix and waits for both copies of every block before
it asks the decode instance.
"""

from __future__ import annotations

import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_vllm_conductor import BLOCK, HITS, complete, loadable, model_of, prompt, vllm_metric

from conductor.front.vllm_procs import Proc, start_conductor, start_vllm, wait_ready
from kvstore import Client, block_keys
from replication.local_cluster import LocalCluster

pytestmark = pytest.mark.timeout(900)

NS = f"cond-cluster-{time.time_ns()}"
# The nodes' repair keeps one copy, so every second copy counted below is the writers'.
NODE_ARGS = ["--dram-bytes", "128MiB", "--no-prefault", "--lease-ttl", "60",
             "--replicas", "1", "--repair-interval", "600"]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path_factory.mktemp("cluster") / "c", 3, node_args=NODE_ARGS)
    try:
        yield c
    finally:
        c.down(timeout=10)


@pytest.fixture(scope="module")
def stack(tiny_llama: Path, cluster: LocalCluster, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("logs")
    where = {"kvstore_etcd": cluster.etcd, "replicas": 2, "write_quorum": 2}
    procs = {
        "P": start_vllm(sys.executable, tiny_llama, logs, name="P", store=where, namespace=NS,
                        role="kv_both", max_model_len=512),
        "D": start_vllm(sys.executable, tiny_llama, logs, name="D", store=where, namespace=NS,
                        role="kv_consumer", max_model_len=512),
    }
    try:
        for p in procs.values():
            wait_ready(p, "/v1/models", 400)
        procs["front"] = start_conductor(logs, name="front", args=[
            "--etcd", cluster.etcd, "--replicas", "2", "--write-quorum", "2",
            "--vllm-prefill", procs["P"].url, "--vllm-decode", procs["D"].url,
            "--kv-namespace", NS, "--block-tokens", str(BLOCK), "--durable-timeout", "20s",
            "--ttft-slo", "60s", "--tbt-slo", "5s"])
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def test_decode_loads_a_prefix_stored_with_two_copies_and_tokens_match(
        stack: dict[str, Proc], cluster: LocalCluster) -> None:
    tokens = prompt(4242)
    model = model_of(stack["P"])
    before = vllm_metric(stack["D"], HITS)
    r = complete(stack["front"].url, tokens, 8, model=model)
    assert r.status_code == 200, r.text
    ids = r.json()["choices"][0]["token_ids"]
    assert vllm_metric(stack["D"], HITS) - before == loadable(len(tokens))
    keys = block_keys(tokens, BLOCK, NS)[: len(tokens) // BLOCK]
    with Client(etcd=cluster.etcd) as c:
        assert [len(h) for h in c.holders(keys)] == [2] * len(keys)
    # The prefill instance, asked directly, answers from its own prefix cache: the same
    # greedy tokens as the decode instance that loaded the prefix from the cluster.
    direct = complete(stack["P"].url, tokens, 8, model=model)
    assert direct.status_code == 200, direct.text
    assert direct.json()["choices"][0]["token_ids"] == ids
