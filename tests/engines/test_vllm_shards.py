"""KVStoreConnector under tensor parallelism and MLA, without an engine: vLLM's own
config (TP=2, a DeepSeek-V2 MLA checkpoint), the connector's scheduler and worker sides,
a real kvstore node. Each rank's shard is its own object under a key that names the rank
and the world size; a block counts only when every shard is stored; under MLA rank 0
writes the one copy every rank reads (``kvstore.integrations.vllm.ranks``). The engine
itself at TP=2: test_vllm_tensor_parallel.py."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from vllm_fakes import FakeManager, request_id, tokens

from kvstore import Client, block_keys
from kvstore.core.keys import shard_key
from kvstore.integrations.vllm.blocks import parse_header
from kvstore.integrations.vllm.describe import DESCRIBE_PARAM

BLOCK = 32
LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SHAPE = (64, 1, 32, 64)  # one KV head per rank of the tiny Llama's two at TP=2
TP2 = {"tensor_parallel_size": 2}
SHARDS = ("tp0of2.pp0of1", "tp1of2.pp0of1")


def request(toks: list[int], **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id(), toks, SamplingParams(max_tokens=64), None, **kw)


@pytest.fixture
def namespace() -> str:
    return f"shards-{time.time_ns()}"


def put(client: Client, keys: list[bytes]) -> None:
    client.put_batch(keys, [b"x" * 64 for _ in keys])


def test_a_block_counts_only_when_every_rank_holds_its_shard(
        make_connector: Any, store_node: Any, client: Client, namespace: str) -> None:
    sched = make_connector("SCHEDULER", store_node.addr, namespace=namespace, engine_args=TP2,
                           load_inline_when_idle=False)
    sched.bind_kv_cache_manager(FakeManager())
    toks = tokens(200, 7)  # 6 full blocks; 192 tokens loadable
    keys = [bytes(k) for k in block_keys(toks, BLOCK, namespace)]
    put(client, keys)  # a one-rank engine's blocks: not this engine's
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)
    put(client, [bytes(shard_key(k, SHARDS[0])) for k in keys])  # rank 0 has all 6
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)
    put(client, [bytes(shard_key(k, SHARDS[1])) for k in keys[:3]])  # rank 1 the first 3
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (96, True)
    put(client, [bytes(shard_key(k, SHARDS[1])) for k in keys[3:]])
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (192, True)


def test_a_one_rank_engine_is_not_confused_by_a_two_rank_engines_shards(
        make_connector: Any, store_node: Any, client: Client, namespace: str) -> None:
    sched = make_connector("SCHEDULER", store_node.addr, namespace=namespace)
    sched.bind_kv_cache_manager(FakeManager())
    toks = tokens(200, 8)
    keys = block_keys(toks, BLOCK, namespace)
    put(client, [bytes(shard_key(k, s)) for s in SHARDS for k in keys])
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)


def test_the_description_names_the_shards(make_connector: Any, store_node: Any,
                                          namespace: str) -> None:
    for args, shards in (({}, []), (TP2, list(SHARDS))):
        sched = make_connector("SCHEDULER", store_node.addr, namespace=namespace,
                               engine_args=args)
        req = request(tokens(40, 9))
        req.kv_transfer_params = {DESCRIBE_PARAM: True}
        _, reply = sched.request_finished(req, [])
        assert reply is not None and reply["kvstore"]["shards"] == shards


@pytest.fixture
def tp2_workers(make_connector: Any, store_node: Any, namespace: str) -> Iterator[list[Any]]:
    """Rank 0 and rank 1 of one TP=2 engine, each with its own cache tensors."""
    workers = []
    for rank in range(2):
        conn = make_connector("WORKER", store_node.addr, namespace=namespace,
                              engine_args=TP2, rank=rank)
        torch.manual_seed(rank)
        conn.register_kv_caches({name: torch.randn(SHAPE) for name in LAYERS})
        workers.append(conn)
    try:
        yield workers
    finally:
        for conn in workers:
            conn.shutdown()


def run_step(conn: Any, meta: Any) -> None:
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name, kv in zip(LAYERS, conn._caches, strict=True):
        conn.save_kv_layer(name, kv, None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    for fut in list(conn._saves):
        fut.result(timeout=30)


def save(conn: Any, keys: list[bytes], ids: list[int]) -> None:
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, SaveSpec

    run_step(conn, KVStoreConnectorMetadata(saves=[SaveSpec("r", keys, ids, None)]))


def load(conn: Any, keys: list[bytes], ids: list[int]) -> set[int]:
    """Loads ``keys`` into blocks ``ids``; the block ids the worker reports refused."""
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, LoadSpec

    run_step(conn, KVStoreConnectorMetadata(loads=[LoadSpec("r", keys, ids)]))
    deadline = time.monotonic() + 30
    while True:
        _, recving = conn.get_finished(set())
        if recving and "r" in recving:
            return conn.get_block_ids_with_load_errors()
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.01)


def test_every_rank_saves_and_loads_its_own_shard(tp2_workers: list[Any], client: Client,
                                                  namespace: str) -> None:
    keys = [bytes(k) for k in block_keys(tokens(96, 10), BLOCK, namespace)]
    for conn in tp2_workers:
        save(conn, keys, [3, 4, 5])
    assert client.exists(keys) == [False] * 3  # nothing under the block keys themselves
    stored = [[bytes(shard_key(k, s)) for k in keys] for s in SHARDS]
    assert [client.exists(chain) for chain in stored] == [[True] * 3, [True] * 3]
    headers = [parse_header(v or b"") for v in client.get_batch([c[0] for c in stored])]
    assert [h["key"] for h in headers] == [stored[0][0], stored[1][0]]
    assert headers[0]["identity"] != headers[1]["identity"]  # the header names the shard

    # Each rank reads back its own bytes (the two ranks' caches differ).
    want = [[kv[3:6].clone() for kv in conn._caches] for conn in tp2_workers]
    for conn in tp2_workers:
        assert load(conn, keys, [10, 11, 12]) == set()
    for conn, layers in zip(tp2_workers, want, strict=True):
        for kv, blocks in zip(conn._caches, layers, strict=True):
            assert torch.equal(kv[10:13], blocks)

    # A shard that is another rank's bytes under this rank's key is refused by identity.
    rank1 = stored[1][1]
    assert client.remove(rank1)
    client.put_batch([rank1], [client.get_batch([stored[0][1]])[0] or b""])
    assert load(tp2_workers[0], keys, [20, 21, 22]) == set()
    assert load(tp2_workers[1], keys, [20, 21, 22]) == {21, 22}


def test_mla_rank_zero_writes_the_copy_every_rank_reads(
        make_connector: Any, store_node: Any, client: Client, tiny_mla: Any,
        namespace: str) -> None:
    workers = []
    for rank in range(2):
        conn = make_connector("WORKER", store_node.addr, namespace=namespace, model=tiny_mla,
                              engine_args=TP2, rank=rank)
        assert conn._shards.mla and conn._shards.own_shard == "tp*of2.pp0of1"
        workers.append(conn)
    try:
        latent = (64, 32, 576)  # [num_blocks, block_size, kv_lora_rank + rope], per layer
        torch.manual_seed(0)
        workers[0].register_kv_caches({n: torch.randn(latent) for n in LAYERS})
        workers[1].register_kv_caches({n: torch.zeros(latent) for n in LAYERS})
        keys = [bytes(k) for k in block_keys(tokens(64, 11), BLOCK, namespace)]
        save(workers[1], keys, [1, 2])  # rank 1 writes nothing
        stored = [bytes(shard_key(k, "tp*of2.pp0of1")) for k in keys]
        assert client.exists(stored) == [False, False]
        save(workers[0], keys, [1, 2])
        assert client.exists(stored) == [True, True]
        assert client.exists(keys) == [False, False]

        assert load(workers[1], keys, [5, 6]) == set()  # rank 1 reads rank 0's copy
        for a, b in zip(workers[0]._caches, workers[1]._caches, strict=True):
            assert torch.equal(b[5:7], a[1:3])

        sched = make_connector("SCHEDULER", store_node.addr, namespace=namespace,
                               model=tiny_mla, engine_args=TP2)
        sched.bind_kv_cache_manager(FakeManager())
        assert sched._shards.shards == ("tp*of2.pp0of1",)
        # An idle engine: the load is inline (test_vllm_load_mode).
        assert sched.get_num_new_matched_tokens(request(tokens(65, 11)), 0) == (64, False)
    finally:
        for conn in workers:
            conn.shutdown()
