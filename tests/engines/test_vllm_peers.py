"""The benchmarks' Mooncake peer for real (``benchmarks.vllm_peers``): vLLM's own
MooncakeStoreConnector on Mooncake Store's 0.3.13 wheel (the overlay built by
scripts/setup-vllm-peers.sh, seconds when cached), a ``mooncake_master`` and two vLLM
OpenAI servers on 127.0.0.1. A prompt served by A is saved into the store; B, which never
saw it, loads its prefix from there (vLLM's own external-hit counter) and answers as A.
About a minute here (two servers start in parallel). And vLLM's OffloadingConnector still
refuses this CPU platform with the reason the benchmark reports without starting it."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest

from benchmarks.vllm_peers import OFFLOADING_KV_TRANSFER, OFFLOADING_REFUSAL, mooncake_handoff
from conductor.front.vllm_procs import VLLM_BLOCK, start_vllm, wait_ready, write_tiny_llama

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow, pytest.mark.vllm_engine]

PROMPT_TOKENS = 1000


def test_a_prefix_saved_by_one_server_is_loaded_by_another(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "model", hidden=512, layers=4)
    prompt = [int(t) for t in np.random.default_rng(7).integers(3, 500, PROMPT_TOKENS)]
    got = mooncake_handoff(sys.executable, model, tmp_path, prompt, max_tokens=8)
    out_a, out_b = got["a"], got["b"]
    assert isinstance(out_a, list) and len(set(out_a)) > 1, (
        f"A's output {out_a} is constant: it cannot tell a right KV load from a wrong one")
    assert got["a_external_hits"] == 0
    # Every full block of the prompt but the last token's: vLLM recomputes that one.
    assert got["b_external_hits"] == (PROMPT_TOKENS - 1) // VLLM_BLOCK * VLLM_BLOCK
    assert out_b == out_a


def test_offloading_connector_refuses_the_cpu_platform(tmp_path: Path) -> None:
    model = write_tiny_llama(tmp_path / "model", hidden=512, layers=4)
    p = start_vllm(sys.executable, model, tmp_path, name="offloading", store=None,
                   kv_transfer=OFFLOADING_KV_TRANSFER)
    try:
        with pytest.raises(RuntimeError, match="exited"):
            wait_ready(p, "/v1/models", 600)
    finally:
        p.stop()
    assert OFFLOADING_REFUSAL in p.log.read_text(errors="replace")
