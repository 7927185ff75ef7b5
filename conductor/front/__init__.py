"""The OpenAI-compatible front in front of vLLM instances."""
