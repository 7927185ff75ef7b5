"""kvstore as SGLang's HiCache storage backend (``kvstore.integrations.sglang_hicache``)."""
