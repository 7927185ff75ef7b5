"""vLLM's CPU engine at tensor_parallel_size=2 with KVStoreConnector and a real node.

Two CPU workers on this 2-core machine (``VLLM_CPU_OMP_THREADS_BIND="0|1"``,
``VLLM_CPU_NUM_OF_RESERVED_CPU=0``), each holding one of the tiny Llama's two KV heads.
Every rank saves and loads its own shard (``kvstore.integrations.vllm.ranks``): the
second run of a prompt loads the whole prefix (identical greedy tokens, external hits =
the loadable prefix); a shard missing on one rank cuts the hit there; a shard refused on
one rank is recomputed on both; and a TP=1 engine under the same namespace on the same
node gets no hit from the TP=2 engine's blocks. One TP=2 engine for the class (start-up
is ~1-2 min here), then one TP=1 engine. Then a hybrid model (the tiny Gemma 3: a
full-attention and a sliding-window group) at TP=2: each rank loads its shard of each
group's needed blocks; one rank's missing window shard serves no prefix; one rank's
refused window shard recomputes the request on both ranks.
"""

from __future__ import annotations

import os
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
from kvstore.integrations.vllm.ranks import ShardPlan

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow, pytest.mark.vllm_engine]

BLOCK = 32
NAMESPACE = f"tp-test-{time.time_ns()}"
PROMPT_TOKENS = 200  # 6 full blocks; 192 tokens loadable (< 200)
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK
SHARDS = ShardPlan(tp=2).shards
TWO_CPU_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 500, PROMPT_TOKENS)]


def keys_of(tokens: list[int]) -> list[bytes]:
    return [bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK, NAMESPACE)]


def shard_keys(tokens: list[int]) -> list[list[bytes]]:
    """Per rank, the stored keys of the prompt's loadable blocks."""
    return ShardPlan(tp=2).shard_chains(keys_of(tokens))






def wait_stored(client: Client, keys: list[bytes]) -> None:
    wait_until(lambda: all(client.exists(keys)), timeout=60, what="the shards saved")


def sound(value: bytes) -> bool:
    return parse_header(value)["checksum"] == xxhash.xxh3_64_intdigest(value[HEADER_BYTES:])


def garbled(value: bytes, seed: int) -> bytearray:
    """``value`` with its payload replaced by other float32 KV values, header untouched."""
    buf = bytearray(value)
    n = (len(buf) - HEADER_BYTES) // 4
    buf[HEADER_BYTES:] = np.random.default_rng(seed).normal(0, 3, n).astype("<f4").tobytes()
    return buf


def replace(client: Client, key: bytes, value: bytes) -> None:
    assert client.remove(key)
    assert client.put_batch([key], [value]) == [True]


