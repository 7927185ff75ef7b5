"""KVStoreConnector with a hybrid KVCacheConfig as vLLM builds it, without an engine: the
groups from vLLM's own ``get_kv_cache_groups``, the block tables from vLLM's own
``KVCacheManager`` (its sliding-window manager nulls the blocks before the window), a
real kvstore node. Runs under vLLM 0.32 and 0.33 (make test-vllm033)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from hybrid_models import WINDOW, write_tiny_gemma3
from test_vllm_scheduler import request, sched_output, store
from vllm_fakes import tokens

from kvstore import Client, block_keys
from kvstore.core.keys import shard_key
from kvstore.integrations.vllm.blocks import HEADER_BYTES, parse_header

BLOCK = 32
FULL_LAYERS = ["model.layers.1.self_attn.attn", "model.layers.3.self_attn.attn"]
WINDOW_LAYERS = ["model.layers.0.self_attn.attn", "model.layers.2.self_attn.attn"]
SHAPE = (64, 2, 32, 64)  # [num_blocks, kv_heads, block_size, 2 * head_size], as CPU_ATTN


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


def _get_kv_cache_groups() -> Any:
    try:  # vLLM 0.33 moved the planning out of kv_cache_utils
        from vllm.v1.core.kv_cache_planning import get_kv_cache_groups
    except ImportError:
        from vllm.v1.core.kv_cache_utils import get_kv_cache_groups
    return get_kv_cache_groups


@pytest.fixture(scope="module")
def hybrid(tiny_gemma3: Path) -> tuple[Any, Any]:
    """(VllmConfig, KVCacheConfig) of the tiny Gemma 3 with KVStoreConnector: two layers
    of sliding window (64 tokens), two of full attention, grouped by vLLM."""
    return hybrid_config(tiny_gemma3)


@pytest.fixture(scope="module")
def hybrid_tp2(tiny_gemma3: Path) -> tuple[Any, Any]:
    """``hybrid`` at tensor parallelism 2 (each rank one of the two KV heads)."""
    return hybrid_config(tiny_gemma3, tensor_parallel_size=2)


def hybrid_config(tiny_gemma3: Path, **engine_args: Any) -> tuple[Any, Any]:
    from vllm.config import KVTransferConfig
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, SlidingWindowSpec

    ktc = KVTransferConfig(kv_connector="KVStoreConnector",
                           kv_connector_module_path="kvstore.integrations.vllm_connector",
                           kv_role="kv_both", kv_connector_extra_config={"kvstore_addr": "x:1"})
    cfg = EngineArgs(model=str(tiny_gemma3), skip_tokenizer_init=True, block_size=BLOCK,
                     max_model_len=512, enforce_eager=True, dtype="float32",
                     kv_transfer_config=ktc, **engine_args).create_engine_config()
    # The connector supports the hybrid allocator, so vLLM leaves it on.
    assert cfg.scheduler_config.disable_hybrid_kv_cache_manager is False
    cfg.cache_config.kv_cache_layout = "LBHNC"  # what the engine core resolves on CPU
    heads = 2 // int(engine_args.get("tensor_parallel_size", 1))
    shape = {"block_size": BLOCK, "num_kv_heads": heads, "head_size": 32,
             "dtype": torch.float32}
    specs: dict[str, Any] = {n: FullAttentionSpec(**shape) for n in FULL_LAYERS}
    specs |= {n: SlidingWindowSpec(sliding_window=WINDOW, **shape) for n in WINDOW_LAYERS}
    groups = _get_kv_cache_groups()(cfg, specs)
    assert len(groups) == 2
    return cfg, KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=groups,
                              kv_cache_layout="LBHNC")


def connector(hybrid: tuple[Any, Any], role: str, addr: str, namespace: str, *,
              rank: int = 0) -> Any:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvstore.integrations.vllm_connector import KVStoreConnector

    cfg, kcc = hybrid
    cfg.parallel_config.rank = rank  # a worker's global rank, as vLLM's WorkerBase sets
    cfg.kv_transfer_config.kv_connector_extra_config = {"kvstore_addr": addr,
                                                        "namespace": namespace}
    return KVStoreConnector(cfg, KVConnectorRole[role], kcc)


def index_of(kcc: Any, kind: str) -> int:
    from vllm.v1.kv_cache_interface import SlidingWindowSpec

    return next(i for i, g in enumerate(kcc.kv_cache_groups)
                if isinstance(g.kv_cache_spec, SlidingWindowSpec) == (kind == "window"))


@pytest.fixture
def sched(hybrid: tuple[Any, Any], store_node: Any) -> Iterator[tuple[Any, Any]]:
    """A scheduler-side connector bound to vLLM's own KVCacheManager of the config
    (without its own prefix cache: these requests carry no block hashes)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    conn = connector(hybrid, "SCHEDULER", store_node.addr, f"hybrid-{time.time_ns()}")
    manager = KVCacheManager(hybrid[1], max_model_len=512, scheduler_block_size=BLOCK,
                             hash_block_size=BLOCK, enable_caching=False)
    conn.bind_kv_cache_manager(manager)
    yield conn, manager
    conn.shutdown()


