"""What a vLLM instance's connector tells a router about itself, over the OpenAI API.

A router (the Conductor) computes a prompt's block keys itself, so it must use the
connector's namespace and block size. Rather than an operator copying them into two
configurations, the router asks the instance: a request whose ``kv_transfer_params``
holds ``{"kvstore_describe": true}`` gets, in its answer's ``kv_transfer_params``::

    {"kvstore": {"version": 1, "namespace": "...", "block_tokens": 32, "kv_role": "kv_both",
                 "shards": ["tp0of2.pp0of1", "tp1of2.pp0of1"]}}

``namespace`` is the one the connector derives its keys with (the configured one, or
``default_namespace``), read where the keys are made, so it cannot disagree with them.
Asked through the instance's own API it needs no identity shared between the instance and
the store, and a decode instance (``kv_consumer``, which saves nothing) answers it too.
Requests without the parameter get nothing back (vLLM's answer is unchanged).

``shards`` names the parts each block is stored in when the engine runs on several ranks
(tensor / pipeline parallelism, ``kvstore.integrations.vllm.ranks``): a block is cached
only when every shard's key, ``kvstore.core.keys.shard_key(key, shard)``, is stored. An
empty list (a one-rank engine; absent in older connectors' answers) means each block is
stored under its own key.

No vLLM import here: the router side (``conductor.front``) reads the same names.
"""

from __future__ import annotations

from typing import Any

DESCRIBE_PARAM = "kvstore_describe"
"""The ``kv_transfer_params`` key that asks for the description (value ``true``)."""
REPLY_KEY = "kvstore"
"""The answer's ``kv_transfer_params`` key holding it."""
RETAIN_PARAM = "kvstore_retain_s"
"""The ``kv_transfer_params`` key of a request's retention in seconds: the connector saves
the request's blocks with that ``retain_s`` (``connector``, "Retention"); a router passes a
session's TTL with it (``conductor.front.session_cache``)."""
STORED_PARAM = "kvstore_stored_blocks"
"""The ``kv_transfer_params`` key of how many leading blocks of the prompt a router found
in the store (its own ``prefix_match`` over every shard): the connector takes it instead of
asking the store again (``connector``, "Scheduler side"), when the request's keys are the
router's (one KV cache group, no LoRA, cache salt or media)."""
VERSION = 1


def describe_reply(params: Any, *, namespace: str, block_tokens: int, kv_role: str,
                   shards: tuple[str, ...] = ()) -> dict[str, Any] | None:
    """The ``kv_transfer_params`` of an answer to a request whose own were ``params``:
    the description when it asked for one, else None (nothing added)."""
    if not isinstance(params, dict) or params.get(DESCRIBE_PARAM) is not True:
        return None
    return {REPLY_KEY: {"version": VERSION, "namespace": namespace,
                        "block_tokens": int(block_tokens), "kv_role": kv_role,
                        "shards": list(shards)}}
