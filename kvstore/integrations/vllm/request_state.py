"""What the connector's scheduler side keeps per request, and reads from it.

A request's block keys (``RequestState.keys_upto``) are hashed once per block, chained
from the previous key as the request's blocks fill (``kvstore.core.keys``, the prefix-hash
spec: equal to ``block_keys`` over the same tokens). Its ``kv_transfer_params`` may carry
a retention (``kvstore_retain_s``) and a router's lookup (``kvstore_stored_blocks``);
LoRA, cache salt and media go into every key (``request_extra``).

No vLLM import (the request is read by attribute), so a router-side tool could use it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from kvstore.core.keys import chained_block_key, encode_token_ids
from kvstore.core.retention import check_retain_s
from kvstore.integrations.vllm.describe import RETAIN_PARAM, STORED_PARAM

__all__ = ["RequestState", "request_extra", "request_retain_s", "request_stored_blocks"]

logger = logging.getLogger("vllm.kvstore_connector")  # vLLM's init_logger's logger


@dataclass(slots=True)
class RequestState:
    request: Any
    """vLLM's ``Request``."""
    extra: bytes
    keys: list[list[bytes]] = field(default_factory=list)
    """Per group of the plan, the keys of the request's leading blocks."""
    store_blocks: int = 0
    """Leading blocks the store held at the last lookup (or that were saved since)."""
    saved_upto: int = 0
    """Leading blocks that are in the store or already handed to the worker to save."""
    lookup_local_tokens: int = 0
    """``num_computed_tokens`` vLLM passed to the last lookup (its local hit)."""
    loading: list[int] = field(default_factory=list)
    """Destination block ids of the load in flight, in block order."""
    load_first_block: int = 0
    load_inline: bool = False
    """Its load (if any) runs in the step, not on the loader thread (``load_mode``)."""
    retain_s: float = 0.0
    """The request's ``kvstore_retain_s`` (its saves carry it)."""
    retain_from_start: bool = False
    """Its first lookup is still to retain the prefix the store holds."""
    present: list[list[bool]] | None = None
    """Per group, the blocks the store held at the request's lookup (None: not asked)."""
    looked_up_tokens: int = -1
    """``request.num_tokens`` at that lookup: vLLM asks again on every scheduler pass the
    request waits through (the answer is reused) and after a preemption (then its tokens
    grew by its output, and the store is asked again)."""
    load_failed: bool = False
    """A load from a lookup's answer failed: lookups from then on ask the store (not the
    kept answer, not the router's count)."""

    def forget_lookup(self) -> None:
        """A load from the last answer failed: the next lookup asks the store."""
        self.present = None
        self.load_failed = True

    def keys_upto(self, num_blocks: int, group: int, *, roots: Sequence[bytes],
                  block_size: int) -> list[bytes]:
        """The keys of the first ``num_blocks`` blocks in ``group`` (a position of the
        plan); ``roots[q]``: group ``q``'s chain root (``namespace_root_key`` of its
        namespace). Blocks not hashed yet are, in every group, from the last key on."""
        if not self.keys:
            self.keys = [[] for _ in roots]
        have = len(self.keys[group])
        if have < num_blocks:
            encoded = encode_token_ids(
                list(self.request.all_token_ids[have * block_size : num_blocks * block_size]))
            stride = 4 * block_size
            for chain, root in zip(self.keys, roots, strict=True):
                parent = chain[-1] if chain else root
                for start in range(0, len(encoded) - stride + 1, stride):
                    parent = bytes(chained_block_key(parent, encoded[start : start + stride],
                                                     self.extra))
                    chain.append(parent)
        return self.keys[group][:num_blocks]


def request_stored_blocks(request: Any) -> int | None:
    """``kv_transfer_params["kvstore_stored_blocks"]``: how many leading blocks a router
    (the Conductor) found stored when it looked the prompt up; None when absent or not a
    non-negative integer (then the connector asks the store itself)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get(STORED_PARAM) if isinstance(params, dict) else None
    if raw is None:
        return None
    if isinstance(raw, bool) or not isinstance(raw, int) or raw < 0:
        logger.warning("request %s: ignoring %s=%r (not a block count)", request.request_id,
                       STORED_PARAM, raw)
        return None
    return raw


def request_retain_s(request: Any) -> float:
    """``kv_transfer_params["kvstore_retain_s"]`` checked (0.0: none or refused)."""
    params = getattr(request, "kv_transfer_params", None) or {}
    raw = params.get(RETAIN_PARAM) if isinstance(params, dict) else None
    if raw is None:
        return 0.0
    try:
        return check_retain_s(raw)
    except ValueError as exc:
        logger.warning("request %s: ignoring %s: %s", request.request_id, RETAIN_PARAM, exc)
        return 0.0


def request_extra(request: Any) -> bytes:
    """Bytes mixed into every key of ``request``'s blocks (see ``kvstore.core.keys``)."""
    parts = []
    lora = request.lora_request
    if lora is not None:  # its name and where it was loaded from
        parts.append(f"lora={lora.lora_name}")
        parts.append(f"lora_path={getattr(lora, 'lora_path', '') or ''}")
    if request.cache_salt:
        parts.append(f"salt={request.cache_salt}")
    for feature in request.mm_features or ():
        parts.append(f"mm={getattr(feature, 'identifier', '')}")
    return "\x00".join(parts).encode()
