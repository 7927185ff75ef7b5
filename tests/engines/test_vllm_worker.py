"""KVStoreConnector's worker side on real cache tensors and a real kvstore node, no
engine: the save path (per-layer copies, sealed values, parents), the load path, and
every reason a fetched value is refused."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from kvstore import Client, block_keys
from kvstore.core.ports import free_port
from kvstore.integrations.vllm.blocks import HEADER_BYTES, BlockLayout, parse_header, reseal

LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]
SHAPE = (64, 2, 32, 64)  # [num_blocks, kv_heads, block_size, 2 * head_size], as CPU_ATTN


@pytest.fixture
def worker(make_connector: Any, store_node: Any) -> Iterator[Any]:
    conn = make_connector("WORKER", store_node.addr, namespace=f"worker-{time.time_ns()}")
    torch.manual_seed(0)
    conn.register_kv_caches({name: torch.randn(SHAPE) for name in LAYERS})
    try:
        yield conn
    finally:
        conn.shutdown()


def caches(conn: Any) -> list[torch.Tensor]:
    return conn._caches


def run_step(conn: Any, meta: Any, *, hook_layers: list[str] = LAYERS) -> None:
    """One engine step as vLLM's model runner drives it."""
    conn.bind_connector_metadata(meta)
    conn.start_load_kv(None)
    for name, kv in zip(LAYERS, caches(conn), strict=True):
        if name in hook_layers:
            conn.wait_for_layer_load(name)
            conn.save_kv_layer(name, kv, None)
    conn.wait_for_save()
    conn.clear_connector_metadata()


def drain_saves(conn: Any) -> None:
    for fut in list(conn._saves):
        fut.result(timeout=30)


def finish_load(conn: Any, req_id: str) -> set[int]:
    """Steps until the load of ``req_id`` is reported; returns the refused block ids."""
    deadline = time.monotonic() + 30
    while True:
        _, recving = conn.get_finished(set())
        errors = conn.get_block_ids_with_load_errors()
        if recving and req_id in recving:
            return errors
        assert not errors
        assert time.monotonic() < deadline, "load never finished"
        time.sleep(0.01)


def save_blocks(conn: Any, keys: list[bytes], ids: list[int], **kw: Any) -> None:
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, SaveSpec

    run_step(conn, KVStoreConnectorMetadata(saves=[SaveSpec("r", keys, ids, None)]), **kw)
    drain_saves(conn)


def load_blocks(conn: Any, keys: list[bytes], ids: list[int], *, inline: bool = False
                ) -> set[int]:
    """Loads as the scheduler asked (``inline``: in the step); returns the refused ids."""
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, LoadSpec

    run_step(conn, KVStoreConnectorMetadata(loads=[LoadSpec("r", keys, ids, inline=inline)]))
    if not inline:
        return finish_load(conn, "r")
    # Written before start_load_kv returned: this step's output carries the refusals,
    # and no step reports the request as received (vLLM never waited for it).
    _, recving = conn.get_finished(set())
    assert not recving
    return conn.get_block_ids_with_load_errors()


LOAD_MODES = pytest.mark.parametrize("inline", [False, True], ids=["async", "inline"])


def keys_for(conn: Any, n: int, seed: int) -> list[bytes]:
    toks = [(seed * 7 + i * 31) % 500 for i in range(32 * n)]
    return [bytes(k) for k in block_keys(toks, 32, conn.namespace)]


def test_layout_of_a_saved_block(worker: Any, client: Client) -> None:
    keys = keys_for(worker, 3, 1)
    save_blocks(worker, keys, [5, 9, 2])
    assert worker.stats["layers_copied_in_hook"] == 2
    layout = worker._layout
    assert layout.value_bytes == HEADER_BYTES + 2 * 2 * 32 * 64 * 4
    for key, block in zip(keys, [5, 9, 2], strict=True):
        value = client.get_batch([key])[0]
        assert value is not None and len(value) == layout.value_bytes
        header = parse_header(value)
        assert header["key"] == key and header["num_layers"] == 2
        assert layout.check(memoryview(value), key, len(value)) is None
        for layer, kv in enumerate(caches(worker)):
            lo = HEADER_BYTES + layer * layout.layer_bytes
            assert value[lo : lo + layout.layer_bytes] == kv[block].numpy().tobytes()


