"""What names an engine's KV bytes: its identity (weights, dtypes, quantization, KV
scales, overrides, parallel shape), the default namespace built from it with the cache
layout, and the 64-bit identity every value header carries.

Split out of ``connector``, which imports the three functions (so
``connector.engine_identity`` and the others still name them).
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING

import xxhash

from kvstore.integrations.identity import WeightsIdentity, process_value, weights_identity
from kvstore.integrations.vllm.groups import plan_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig

NAMESPACE_VERSION = "vllm-v1"


def engine_identity(vllm_config: VllmConfig, *,
                    weights: WeightsIdentity | None = None) -> dict[str, str]:
    """What decides this engine's KV bytes beyond the cache layout, by name: the weights
    (``kvstore.integrations.identity``: the checkpoint's fingerprint, or ``weights_id``),
    the model and KV-cache dtypes, quantization, how KV scales are found, config
    overrides and the parallel shape. Equal for two engines that would compute the same
    bytes for the same tokens (LoRA, cache salt and media are in each request's keys)."""
    model, cache, parallel = (vllm_config.model_config, vllm_config.cache_config,
                              vllm_config.parallel_config)
    if weights is None:
        weights = weights_identity(model.model, revision=model.revision,
                                   cache_dirs=[vllm_config.load_config.download_dir or ""])
    overrides = model.hf_overrides
    if callable(overrides):  # a function's effect cannot be named: this process only
        overrides = f"callable:{process_value()}"
    scales = ("calculated:" + process_value()  # from the first batch: this engine's own
              if getattr(cache, "calculate_kv_scales", False) else "checkpoint")
    return {
        "weights": str(weights),
        "dtype": str(model.dtype).removeprefix("torch."),
        "quant": str(model.quantization or "none"),
        "kv_cache_dtype": str(cache.cache_dtype),
        "kv_skip": ",".join(sorted(getattr(cache, "kv_cache_dtype_skip_layers", None) or [])),
        "kv_scales": scales,
        "hf_overrides": json.dumps(overrides, sort_keys=True, default=str),
        "tp": str(parallel.tensor_parallel_size),
        "pp": str(parallel.pipeline_parallel_size),
    }


def default_namespace(vllm_config: VllmConfig, kv_cache_config: KVCacheConfig, *,
                      weights: WeightsIdentity | None = None) -> str:
    """Model, weights, dtypes, quantization, shape, block size, layout and platform:
    engines that could not read each other's blocks never share a key."""
    from vllm.platforms import current_platform

    group = kv_cache_config.kv_cache_groups[0]
    spec = group.kv_cache_spec
    model = vllm_config.model_config
    parts = [
        NAMESPACE_VERSION,
        f"model={model.model}",
        f"revision={model.revision or ''}",
        f"kv_dtype={spec.dtype}",
        f"layers={len(group.layer_names)}",
        f"kv_heads={getattr(spec, 'num_kv_heads', '?')}",
        f"head_size={getattr(spec, 'head_size', '?')}",
        f"block={spec.block_size}",
        f"layout={kv_cache_config.kv_cache_layout or ''}",
        f"device={current_platform.device_type}",
    ]
    if groups := plan_from_config(kv_cache_config).namespace_part():  # hybrid models only
        parts.append(groups)
    parts += [f"{k}={v}" for k, v in engine_identity(vllm_config, weights=weights).items()]
    return "/".join(parts)


def header_identity(identity: dict[str, str], *, shard: str) -> int:
    """The 64-bit identity a worker writes in every value header and requires on load
    (``kvstore.integrations.vllm.blocks``); never 0, the mark of values written before."""
    text = "\x00".join(f"{k}={identity[k]}" for k in sorted(identity)) + f"\x00shard={shard}"
    return xxhash.xxh3_64_intdigest(text.encode()) or 1
