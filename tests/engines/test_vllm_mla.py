"""An MLA model in vLLM's CPU engine at tensor_parallel_size=2 with KVStoreConnector.

A random 2-layer DeepSeek-V2 (``tiny_mla``: a 512 + 64 latent cache, what vLLM's CPU MLA
kernels take; bfloat16, which vLLM's CPU kernels want for this model). The latent cache
is the same on both ranks, so rank 0 alone writes it, under the shard ``tp*of2.pp0of1``,
and both ranks load that copy (``kvstore.integrations.vllm.ranks``): nothing is stored
under either rank's own shard or under the block keys, the second run of a prompt loads
its whole loadable prefix with the same greedy tokens, and other KV in the copy changes
them.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_llm import generate, kvstore_llm

from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, reseal
from kvstore.integrations.vllm.ranks import ShardPlan, shard_chains

pytestmark = [pytest.mark.timeout(1200), pytest.mark.slow, pytest.mark.vllm_engine]

NAMESPACE = f"mla-test-{time.time_ns()}"
PROMPT_TOKENS = 200
TWO_CPU_WORKERS = {"VLLM_CPU_OMP_THREADS_BIND": "0|1", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"}


def noisy_bf16(value: bytes, seed: int) -> bytes:
    """``value`` with its payload replaced by other bfloat16 values, header untouched."""
    import torch

    n = (len(value) - HEADER_BYTES) // 2
    torch.manual_seed(seed)
    noise = (torch.randn(n) * 3).to(torch.bfloat16).view(torch.uint8).numpy().tobytes()
    return value[:HEADER_BYTES] + noise




def test_rank_zero_writes_the_latent_cache_once_and_both_ranks_load_it(
        tiny_mla: Path, store_node: Any, client: Client, monkeypatch: pytest.MonkeyPatch
        ) -> None:
    for k, v in TWO_CPU_WORKERS.items():
        monkeypatch.setenv(k, v)
    tokens = [int(t) for t in np.random.default_rng(31).integers(3, 500, PROMPT_TOKENS)]
    with kvstore_llm(tiny_mla, store_node.addr, NAMESPACE, tensor_parallel_size=2,
                     distributed_executor_backend="mp", dtype="bfloat16",
                     block_size=None) as llm:
        assert llm.llm_engine.vllm_config.model_config.use_mla
        block = llm.llm_engine.vllm_config.cache_config.block_size
        loadable = (PROMPT_TOKENS - 1) // block * block
        keys = [bytes(k) for k in block_keys(tokens[:loadable], block, NAMESPACE)]
        plan = ShardPlan(tp=2, mla=True)
        assert plan.shards == ("tp*of2.pp0of1",)
        (copy,) = plan.shard_chains(keys)

        first, hits = generate(llm, tokens)
        assert hits == 0
        deadline = time.monotonic() + 60
        while not all(client.exists(copy)):
            assert time.monotonic() < deadline, "rank 0's latent blocks never stored"
            time.sleep(0.05)
        for chain in [keys, *shard_chains(keys, ShardPlan(tp=2).shards)]:
            assert client.prefix_match(chain) == 0, "one copy, under the MLA shard only"

        assert llm.reset_prefix_cache()
        second, hits = generate(llm, tokens)
        assert hits == loadable
        assert second == first
        assert len(set(first)) > 1, "a greedy output that depends on the prompt's KV"

        # Other well-formed latent KV in the one copy changes the output: the engine
        # computed with the copy it loaded.
        originals = client.get_batch(copy)
        for i, (key, value) in enumerate(zip(copy, originals, strict=True)):
            assert value is not None and client.remove(key)
            assert client.put_batch([key], [reseal(noisy_bf16(value, seed=i))]) == [True]
        assert llm.reset_prefix_cache()
        forged, hits = generate(llm, tokens)
        assert hits == loadable
        assert forged != first
