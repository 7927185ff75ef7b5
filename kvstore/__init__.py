"""kvstore: a tiered KV-cache block store for LLM serving.

``Client`` and the errors load on first use, so the ``tiers`` package can use
``kvstore.core.keys`` without importing the network stack (and without a cycle).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvstore.core.keys import BlockKey, block_keys, namespace_root_key

if TYPE_CHECKING:
    from kvstore.client import Client
    from kvstore.core.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable
    from kvstore.core.prefetch import PrefetchOutcome
    from kvstore.core.retention import RetainOutcome

_LAZY = {
    "Client": "kvstore.client",
    "InvalidArgument": "kvstore.core.errors",
    "KVStoreError": "kvstore.core.errors",
    "PrefetchOutcome": "kvstore.core.prefetch",
    "ResourceExhausted": "kvstore.core.errors",
    "RetainOutcome": "kvstore.core.retention",
    "Unavailable": "kvstore.core.errors",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'kvstore' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


__all__ = [
    "BlockKey",
    "Client",
    "InvalidArgument",
    "KVStoreError",
    "PrefetchOutcome",
    "ResourceExhausted",
    "RetainOutcome",
    "Unavailable",
    "block_keys",
    "namespace_root_key",
]