@pytest.fixture(scope="class")
def tp2(tiny_llama: Path, store_node: Any) -> Iterator[Any]:
    saved = {k: os.environ.get(k) for k in TWO_CPU_WORKERS}
    os.environ.update(TWO_CPU_WORKERS)
    try:
        with kvstore_llm(tiny_llama, store_node.addr, NAMESPACE, tensor_parallel_size=2,
                         distributed_executor_backend="mp") as llm:
            yield llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class TestTwoRanks:
    def test_second_run_loads_every_ranks_shard(self, tp2: Any, client: Client) -> None:
        tokens = prompt(21)
        first, hits = generate(tp2, tokens)
        assert hits == 0
        chains = shard_keys(tokens)
        for chain in chains:
            wait_stored(client, chain)
        assert client.prefix_match(keys_of(tokens)) == 0, "nothing under the block keys"
        values = [client.get_batch(chain) for chain in chains]
        for chain, vals in zip(chains, values, strict=True):
            assert [parse_header(v or b"")["key"] for v in vals] == chain
            assert all(v is not None and sound(v) for v in vals)
        assert values[0][0] != values[1][0], "each rank stored its own KV heads"

        assert tp2.reset_prefix_cache()
        second, hits = generate(tp2, tokens)
        assert hits == LOADABLE == 192
        assert second == first, "identical greedy tokens with both shards loaded"

    def test_a_shard_missing_on_one_rank_ends_the_hit_there(self, tp2: Any,
                                                            client: Client) -> None:
        tokens = prompt(22)
        first, _ = generate(tp2, tokens)
        chains = shard_keys(tokens)
        for chain in chains:
            wait_stored(client, chain)
        assert client.remove(chains[1][3])  # rank 1's shard of block 3

        assert tp2.reset_prefix_cache()
        second, hits = generate(tp2, tokens)
        assert hits == 3 * BLOCK, "blocks 0-2 have both shards; block 3 has one"
        assert second == first
        # The recomputed block 3 is saved again, so the next run loads the whole prefix.
        wait_stored(client, chains[1])
        assert tp2.reset_prefix_cache()
        third, hits = generate(tp2, tokens)
        assert (third, hits) == (first, LOADABLE)

    def test_a_shard_refused_on_one_rank_is_recomputed_on_both(self, tp2: Any,
                                                               client: Client) -> None:
        tokens = prompt(23)
        first, _ = generate(tp2, tokens)
        chains = shard_keys(tokens)
        for chain in chains:
            wait_stored(client, chain)
        bad = chains[1][2]
        value = client.get_batch([bad])[0]
        assert value is not None
        corrupted = bytes(garbled(value, seed=5))  # checksum not fixed: refused
        replace(client, bad, corrupted)

        assert tp2.reset_prefix_cache()
        second, hits = generate(tp2, tokens)
        assert hits == LOADABLE, "the scheduler planned the load; rank 1 refused block 2"
        assert second == first, "block 2 on, recomputed on both ranks"

        def replaced() -> bool:
            v = client.get_batch([bad])[0]
            return v is not None and v != corrupted and sound(v)

        wait_until(replaced, timeout=60, what="the recomputed shard saved in place")

    def test_each_rank_attends_over_its_own_loaded_shard(self, tp2: Any,
                                                         client: Client) -> None:
        """Well-formed other KV in rank 1's shards only changes the output: rank 1
        computes with what it loaded; restoring them restores the output."""
        tokens = prompt(24)
        first, _ = generate(tp2, tokens)
        chains = shard_keys(tokens)
        for chain in chains:
            wait_stored(client, chain)
        originals = client.get_batch(chains[1])
        for i, (key, value) in enumerate(zip(chains[1], originals, strict=True)):
            assert value is not None
            replace(client, key, reseal(garbled(value, seed=i)))
        assert tp2.reset_prefix_cache()
        forged, hits = generate(tp2, tokens)
        assert hits == LOADABLE
        assert forged != first

        for key, value in zip(chains[1], originals, strict=True):
            assert value is not None
            replace(client, key, value)
        assert tp2.reset_prefix_cache()
        restored, hits = generate(tp2, tokens)
        assert (restored, hits) == (first, LOADABLE)


def test_a_one_rank_engine_gets_nothing_from_the_two_rank_engines_blocks(
        tiny_llama: Path, store_node: Any, client: Client) -> None:
    """After the TP=2 engine (class above) stored prompt 21 in every shard: a TP=1 engine
    under the same namespace on the same node computes it all itself."""
    tokens = prompt(21)
    for chain in shard_keys(tokens):
        assert all(client.exists(chain))
    with kvstore_llm(tiny_llama, store_node.addr, NAMESPACE) as tp1:
        _, hits = generate(tp1, tokens)
        assert hits == 0
        wait_stored(client, keys_of(tokens))  # its own blocks, under the block keys
        assert tp1.reset_prefix_cache()
        _, hits = generate(tp1, tokens)
        assert hits == LOADABLE


# --- a hybrid model at TP=2 ------------------------------------------------------------------

