"""The workers' Llama model against an independent reference forward, and checkpoint loading."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from workers.model import PRESETS, LlamaModel, ModelConfig, load_model

TINY = PRESETS["tiny"]
PROMPT = [(i * 37 + 11) % TINY.vocab_size for i in range(70)]


def reference_logits(m: LlamaModel, tokens: list[int]) -> torch.Tensor:
    """All-position logits, written straight from the Llama equations: no cache, explicit
    GQA head repetition, explicit causal softmax, RoPE angles per position."""
    c = m.config
    n, hd = len(tokens), c.head_dim
    x = m.embed[torch.tensor(tokens)].double()

    def norm(t: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        return w.double() * t / torch.sqrt((t * t).mean(-1, keepdim=True) + c.norm_eps)

    pos = torch.arange(n, dtype=torch.float64)[:, None]
    inv = torch.tensor([c.rope_theta ** (-2 * i / hd) for i in range(hd // 2)],
                       dtype=torch.float64)
    ang = pos * inv[None, :]  # (n, hd/2)
    cos, sin = torch.cos(ang)[:, None, :], torch.sin(ang)[:, None, :]

    def rope(t: torch.Tensor) -> torch.Tensor:  # (n, heads, hd), halves rotate as pairs
        a, b = t[..., : hd // 2], t[..., hd // 2 :]
        return torch.cat((a * cos - b * sin, b * cos + a * sin), dim=-1)

    causal = torch.tril(torch.ones(n, n, dtype=torch.bool))
    group = c.n_heads // c.n_kv_heads
    for w in m.layers:
        h = norm(x, w.attn_norm)
        q = rope((h @ w.wq.double().T).view(n, c.n_heads, hd))
        k = rope((h @ w.wk.double().T).view(n, c.n_kv_heads, hd))
        v = (h @ w.wv.double().T).view(n, c.n_kv_heads, hd)
        heads = []
        for head in range(c.n_heads):
            kv_head = head // group
            scores = q[:, head] @ k[:, kv_head].T / math.sqrt(hd)
            scores = scores.masked_fill(~causal, float("-inf"))
            heads.append(torch.softmax(scores, dim=-1) @ v[:, kv_head])
        x = x + torch.cat(heads, dim=-1) @ w.wo.double().T
        h = norm(x, w.mlp_norm)
        gate = h @ w.w_gate.double().T
        x = x + ((gate * torch.sigmoid(gate)) * (h @ w.w_up.double().T)) @ w.w_down.double().T
    return norm(x, m.norm) @ m.lm_head.double().T


def test_prefill_matches_reference_forward() -> None:
    m = LlamaModel.random(TINY, seed=3)
    logits, cache = m.prefill(PROMPT)
    ref = reference_logits(m, PROMPT)
    assert cache.length == len(PROMPT)
    assert (logits.double() - ref[-1]).abs().max().item() <= 1e-4


def test_decode_steps_match_reference_forward() -> None:
    m = LlamaModel.random(TINY, seed=3)
    out = m.generate(PROMPT, 6)
    seq = list(PROMPT)
    for _ in range(6):
        seq.append(int(reference_logits(m, seq)[-1].argmax()))
    assert out == seq[len(PROMPT):]


def test_chunked_prefill_with_past_equals_one_pass() -> None:
    m = LlamaModel.random(TINY, seed=1)
    full_logits, full = m.prefill(PROMPT)
    cache = m.new_cache(len(PROMPT))
    m.prefill(PROMPT[:32], cache)
    logits, cache = m.prefill(PROMPT[32:], cache)
    assert cache.length == len(PROMPT)
    assert (logits - full_logits).abs().max().item() <= 1e-4
    assert (cache.kv - full.kv).abs().max().item() <= 1e-4


def test_on_layer_done_sees_each_layer_in_order_before_the_next() -> None:
    m = LlamaModel.random(TINY, seed=1)
    seen: list[tuple[int, int]] = []
    cache = m.new_cache(len(PROMPT))
    cache.length = 0

    def cb(layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # Layer l is complete in the cache; layer l+1 has not started (still zero).
        assert k.shape == (len(PROMPT), TINY.n_kv_heads, TINY.head_dim)
        assert torch.equal(k, cache.kv[layer, : len(PROMPT), 0])
        assert cache.kv[layer].abs().sum() > 0
        if layer + 1 < TINY.n_layers:
            assert cache.kv[layer + 1].abs().sum() == 0
        seen.append((layer, v.shape[0]))

    m.prefill(PROMPT, cache, on_layer_done=cb)
    assert seen == [(i, len(PROMPT)) for i in range(TINY.n_layers)]


def test_batched_decode_equals_one_at_a_time() -> None:
    m = LlamaModel.random(TINY, seed=2)
    prompts = [PROMPT[:5], PROMPT[:40], PROMPT]
    caches = [m.prefill(p, m.new_cache(len(p) + 1))[1] for p in prompts]
    solo = [m.prefill(p, m.new_cache(len(p) + 1))[1] for p in prompts]
    batched = m.decode_batch([7, 8, 9], caches)
    for i, tok in enumerate([7, 8, 9]):
        one = m.decode_step(tok, solo[i])
        assert (batched[i] - one).abs().max().item() <= 1e-4
        assert caches[i].length == len(prompts[i]) + 1


def test_same_seed_same_weights_different_seed_different_name() -> None:
    a, b, c = (LlamaModel.random(TINY, seed=s) for s in (5, 5, 6))
    assert a.name == b.name != c.name
    assert torch.equal(a.layers[1].wq, b.layers[1].wq)
    assert a.generate(PROMPT, 4) == b.generate(PROMPT, 4)


def test_bad_tokens_and_lengths_are_rejected() -> None:
    m = LlamaModel.random(TINY, seed=0)
    with pytest.raises(ValueError, match="token ids"):
        m.prefill([1, TINY.vocab_size])
    with pytest.raises(ValueError, match="token ids"):
        m.prefill([1, -1])
    with pytest.raises(ValueError, match="at least one token"):
        m.prefill([])
    with pytest.raises(ValueError, match="max_seq_len"):
        m.prefill([1] * (TINY.max_seq_len + 1))
    with pytest.raises(ValueError, match="multiple of n_kv_heads"):
        TINY.replace(n_kv_heads=3)


def test_bfloat16_model_runs() -> None:
    m = LlamaModel.random(TINY.replace(dtype="bfloat16"), seed=0)
    logits, cache = m.prefill(PROMPT)
    assert cache.kv.dtype == torch.bfloat16 and logits.dtype == torch.float32
    assert torch.isfinite(logits).all()


def _write_hf_checkpoint(root: Path, m: LlamaModel, *, tie: bool) -> None:
    """A checkpoint in the Hugging Face Llama layout, written here with safetensors
    (independently of LlamaModel.save_pretrained), split over two files."""
    c = m.config
    root.mkdir()
    (root / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": c.vocab_size, "hidden_size": c.dim, "intermediate_size": c.ffn_dim,
        "num_hidden_layers": c.n_layers, "num_attention_heads": c.n_heads,
        "num_key_value_heads": c.n_kv_heads, "rms_norm_eps": c.norm_eps,
        "rope_theta": c.rope_theta, "max_position_embeddings": c.max_seq_len,
        "torch_dtype": "float32", "tie_word_embeddings": tie, "hidden_act": "silu",
    }))
    first = {"model.embed_tokens.weight": m.embed, "model.norm.weight": m.norm}
    if not tie:
        first["lm_head.weight"] = m.lm_head
    second = {}
    for i, w in enumerate(m.layers):
        p = f"model.layers.{i}."
        second |= {
            p + "input_layernorm.weight": w.attn_norm,
            p + "self_attn.q_proj.weight": w.wq, p + "self_attn.k_proj.weight": w.wk,
            p + "self_attn.v_proj.weight": w.wv, p + "self_attn.o_proj.weight": w.wo,
            p + "post_attention_layernorm.weight": w.mlp_norm,
            p + "mlp.gate_proj.weight": w.w_gate, p + "mlp.up_proj.weight": w.w_up,
            p + "mlp.down_proj.weight": w.w_down,
        }
    second["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old HF extra
    save_file({k: v.clone() for k, v in first.items()},
              str(root / "model-00001-of-00002.safetensors"))
    save_file({k: v.clone() for k, v in second.items()},
              str(root / "model-00002-of-00002.safetensors"))


@pytest.mark.parametrize("tie", [False, True])
def test_from_pretrained_loads_a_safetensors_checkpoint(tmp_path: Path, tie: bool) -> None:
    src = LlamaModel.random(TINY.replace(tie_embeddings=tie), seed=9)
    _write_hf_checkpoint(tmp_path / "ckpt", src, tie=tie)
    loaded = LlamaModel.from_pretrained(tmp_path / "ckpt")
    assert loaded.config == src.config
    assert loaded.name.startswith("llama-ckpt-")
    ref = reference_logits(src, PROMPT)[-1]
    logits, _ = loaded.prefill(PROMPT)
    assert (logits.double() - ref).abs().max().item() <= 1e-4
    assert loaded.generate(PROMPT, 5) == src.generate(PROMPT, 5)
    # load_model takes the directory too; save_pretrained round-trips.
    assert load_model(str(tmp_path / "ckpt")).name == loaded.name
    loaded.save_pretrained(tmp_path / "again")
    again = LlamaModel.from_pretrained(tmp_path / "again")
    assert torch.equal(again.layers[1].w_down, src.layers[1].w_down)


def test_from_pretrained_reports_what_is_wrong(tmp_path: Path) -> None:
    src = LlamaModel.random(TINY, seed=9)
    _write_hf_checkpoint(tmp_path / "ckpt", src, tie=False)
    (tmp_path / "ckpt" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(KeyError, match=r"model\.layers\.0\.input_layernorm\.weight"):
        LlamaModel.from_pretrained(tmp_path / "ckpt")
    cfg = json.loads((tmp_path / "ckpt" / "config.json").read_text())
    cfg["rope_scaling"] = {"rope_type": "llama3", "factor": 8.0}
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="rope_scaling"):
        LlamaModel.from_pretrained(tmp_path / "ckpt")
    with pytest.raises(FileNotFoundError, match=r"config\.json"):
        LlamaModel.from_pretrained(tmp_path)


def test_load_model_specs(tmp_path: Path) -> None:
    cfg = tmp_path / "m.json"
    cfg.write_text(json.dumps({"vocab_size": 64, "dim": 32, "n_layers": 1, "n_heads": 2,
                               "n_kv_heads": 1, "ffn_dim": 64}))
    m = load_model(str(cfg), seed=4)
    assert m.config == ModelConfig(vocab_size=64, dim=32, n_layers=1, n_heads=2, n_kv_heads=1,
                                   ffn_dim=64)
    assert load_model("tiny", dtype="float16").config.dtype == "float16"
    with pytest.raises(ValueError, match="not a preset"):
        load_model(str(tmp_path / "nope"))