def keys(conn: Any, kcc: Any, toks: list[int]) -> tuple[list[bytes], list[bytes]]:
    """The full-attention group's keys (the namespace's own) and the window group's."""
    full = [bytes(k) for k in block_keys(toks, BLOCK, conn.namespace)]
    ns = f"{conn.namespace}/kv-group={index_of(kcc, 'window')}:window"
    return full, [bytes(k) for k in block_keys(toks, BLOCK, ns)]


def test_plan_of_vllms_groups(hybrid: tuple[Any, Any], store_node: Any) -> None:
    conn = connector(hybrid, "SCHEDULER", store_node.addr, "plan")
    kcc = hybrid[1]
    from kvstore.integrations.vllm.groups import plan_from_config

    plan = plan_from_config(kcc)
    assert [(g.index, g.kind, g.span) for g in plan.groups] == [
        (i, "window" if i == index_of(kcc, "window") else "full",
         WINDOW if i == index_of(kcc, "window") else 0) for i in range(2)]
    assert plan.groups[plan.primary].kind == "full"
    assert conn.namespace == "plan"


def test_lookup_needs_every_group(sched: tuple[Any, Any], client: Client,
                                  hybrid: tuple[Any, Any]) -> None:
    conn, _ = sched
    toks = tokens(200, 11)  # 6 full blocks, 192 tokens loadable
    full, window = keys(conn, hybrid[1], toks)
    store(client, full)
    # The full-attention group alone holds the prefix: not enough.
    assert conn.get_num_new_matched_tokens(request(toks), 0) == (0, False)
    # Window blocks 3 and 4: the 5-block prefix (its window: tokens 97..159).
    store(client, window[3:5])
    assert conn.get_num_new_matched_tokens(request(toks), 0) == (160, True)
    # Block 5 too: the whole loadable prefix, without window blocks 0..2.
    store(client, window[5:6])
    assert conn.get_num_new_matched_tokens(request(toks), 0) == (192, True)


def test_loads_fill_vllms_block_table_and_skip_its_null_blocks(
        sched: tuple[Any, Any], client: Client, hybrid: tuple[Any, Any]) -> None:
    conn, manager = sched
    kcc = hybrid[1]
    f, w = index_of(kcc, "full"), index_of(kcc, "window")
    toks = tokens(200, 12)
    full, window = keys(conn, kcc, toks)
    store(client, full)
    store(client, window[4:6])
    req = request(toks)
    assert conn.get_num_new_matched_tokens(req, 0) == (192, True)
    # What vLLM's scheduler does for an asynchronous load of 192 external tokens.
    computed, local = manager.get_computed_blocks(req)[:2]
    assert local == 0
    assert manager.allocate_slots(req, 0, num_new_computed_tokens=0,
                                  new_computed_blocks=computed,
                                  num_external_computed_tokens=192,
                                  delay_cache_blocks=True) is not None
    conn.update_state_after_alloc(req, manager.get_blocks(req.request_id), 192)
    table = manager.get_block_ids(req.request_id)
    null = manager.block_pool.null_block.block_id
    # vLLM's sliding-window manager left the blocks before the window null...
    assert table[w][:4] == [null] * 4 and null not in table[w][4:6]
    assert null not in table[f][:6]

    meta = conn.build_connector_meta(sched_output())
    loads = {spec.group: spec for spec in meta.loads}
    plan_full = next(p for p, s in loads.items() if s.keys == full[:6])
    # ... and the connector loads exactly the others, into the ids vLLM allocated.
    assert loads[plan_full].block_ids == table[f][:6]
    (window_load,) = [s for p, s in loads.items() if p != plan_full]
    assert window_load.keys == window[4:6] and window_load.block_ids == table[w][4:6]

    # After the load, the request computes its last 8 prompt tokens. The window group's
    # blocks before the window were never in the store (and are null now): the step
    # saves the others, the full-attention ones again (they were asked from block 0).
    req.num_computed_tokens = 192
    assert manager.allocate_slots(req, 8) is not None
    table = manager.get_block_ids(req.request_id)
    meta = conn.build_connector_meta(sched_output(cached=[(req, 192)],
                                                  scheduled={req.request_id: 8}))
    saves = {(s.group, tuple(s.keys)): s for s in meta.saves}
    by_keys = {k: s for (_, k), s in saves.items()}
    assert by_keys[tuple(full[:6])].block_ids == table[f][:6]
    window_save = by_keys[tuple(window[4:6])]
    assert window_save.block_ids == table[w][4:6] and window_save.parent == window[3]
    assert len(meta.saves) == 2


