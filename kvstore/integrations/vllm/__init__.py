"""kvstore as vLLM's KV connector (``kvstore.integrations.vllm_connector`` is the path configs
name).
"""
