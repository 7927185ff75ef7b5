"""kvstore: a tiered KV-cache block store for LLM serving."""

from kvstore.client import Client
from kvstore.errors import InvalidArgument, KVStoreError, ResourceExhausted, Unavailable
from kvstore.keys import BlockKey, block_keys, namespace_root_key

__all__ = [
    "BlockKey",
    "Client",
    "InvalidArgument",
    "KVStoreError",
    "ResourceExhausted",
    "Unavailable",
    "block_keys",
    "namespace_root_key",
]