def test_unsupported_groups_are_refused_by_name(hybrid: tuple[Any, Any],
                                                store_node: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.v1.kv_cache_interface import (
        CrossAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    from kvstore.integrations.vllm.groups import UnsupportedGroup
    from kvstore.integrations.vllm_connector import KVStoreConnector

    cfg, _ = hybrid
    shape = {"block_size": BLOCK, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}
    kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(FULL_LAYERS, FullAttentionSpec(**shape)),
        KVCacheGroupSpec(WINDOW_LAYERS, CrossAttentionSpec(**shape))])
    with pytest.raises(UnsupportedGroup, match="CrossAttentionSpec"):
        KVStoreConnector(cfg, KVConnectorRole.SCHEDULER, kcc)


# --- worker side ---------------------------------------------------------------------------

@pytest.fixture
def worker(hybrid: tuple[Any, Any], store_node: Any) -> Iterator[Any]:
    conn = connector(hybrid, "WORKER", store_node.addr, f"hybrid-worker-{time.time_ns()}")
    torch.manual_seed(0)
    conn.register_kv_caches({n: torch.randn(SHAPE) for n in FULL_LAYERS + WINDOW_LAYERS})
    try:
        yield conn
    finally:
        conn.shutdown()


def step(conn: Any, meta: Any) -> None:
    """One engine step as vLLM's model runner drives it (every layer's save hook)."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name in WINDOW_LAYERS + FULL_LAYERS:
        conn.save_kv_layer(name, None, None)
    conn.wait_for_save()
    conn.clear_connector_metadata()
    for fut in list(conn._saves):
        fut.result(timeout=30)


def finish(conn: Any, req_id: str) -> Any:
    deadline = time.monotonic() + 30
    while True:
        results = conn.get_transfer_results(set())
        if req_id in results.finished_recving:
            return results
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.01)


def layer_bytes(conn: Any, name: str, block: int) -> bytes:
    p, i = conn._groups.where[name]
    return bytes(conn._groups.caches[p][i][block].numpy().tobytes())


def test_each_group_saves_its_own_layers_and_loads_back(worker: Any, client: Client,
                                                        hybrid: tuple[Any, Any]) -> None:
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, LoadSpec, SaveSpec

    plan = worker._plan
    pos = {g.kind: p for p, g in enumerate(plan.groups)}
    toks = tokens(96, 13)
    full, window = keys(worker, hybrid[1], toks)
    step(worker, KVStoreConnectorMetadata(saves=[
        SaveSpec("r", full[:3], [5, 6, 7], None, group=pos["full"]),
        SaveSpec("r", window[1:3], [9, 10], window[0], group=pos["window"])]))
    assert worker.stats["layers_copied_in_hook"] == 4
    for key, block, names in [(full[0], 5, FULL_LAYERS), (window[2], 10, WINDOW_LAYERS)]:
        value = client.get_batch([key])[0]
        assert value is not None and parse_header(value)["num_layers"] == 2
        per_layer = (len(value) - HEADER_BYTES) // 2
        for i, name in enumerate(names):
            lo = HEADER_BYTES + i * per_layer
            assert value[lo : lo + per_layer] == layer_bytes(worker, name, block)
    assert client.exists([window[0]]) == [False]

    expected = {n: layer_bytes(worker, n, 10) for n in WINDOW_LAYERS}
    step(worker, KVStoreConnectorMetadata(loads=[
        LoadSpec("load", window[2:3], [30], group=pos["window"]),
        LoadSpec("load", full[:3], [20, 21, 22], group=pos["full"])]))
    results = finish(worker, "load")
    assert results.failed_recving == set() and worker.get_block_ids_with_load_errors() == set()
    assert {n: layer_bytes(worker, n, 30) for n in WINDOW_LAYERS} == expected
    assert layer_bytes(worker, FULL_LAYERS[1], 22) == layer_bytes(worker, FULL_LAYERS[1], 7)


def test_a_hybrid_load_failure_is_reported_per_request(worker: Any,
                                                       hybrid: tuple[Any, Any]) -> None:
    """vLLM takes block-level load errors from one group only: a hybrid model's failed
    load is reported as the request's (``failed_recving``), never as block ids."""
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, LoadSpec

    pos = {g.kind: p for p, g in enumerate(worker._plan.groups)}
    full, window = keys(worker, hybrid[1], tokens(64, 14))  # never stored
    step(worker, KVStoreConnectorMetadata(loads=[
        LoadSpec("miss", full[:2], [3, 4], group=pos["full"]),
        LoadSpec("miss", window[1:2], [5], group=pos["window"])]))
    results = finish(worker, "miss")
    assert results.failed_recving == {"miss"}
    assert worker.get_block_ids_with_load_errors() == set()
    assert worker.stats["missing_blocks"] == 3


