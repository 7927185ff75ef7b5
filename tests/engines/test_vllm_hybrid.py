"""A hybrid model in vLLM's own engine (CPU build) with KVStoreConnector and a real node.

The model is a random 4-layer Gemma 3 (``hybrid_models.write_tiny_gemma3``): two layers
of sliding-window attention (64 tokens) and two of full attention, which vLLM's hybrid
allocator keeps in two KV cache groups (the connector supports it, so vLLM leaves the
allocator on). The full-attention group is stored under the namespace's own keys, the
sliding-window group under keys of its own; the window group needs only the blocks
inside its window.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash
from hybrid_models import WINDOW, write_tiny_gemma3
from vllm_llm import generate, kvstore_llm, wait_until

from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, parse_header, reseal

pytestmark = [pytest.mark.timeout(900), pytest.mark.vllm_engine]

BLOCK = 32
NAMESPACE = f"hybrid-test-{time.time_ns()}"
PROMPT_TOKENS = 200  # 6 full blocks; 192 tokens loadable (vLLM computes the last itself)
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
BLOCKS = LOADABLE // BLOCK
IN_WINDOW = range(BLOCKS - WINDOW // BLOCK, BLOCKS)
"""The window group's blocks the token after the 192 loaded ones reads: 4 and 5."""


def prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 500, PROMPT_TOKENS)]


@pytest.fixture(scope="module")
def tiny_gemma3(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3"))


@pytest.fixture(scope="module")
def engine(tiny_gemma3: Path, store_node: Any) -> Iterator[Any]:
    with kvstore_llm(tiny_gemma3, store_node.addr, NAMESPACE) as llm:
        yield llm






def group_keys(tokens: list[int], client: Client) -> tuple[list[bytes], list[bytes]]:
    """The full-attention group's keys (the namespace's own) and the window group's
    (``NAMESPACE/kv-group=G:window``, G being vLLM's index of that group), once saved."""
    full = [bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK, NAMESPACE)]
    wait_until(lambda: all(client.exists(full)), 60, "the full-attention blocks saved")
    for g in (0, 1):
        ns = f"{NAMESPACE}/kv-group={g}:window"
        window = [bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK, ns)]
        if any(client.exists(window)):
            wait_until(lambda w=window: all(client.exists(w)), 60, "the window blocks saved")
            return full, window
    raise AssertionError("no sliding-window group blocks in the store")


def sound(value: bytes) -> bool:
    return parse_header(value)["checksum"] == xxhash.xxh3_64_intdigest(value[HEADER_BYTES:])


def test_the_engine_runs_two_groups(engine: Any) -> None:
    """vLLM kept its hybrid allocator on for the connector (SupportsHMA): two groups."""
    config = engine.llm_engine.vllm_config
    assert config.scheduler_config.disable_hybrid_kv_cache_manager is False


def test_only_the_window_is_needed_and_every_group_is_checked(engine: Any,
                                                              client: Client) -> None:
    tokens = prompt(1)
    first, hits = generate(engine, tokens)
    assert hits == 0
    full, window = group_keys(tokens, client)
    values = client.get_batch(full + window)
    assert all(v is not None and sound(v) for v in values)
    # Each value holds its own group's layers: two of the four each.
    assert {parse_header(v)["num_layers"] for v in values if v is not None} == {2}

    # The window group's blocks before the window are not needed to load the prefix.
    for i in range(BLOCKS):
        if i not in IN_WINDOW:
            assert client.remove(window[i])
    assert engine.reset_prefix_cache()
    second, hits = generate(engine, tokens)
    assert hits == LOADABLE == 192, "both groups' needed blocks were loaded"
    assert second == first, "identical greedy tokens with the prefix loaded from kvstore"

    # One window block missing: no prefix has every group's blocks (the shorter
    # prefixes need the window blocks removed above), so nothing is loaded, although
    # the full-attention group holds all of it.
    assert client.remove(window[IN_WINDOW[-1]])
    assert engine.reset_prefix_cache()
    third, hits = generate(engine, tokens)
    assert hits == 0
    assert third == first


def test_the_window_group_computes_with_what_kvstore_returned(engine: Any,
                                                              client: Client) -> None:
    """The window group's blocks replaced in the store by other (checksum-valid) KV: the
    output changes, so the sliding-window layers attend over the bytes kvstore returned
    (not over what vLLM's freed blocks still held); restoring them restores it."""
    tokens = prompt(3)
    first, _ = generate(engine, tokens)
    _, window = group_keys(tokens, client)
    originals = {i: client.get_batch([window[i]])[0] for i in IN_WINDOW}
    rng = np.random.default_rng(7)
    for i, value in originals.items():
        assert value is not None
        forged = bytearray(value)
        n = (len(forged) - HEADER_BYTES) // 4
        forged[HEADER_BYTES:] = rng.normal(0, 3, n).astype("<f4").tobytes()
        assert client.remove(window[i])
        assert client.put_batch([window[i]], [reseal(forged)]) == [True]
    assert engine.reset_prefix_cache()
    forged_out, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert forged_out != first

    for i, value in originals.items():
        assert value is not None and client.remove(window[i])
        assert client.put_batch([window[i]], [value]) == [True]
    assert engine.reset_prefix_cache()
    restored, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert restored == first


def test_a_refused_window_block_recomputes_the_request(engine: Any, client: Client) -> None:
    """A window-group block whose bytes no longer match its checksum: the worker refuses
    it, vLLM recomputes the request (a hybrid model's load fails per request), the output
    is unchanged and the recomputed block replaces the bad one in the store."""
    tokens = prompt(2)
    first, _ = generate(engine, tokens)
    _, window = group_keys(tokens, client)
    bad = IN_WINDOW[0]
    value = client.get_batch([window[bad]])[0]
    assert value is not None
    corrupted = bytearray(value)
    corrupted[HEADER_BYTES:] = bytes(len(corrupted) - HEADER_BYTES)  # zeros, checksum kept
    assert client.remove(window[bad])
    assert client.put_batch([window[bad]], [bytes(corrupted)]) == [True]

    assert engine.reset_prefix_cache()
    second, hits = generate(engine, tokens)
    # The scheduler planned the load of 192 tokens; the worker refused the block (and
    # removed it from the store), vLLM put the request back to waiting, and its second
    # lookup found the longest prefix every group still serves: 4 blocks (window blocks
    # 2 and 3), loaded too. vLLM counts both loads.
    assert hits == LOADABLE + bad * BLOCK
    assert second == first, "the request was recomputed, not run on the refused block"

    def replaced() -> bool:
        v = client.get_batch([window[bad]])[0]
        return v is not None and v != bytes(corrupted) and sound(v)

    wait_until(replaced, 30, "the recomputed window block saved in place of the bad one")
    assert engine.reset_prefix_cache()
    third, hits = generate(engine, tokens)
    assert hits == LOADABLE
    assert third == first