def test_a_layer_without_its_hook_is_copied_at_step_end(worker: Any, client: Client) -> None:
    keys = keys_for(worker, 1, 2)
    save_blocks(worker, keys, [3], hook_layers=LAYERS[:1])
    assert worker.stats["layers_copied_at_step_end"] == 1
    value = client.get_batch(keys)[0]
    assert value is not None
    assert value[HEADER_BYTES + worker._layout.layer_bytes :] == caches(worker)[1][3].numpy(
        ).tobytes()


@LOAD_MODES
def test_save_then_load_round_trip(worker: Any, client: Client, inline: bool) -> None:
    keys = keys_for(worker, 3, 3)
    before = [kv[[1, 2, 3]].clone() for kv in caches(worker)]
    save_blocks(worker, keys, [1, 2, 3])
    for kv in caches(worker):
        kv[[40, 41, 42]] = 0
    assert load_blocks(worker, keys, [40, 41, 42], inline=inline) == set()
    for kv, old in zip(caches(worker), before, strict=True):
        assert torch.equal(kv[[40, 41, 42]], old)
    assert worker.stats["loaded_blocks"] == 3


def _bad_values(layout: BlockLayout, good: bytes, other_key_value: bytes) -> dict[str, bytes]:
    flipped = bytearray(good)
    flipped[HEADER_BYTES + 100] ^= 0xFF
    wrong_layout = bytearray(good)
    wrong_layout[24] ^= 1  # the layout fingerprint
    other_engine = bytearray(good)
    other_engine[56] ^= 1  # the engine identity
    before_identities = bytearray(good)
    before_identities[56:64] = bytes(8)  # written before values carried one
    return {
        "another engine identity": bytes(other_engine),
        "another engine identity (written before)": bytes(before_identities),
        "checksum mismatch": bytes(flipped),
        "size": good[:-4],
        "stored under another key": other_key_value,
        "another engine layout": bytes(wrong_layout),
        "not a vLLM block": reseal(b"\0" * len(good)),
    }


@pytest.mark.parametrize("reason", ["checksum mismatch", "size", "stored under another key",
                                    "another engine layout", "not a vLLM block",
                                    "another engine identity",
                                    "another engine identity (written before)"])
@LOAD_MODES
def test_bad_values_are_refused_and_removed(worker: Any, client: Client, reason: str,
                                            inline: bool) -> None:
    keys = keys_for(worker, 3, 4)
    save_blocks(worker, keys, [1, 2, 3])
    good = client.get_batch(keys)
    assert all(v is not None for v in good)
    bad = _bad_values(worker._layout, good[1], good[0])[reason]
    assert client.remove(keys[1]) and client.put_batch([keys[1]], [bad]) == [True]
    assert worker._layout.check(memoryview(bad), keys[1], len(bad)).startswith(
        reason.removesuffix(" (written before)"))

    for kv in caches(worker):
        kv[[50, 51, 52]] = 0
    refused = load_blocks(worker, keys, [50, 51, 52], inline=inline)
    assert refused == {51, 52}, "a block and every block after it are recomputed"
    assert worker.stats["refused_blocks"] == 1
    for kv in caches(worker):
        assert torch.equal(kv[50], kv[1])
        assert not kv[51].any(), "a refused block is never written to the cache"
    assert client.exists(keys) == [True, False, True], "the bad value left the store"


def test_a_value_larger_than_a_block_is_refused_and_removed(worker: Any, client: Client
                                                            ) -> None:
    keys = keys_for(worker, 3, 6)
    save_blocks(worker, keys, [1, 2, 3])
    good = client.get_batch(keys)
    assert good[1] is not None
    assert client.remove(keys[1]) and client.put_batch([keys[1]], [good[1] + bytes(64)]) == [True]
    for kv in caches(worker):
        kv[[50, 51, 52]] = 0
    # Read into block-sized buffers the batch fails (BufferTooSmall): the load fetches it
    # as bytes instead, keeps the block before and refuses the larger one.
    refused = load_blocks(worker, keys, [50, 51, 52])
    assert refused == {51, 52}
    assert worker.stats["refused_blocks"] == 1
    for kv in caches(worker):
        assert torch.equal(kv[50], kv[1])
        assert not kv[51].any()
    assert client.exists(keys) == [True, False, True]


@LOAD_MODES
def test_missing_blocks_are_reported_not_removed(worker: Any, client: Client, inline: bool
                                                 ) -> None:
    keys = keys_for(worker, 3, 5)
    save_blocks(worker, keys[:1], [1])
    refused = load_blocks(worker, keys, [55, 56, 57], inline=inline)
    assert refused == {56, 57}
    assert worker.stats["missing_blocks"] == 2
    assert worker.stats["refused_blocks"] == 0