def test_a_hybrid_model_at_tp2_stores_each_ranks_shard_of_each_group(
        hybrid_tp2: tuple[Any, Any], store_node: Any, client: Client) -> None:
    """Hybrid groups under tensor parallelism: each rank saves and loads its shard of
    each group's blocks (``shard_key`` of the group's key); a prefix counts only when
    every group and every shard holds what it needs; a rank's missing window shard
    fails that rank's load of the request (united over the ranks by vLLM)."""
    from vllm.v1.core.kv_cache_manager import KVCacheManager

    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, LoadSpec, SaveSpec

    kcc = hybrid_tp2[1]
    namespace = f"hybrid-tp2-{time.time_ns()}"
    shards = ("tp0of2.pp0of1", "tp1of2.pp0of1")
    workers: list[Any] = []
    sched = connector(hybrid_tp2, "SCHEDULER", store_node.addr, namespace)
    try:
        for rank in range(2):
            conn = connector(hybrid_tp2, "WORKER", store_node.addr, namespace, rank=rank)
            torch.manual_seed(rank)
            conn.register_kv_caches({n: torch.randn(64, 1, 32, 64)
                                     for n in FULL_LAYERS + WINDOW_LAYERS})
            workers.append(conn)
        assert [w._shards.own_shard for w in workers] == list(shards)
        pos = {g.kind: p for p, g in enumerate(workers[0]._plan.groups)}
        toks = tokens(200, 15)  # 6 full blocks, 192 tokens loadable
        full, window = keys(sched, kcc, toks)
        for conn in workers:
            step(conn, KVStoreConnectorMetadata(saves=[
                SaveSpec("r", full[:6], [1, 2, 3, 4, 5, 6], None, group=pos["full"]),
                SaveSpec("r", window[4:6], [7, 8], window[3], group=pos["window"])]))
        assert client.exists(full[:6] + window[4:6]) == [False] * 8  # only shards stored
        stored = {s: ([bytes(shard_key(k, s)) for k in full[:6]],
                      [bytes(shard_key(k, s)) for k in window[4:6]]) for s in shards}
        for f, w in stored.values():
            assert client.exists(f + w) == [True] * 8
        header = parse_header(client.get_batch([stored[shards[1]][1][0]])[0] or b"")
        assert header["key"] == stored[shards[1]][1][0] and header["num_layers"] == 2

        # The scheduler at TP=2 asks every shard of every group.
        manager = KVCacheManager(kcc, max_model_len=512, scheduler_block_size=BLOCK,
                                 hash_block_size=BLOCK, enable_caching=False)
        sched.bind_kv_cache_manager(manager)
        assert sched.get_num_new_matched_tokens(request(toks), 0) == (192, True)

        # Each rank loads its own shard of each group back (the ranks' caches differ).
        want = [{n: layer_bytes(w, n, 8) for n in WINDOW_LAYERS} for w in workers]
        assert want[0] != want[1]
        for conn in workers:
            step(conn, KVStoreConnectorMetadata(loads=[
                LoadSpec("load", window[4:6], [20, 21], group=pos["window"]),
                LoadSpec("load", full[:6], [30, 31, 32, 33, 34, 35], group=pos["full"])]))
            assert finish(conn, "load").failed_recving == set()
        for conn, expect in zip(workers, want, strict=True):
            assert {n: layer_bytes(conn, n, 21) for n in WINDOW_LAYERS} == expect
            assert layer_bytes(conn, FULL_LAYERS[0], 35) == layer_bytes(conn, FULL_LAYERS[0], 6)

        # Rank 1's shard of window block 5 gone: no prefix has its window any more, and
        # rank 1's load of the request fails as a whole while rank 0's succeeds.
        assert client.remove(stored[shards[1]][1][1])
        assert sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)
        for conn, failed in zip(workers, [set(), {"again"}], strict=True):
            step(conn, KVStoreConnectorMetadata(loads=[
                LoadSpec("again", window[4:6], [40, 41], group=pos["window"]),
                LoadSpec("again", full[:6], [42, 43, 44, 45, 46, 47], group=pos["full"])]))
            assert finish(conn, "again").failed_recving == failed
            assert conn.get_block_ids_with_load_errors() == set()
    finally:
        sched.shutdown()
        for conn in workers:
            conn.shutdown()
