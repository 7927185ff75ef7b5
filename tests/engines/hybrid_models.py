"""Small random hybrid models for the vLLM engine tests, written locally (no download)."""

from __future__ import annotations

from pathlib import Path

WINDOW = 64
"""The tiny Gemma 3's sliding window in tokens: two blocks of 32."""


def write_tiny_gemma3(out: Path, *, seed: int = 0) -> Path:
    """A random 4-layer Gemma 3 text model (``Gemma3ForCausalLM``, float32, head_dim 32)
    whose layers alternate sliding-window attention (``WINDOW`` tokens) and full
    attention, as a local HF checkpoint without a tokenizer. vLLM's hybrid allocator
    gives it two KV cache groups: full attention and sliding window."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(seed)
    cfg = Gemma3TextConfig(
        vocab_size=512, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=32,
        max_position_embeddings=2048, sliding_window=WINDOW,
        layer_types=["sliding_attention", "full_attention"] * 2,
        torch_dtype="float32", tie_word_embeddings=False)
    model = Gemma3ForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.3)
    model.save_pretrained(out, safe_serialization=True)
    return out