@LOAD_MODES
def test_a_dead_store_fails_the_load_softly(make_connector: Any, inline: bool) -> None:
    conn = make_connector("WORKER", f"127.0.0.1:{free_port()}", timeout=3)
    conn.register_kv_caches({name: torch.zeros(SHAPE) for name in LAYERS})
    try:
        keys = keys_for(conn, 2, 6)
        assert load_blocks(conn, keys, [3, 4], inline=inline) == {3, 4}
        save_blocks(conn, keys, [3, 4])  # logged, not raised
        assert conn.stats["save_errors"] == 1
    finally:
        conn.shutdown()


def test_two_requests_completing_the_same_block_in_one_step(worker: Any, client: Client
                                                            ) -> None:
    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, SaveSpec

    keys = keys_for(worker, 2, 8)
    meta = KVStoreConnectorMetadata(saves=[SaveSpec("a", keys, [1, 2], None),
                                           SaveSpec("b", keys[:1], [3], None)])
    run_step(worker, meta)
    drain_saves(worker)
    assert worker.stats["saved_blocks"] == 2 and worker.stats["save_errors"] == 0
    value = client.get_batch(keys[:1])[0]
    assert value is not None
    assert value[HEADER_BYTES : HEADER_BYTES + worker._layout.layer_bytes] == caches(
        worker)[0][1].numpy().tobytes()


def test_a_namespace_shared_by_engines_on_other_weights_loads_nothing(
        make_connector: Any, store_node: Any, client: Client, tiny_llama: Any,
        tmp_path: Any) -> None:
    """Two engines given one explicit namespace (so one key for one prompt) on different
    weights: the second refuses the first's values by their header's engine identity."""
    import shutil

    from conductor.front.vllm_procs import write_tiny_llama

    other = write_tiny_llama(shutil.copytree(tiny_llama, tmp_path / "other"), seed=9,
                             layers=2, max_positions=2048)
    ns = f"shared-{time.time_ns()}"
    a = make_connector("WORKER", store_node.addr, namespace=ns)
    b = make_connector("WORKER", store_node.addr, namespace=ns, model=other)
    torch.manual_seed(0)
    a.register_kv_caches({name: torch.randn(SHAPE) for name in LAYERS})
    b.register_kv_caches({name: torch.zeros(SHAPE) for name in LAYERS})
    try:
        assert a._layout.identity != b._layout.identity
        keys = keys_for(a, 2, 10)
        assert keys == keys_for(b, 2, 10)
        save_blocks(a, keys, [1, 2])
        assert load_blocks(b, keys, [1, 2]) == {1, 2}
        assert b.stats["refused_blocks"] == 2 and b.stats["loaded_blocks"] == 0
        assert all(not kv.any() for kv in caches(b))
    finally:
        a.shutdown()
        b.shutdown()


def test_saves_block_a_step_only_when_max_pending_saves_are_in_flight(
        make_connector: Any, store_node: Any, client: Client) -> None:
    import threading

    from kvstore.integrations.vllm_connector import KVStoreConnectorMetadata, SaveSpec

    conn = make_connector("WORKER", store_node.addr, namespace=f"pending-{time.time_ns()}",
                          max_pending_saves=2)
    conn.register_kv_caches({name: torch.randn(SHAPE) for name in LAYERS})
    gate = threading.Event()
    try:
        conn._saver.submit(gate.wait)  # the saver thread is busy until the gate opens
        keys = keys_for(conn, 3, 40)
        steps = [KVStoreConnectorMetadata(saves=[SaveSpec(f"r{i}", [k], [i], None)])
                 for i, k in enumerate(keys)]
        # Two batches in flight: both steps return with the saver still blocked.
        run_step(conn, steps[0])
        run_step(conn, steps[1])
        assert len(conn._saves) == 2 and not any(f.done() for f in conn._saves)
        # The third waits for the oldest batch.
        third = threading.Thread(target=run_step, args=(conn, steps[2]))
        third.start()
        third.join(timeout=1.0)  # a step that did not wait would be over by now
        assert third.is_alive()
        gate.set()
        third.join(timeout=30)
        assert not third.is_alive()
        drain_saves(conn)
        assert all(v is not None for v in client.get_batch(keys))
    finally:
        gate.set()
        conn.shutdown()
