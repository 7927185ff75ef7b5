"""Adapters that let serving engines use kvstore (optional; each imports only what it needs).

* ``mooncake_compat``: Mooncake Store 0.3.13's Python API over kvstore (with
  ``mooncake_types``, ``mooncake_setup``, ``mooncake_ranges``, ``mooncake_upsert``,
  ``mooncake_cuda`` and ``mooncake_unsupported``).
* ``sglang_hicache``: kvstore as SGLang's HiCache L3 storage.
* ``vllm_connector``: ``KVStoreConnector``, a vLLM ``KVConnectorBase_V1`` loaded out of tree
  with ``kv_connector_module_path`` (imports vLLM; the versions it runs under are listed in
  ``vllm.versions``).
* ``vllm_blocks``: the byte layout of one stored vLLM block (torch, numpy, xxhash; no vLLM).
* ``identity``: the weights' fingerprint and the identity strings every engine's stored
  keys carry, so no engine loads KV computed by other weights (no engine import).
"""
