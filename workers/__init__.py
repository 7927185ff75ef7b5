"""Prefill and decode workers that use kvstore as their remote KV tier.

``workers.model`` is a small Llama-style decoder with a layer-wise KV-cache API;
``workers.kv_blocks`` maps its cache to store objects (the byte layout is
documented there); ``PrefillWorker`` and ``DecodeWorker`` run requests in process;
``workers.server`` serves them over HTTP/JSON (``python -m workers prefill|decode``)
and ``workers.client`` calls them.

Heavy modules (torch) load on first use, so ``workers.client`` stays light.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from workers.client import WorkerClient, WorkerError
    from workers.decode import DecodeResult, DecodeWorker
    from workers.model import KVCache, LlamaModel, ModelConfig
    from workers.prefill import PrefillResult, PrefillWorker

_LAZY = {
    "DecodeResult": "workers.decode",
    "DecodeWorker": "workers.decode",
    "KVCache": "workers.model",
    "LlamaModel": "workers.model",
    "ModelConfig": "workers.model",
    "PrefillResult": "workers.prefill",
    "PrefillWorker": "workers.prefill",
    "WorkerClient": "workers.client",
    "WorkerError": "workers.client",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'workers' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


__all__ = [
    "DecodeResult",
    "DecodeWorker",
    "KVCache",
    "LlamaModel",
    "ModelConfig",
    "PrefillResult",
    "PrefillWorker",
    "WorkerClient",
    "WorkerError",
]
