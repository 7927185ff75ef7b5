"""vLLM's offline engine on the tiny model with kvstore as its connector, for the engine
tests that share one shape: one ``LLM`` per module, shut down whole at the end."""

from __future__ import annotations

import gc
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

BLOCK = 32


@contextmanager
def kvstore_llm(model: Path, addr: str, namespace: str | None, *,
                connector: dict[str, Any] | None = None, **engine: Any) -> Iterator[Any]:
    """An ``LLM`` (greedy-ready, float32, eager, 64 MiB of KV cache) whose connector is
    kvstore's at ``addr`` under ``namespace`` (None: the connector's default namespace);
    a failed load is recomputed. ``connector``: more ``kv_connector_extra_config`` keys.
    ``engine``: more ``LLM`` arguments, or others than these
    (``tensor_parallel_size=2``, ``dtype="bfloat16"``, ``block_size=None``...)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    ktc = KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm_connector",
        kv_role="kv_both", kv_load_failure_policy="recompute",
        kv_connector_extra_config={"kvstore_addr": addr,
                                   **({"namespace": namespace} if namespace else {}),
                                   **(connector or {})})
    args: dict[str, Any] = {"block_size": BLOCK, "max_model_len": 512, "dtype": "float32",
                            "kv_cache_memory_bytes": 64 << 20, **engine}
    llm = LLM(model=str(model), skip_tokenizer_init=True, enforce_eager=True, seed=0,
              disable_log_stats=False, kv_transfer_config=ktc, **args)
    try:
        yield llm
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()


def external_hits(llm: Any) -> int:
    """Tokens vLLM has counted as loaded from the connector so far."""
    return int(sum(m.value for m in llm.get_metrics()
                   if m.name == "vllm:external_prefix_cache_hits"))


def generate(llm: Any, tokens: list[int]) -> tuple[list[int], int]:
    """Greedy output token ids (12) and vLLM's external-hit count for this call."""
    from vllm import SamplingParams

    before = external_hits(llm)
    params = SamplingParams(max_tokens=12, temperature=0.0, detokenize=False)
    out = llm.generate([{"prompt_token_ids": tokens}], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids), external_hits(llm) - before


def wait_until(predicate: Any, timeout: float, what: str) -> None:
    """Polls ``predicate`` until true; AssertionError naming ``what`` after ``timeout``."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.05)
