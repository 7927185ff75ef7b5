"""vLLM's own engine (CPU build) with KVStoreConnector and a real kvstore node.

One engine per load mode (start-up is the expensive part, ~20-45 s): one request at a time
is an idle engine's, loaded inline in the step, unless ``load_inline_when_idle`` is off,
when it waits for the loader thread; each mode has its namespace and every test its own
prompt, so the tests do not depend on each other's blocks. The engine's
external-cache hit count is read from vLLM's own metrics
(``vllm:external_prefix_cache_hits``), its outputs are greedy token ids.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from vllm_llm import generate, kvstore_llm, wait_until

from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, parse_header, reseal

pytestmark = pytest.mark.timeout(600)

BLOCK = 32  # vLLM's CPU attention wants multiples of 32
PROMPT_TOKENS = 200  # 6 full blocks of 32; 6*32 = 192 tokens loadable (< 200)
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK


def prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 500, PROMPT_TOKENS)]


@pytest.fixture(scope="module", params=["inline", "async"])
def namespace(request: pytest.FixtureRequest) -> str:
    return f"engine-test-{request.param}-{time.time_ns()}"


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, store_node: Any, namespace: str) -> Iterator[Any]:
    inline = namespace.startswith("engine-test-inline")
    with kvstore_llm(tiny_llama, store_node.addr, namespace,
                     connector={"load_inline_when_idle": inline}) as llm:
        yield llm






def keys_of(tokens: list[int], namespace: str) -> list[bytes]:
    return [bytes(k) for k in block_keys(tokens[: LOADABLE], BLOCK, namespace)]


def wait_stored(client: Client, keys: list[bytes]) -> None:
    """Saves are asynchronous (a saver thread in the worker): wait until they landed."""
    wait_until(lambda: all(client.exists(keys)), timeout=30, what="the prompt's blocks saved")


def sound(value: bytes) -> bool:
    """The header's checksum matches the payload (what the connector checks)."""
    return parse_header(value)["checksum"] == xxhash.xxh3_64_intdigest(value[HEADER_BYTES:])


def garbled(value: bytes, seed: int) -> bytearray:
    """``value`` with its payload replaced by other float32 KV values, header untouched."""
    buf = bytearray(value)
    n = (len(buf) - HEADER_BYTES) // 4
    noise = np.random.default_rng(seed).normal(0, 3, n).astype("<f4")
    buf[HEADER_BYTES:] = noise.tobytes()
    return buf


def replace(client: Client, key: bytes, value: bytes) -> None:
    """Blocks are immutable in kvstore: replacing one is remove, then put."""
    assert client.remove(key)
    assert client.put_batch([key], [value]) == [True]


def test_second_run_loads_the_prefix_from_kvstore(engine: Any, client: Client,
                                                  store_node: Any, namespace: str) -> None:
    tokens = prompt(1)
    keys = keys_of(tokens, namespace)
    assert client.prefix_match(keys) == 0

    first, hits = generate(engine, tokens)
    assert hits == 0
    wait_stored(client, keys)
    for value in client.get_batch(keys):
        assert value is not None and sound(value)
        assert parse_header(value)["num_layers"] == 2

    assert engine.reset_prefix_cache()  # vLLM forgets its local copy
    node_hits = client.stats()["tiers"]["dram"]["hits"]
    second, hits = generate(engine, tokens)
    assert hits == LOADABLE == 192, "vLLM reports the prefix as an external cache hit"
    assert second == first, "identical greedy tokens with the prefix loaded from kvstore"
    assert client.stats()["tiers"]["dram"]["hits"] >= node_hits + len(keys)


def test_well_formed_foreign_bytes_change_the_output(engine: Any, client: Client,
                                                     namespace: str) -> None:
    """Blocks replaced in the store by other (checksum-valid) KV: the engine's output
    changes, so what it computes with comes from kvstore; restoring them restores it."""
    tokens = prompt(2)
    keys = keys_of(tokens, namespace)
    first, _ = generate(engine, tokens)
    wait_stored(client, keys)
    originals = client.get_batch(keys)

    for i, (key, value) in enumerate(zip(keys, originals, strict=True)):
        assert value is not None
        replace(client, key, reseal(garbled(value, seed=i)))
    assert engine.reset_prefix_cache()
    forged, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert forged != first, "the engine attended over the bytes kvstore returned"

    for key, value in zip(keys, originals, strict=True):
        assert value is not None
        replace(client, key, value)
    assert engine.reset_prefix_cache()
    restored, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert restored == first


def test_corrupted_block_is_refused_and_recomputed(engine: Any, client: Client,
                                                   namespace: str) -> None:
    """A block whose bytes no longer match its checksum is refused: vLLM recomputes it
    (kv_load_failure_policy="recompute"), the output stays the same, and the connector
    replaces the bad value in the store with the recomputed block."""
    tokens = prompt(3)
    keys = keys_of(tokens, namespace)
    first, _ = generate(engine, tokens)
    wait_stored(client, keys)
    bad = 2
    value = client.get_batch([keys[bad]])[0]
    assert value is not None
    corrupted = bytes(garbled(value, seed=99))  # same noise as above, checksum not fixed
    replace(client, keys[bad], corrupted)
    assert not sound(client.get_batch([keys[bad]])[0] or b"")

    assert engine.reset_prefix_cache()
    second, hits = generate(engine, tokens)
    assert hits == LOADABLE, "the scheduler planned the load; the worker refused block 2"
    assert second == first, "the refused block was recomputed, not used"

    def replaced() -> bool:
        v = client.get_batch([keys[bad]])[0]
        return v is not None and v != corrupted and sound(v)

    wait_until(replaced, timeout=30, what="the recomputed block saved in place of the bad one")

    assert engine.reset_prefix_cache()
    third, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert third == first


def test_the_documented_module_path_is_the_module() -> None:
    """``kvstore.integrations.vllm_connector`` (the path configs name) is the module itself."""
    import importlib

    old = importlib.import_module("kvstore.integrations.vllm_connector")
    new = importlib.import_module("kvstore.integrations.vllm.connector")
    assert old is new and old.KVStoreConnector is new.KVStoreConnector