HYBRID_NAMESPACE = f"tp-hybrid-test-{time.time_ns()}"
HYBRID_BLOCKS = LOADABLE // BLOCK
IN_WINDOW = range(HYBRID_BLOCKS - WINDOW // BLOCK, HYBRID_BLOCKS)
"""The window group's blocks the token after the 192 loaded ones reads: 4 and 5."""


@pytest.fixture(scope="class")
def tp2_hybrid(tmp_path_factory: pytest.TempPathFactory, store_node: Any) -> Iterator[Any]:
    """The tiny Gemma 3 (a full-attention and a sliding-window group) at TP=2."""
    model = write_tiny_gemma3(tmp_path_factory.mktemp("tiny-gemma3-tp2"))
    saved = {k: os.environ.get(k) for k in TWO_CPU_WORKERS}
    os.environ.update(TWO_CPU_WORKERS)
    try:
        with kvstore_llm(model, store_node.addr, HYBRID_NAMESPACE, tensor_parallel_size=2,
                         distributed_executor_backend="mp") as llm:
            yield llm
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def hybrid_shards(tokens: list[int], client: Client) -> tuple[list[list[bytes]],
                                                               list[list[bytes]]]:
    """Per rank, the stored keys of the full-attention group's and the window group's
    loadable blocks (``shard_key`` of each group's key), once every one is saved."""
    plan = ShardPlan(tp=2)
    full = plan.shard_chains([bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK,
                                                            HYBRID_NAMESPACE)])
    for chain in full:
        wait_stored(client, chain)
    for g in (0, 1):
        ns = f"{HYBRID_NAMESPACE}/kv-group={g}:window"
        window = plan.shard_chains([bytes(k) for k in block_keys(tokens[:LOADABLE], BLOCK,
                                                                  ns)])
        if any(client.exists(window[0])):
            for chain in window:
                wait_stored(client, chain)
            return full, window
    raise AssertionError("no sliding-window group shards in the store")


class TestHybridTwoRanks:
    def test_each_rank_loads_its_shard_of_each_group(self, tp2_hybrid: Any,
                                                     client: Client) -> None:
        assert tp2_hybrid.llm_engine.vllm_config.scheduler_config \
            .disable_hybrid_kv_cache_manager is False
        tokens = prompt(31)
        first, hits = generate(tp2_hybrid, tokens)
        assert hits == 0
        full, window = hybrid_shards(tokens, client)
        assert client.prefix_match([bytes(k) for k in block_keys(
            tokens[:LOADABLE], BLOCK, HYBRID_NAMESPACE)]) == 0, "only shards stored"
        values = client.get_batch([full[0][0], full[1][0], window[0][4], window[1][4]])
        assert [parse_header(v or b"")["key"] for v in values] == [
            full[0][0], full[1][0], window[0][4], window[1][4]]
        assert values[0] != values[1] and values[2] != values[3]
        # Neither rank's window blocks before the window are needed.
        for chain in window:
            for i in range(HYBRID_BLOCKS):
                if i not in IN_WINDOW:
                    assert client.remove(chain[i])
        assert tp2_hybrid.reset_prefix_cache()
        second, hits = generate(tp2_hybrid, tokens)
        assert hits == LOADABLE == 192, "every shard of both groups' needed blocks loaded"
        assert second == first

        # Rank 1's shard of a window block missing: no prefix is served, although rank 0
        # and the full-attention group hold all of it.
        assert client.remove(window[1][IN_WINDOW[-1]])
        assert tp2_hybrid.reset_prefix_cache()
        third, hits = generate(tp2_hybrid, tokens)
        assert hits == 0
        assert third == first

    def test_a_window_shard_refused_on_one_rank_recomputes_the_request(
            self, tp2_hybrid: Any, client: Client) -> None:
        tokens = prompt(32)
        first, _ = generate(tp2_hybrid, tokens)
        _, window = hybrid_shards(tokens, client)
        bad = IN_WINDOW[0]
        value = client.get_batch([window[1][bad]])[0]
        assert value is not None
        corrupted = value[:HEADER_BYTES] + bytes(len(value) - HEADER_BYTES)  # checksum kept
        replace(client, window[1][bad], corrupted)

        assert tp2_hybrid.reset_prefix_cache()
        second, hits = generate(tp2_hybrid, tokens)
        # Rank 1 refused (and removed) its shard; vLLM united the ranks' failed loads and
        # recomputed the request, whose second lookup found the 4-block prefix (window
        # blocks 2 and 3 on both ranks) and loaded it too.
        assert hits == LOADABLE + bad * BLOCK
        assert second == first

        def replaced() -> bool:
            v = client.get_batch([window[1][bad]])[0]
            return v is not None and v != corrupted and sound(v)

        wait_until(replaced, 30, "rank 1's recomputed window shard saved again")
        assert tp2_hybrid.reset_prefix_cache()
        third, hits = generate(tp2_hybrid, tokens)
        assert hits == LOADABLE
        assert third == first
