"""A small Llama-style decoder (RMSNorm, RoPE, grouped-query attention, SwiGLU) built
around an external KV cache.

Why a home-made model: the workers need a forward pass that exposes the KV cache
layer by layer (so prefill can stream each finished layer to the store while the
next one computes) and that can start from KV fetched from the store. The maths
is exactly Hugging Face's ``LlamaForCausalLM`` (rotate-half RoPE, weights in
``(out_features, in_features)`` layout), so ``from_pretrained`` loads real Llama
checkpoints from a local safetensors directory.

Cache layout (the store's byte layout builds on it, see ``workers.kv_blocks``):
``KVCache.kv`` is one tensor of shape ``(n_layers, capacity, 2, n_kv_heads,
head_dim)``; ``kv[l, t, 0]`` is the post-RoPE key and ``kv[l, t, 1]`` the value
of token ``t`` at layer ``l``. Any run of tokens of one layer, ``kv[l, a:b]``, is
one contiguous piece of memory, so a block moves to and from the store without
staging copies.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
import xxhash

DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
}

LayerCallback = Callable[[int, torch.Tensor, torch.Tensor], None]
"""``on_layer_done(layer, k, v)``: ``k``/``v`` are views ``(n_new, n_kv_heads, head_dim)`` of
the cache rows just written; valid until the cache is next written."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ModelConfig:
    """Shape of a Llama-style model. ``head_dim`` 0 means ``dim // n_heads``."""

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    max_seq_len: int = 2048
    dtype: str = "float32"
    head_dim: int = 0
    tie_embeddings: bool = False

    def __post_init__(self) -> None:
        for name in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                     "max_seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value <= 0:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads})")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.head_dim == 0:
            if self.dim % self.n_heads:
                raise ValueError(f"dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
            object.__setattr__(self, "head_dim", self.dim // self.n_heads)
        if self.head_dim <= 0 or self.head_dim % 2:
            raise ValueError(f"head_dim must be positive and even, got {self.head_dim}")

    @property
    def torch_dtype(self) -> torch.dtype:
        return DTYPES[self.dtype]

    def replace(self, **changes: Any) -> ModelConfig:
        return ModelConfig(**{**asdict(self), **changes})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ModelConfig:
        known = {f.name for f in fields(cls)}
        unknown = set(data) - known
        if unknown:
            raise ValueError(f"unknown model config fields: {sorted(unknown)}")
        return cls(**data)

    @classmethod
    def from_hf(cls, hf: dict[str, Any]) -> ModelConfig:
        """From a Hugging Face Llama ``config.json``; rejects what this model does not do."""
        scaling = hf.get("rope_scaling")
        if scaling not in (None, {}):
            raise ValueError(f"rope_scaling {scaling!r} is not supported")
        if hf.get("attention_bias") or hf.get("mlp_bias"):
            raise ValueError("attention/MLP biases are not supported")
        if hf.get("hidden_act", "silu") != "silu":
            raise ValueError(f"hidden_act {hf['hidden_act']!r} is not supported (silu only)")
        n_heads = int(hf["num_attention_heads"])
        dtype = hf.get("torch_dtype") or hf.get("dtype") or "float32"
        return cls(
            vocab_size=int(hf["vocab_size"]),
            dim=int(hf["hidden_size"]),
            n_layers=int(hf["num_hidden_layers"]),
            n_heads=n_heads,
            n_kv_heads=int(hf.get("num_key_value_heads") or n_heads),
            ffn_dim=int(hf["intermediate_size"]),
            rope_theta=float(hf.get("rope_theta", 10000.0)),
            norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            max_seq_len=int(hf.get("max_position_embeddings", 2048)),
            dtype=str(dtype),
            head_dim=int(hf.get("head_dim") or 0),
            tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        )


PRESETS: dict[str, ModelConfig] = {
    # Unit and end-to-end tests: milliseconds per forward.
    "tiny": ModelConfig(vocab_size=512, dim=64, n_layers=2, n_heads=4, n_kv_heads=2,
                        ffn_dim=176, max_seq_len=1024),
    # Benchmarks: prefill of ~2k tokens takes about a second on two CPU cores.
    "small": ModelConfig(vocab_size=4096, dim=512, n_layers=8, n_heads=8, n_kv_heads=4,
                         ffn_dim=1408, max_seq_len=4096),
}


@dataclass(slots=True, kw_only=True)
class KVCache:
    """Keys and values of one sequence, for every layer.

    Invariant: rows ``[0, length)`` of every layer hold the post-RoPE keys and values
    of the sequence's first ``length`` tokens; rows past ``length`` are scratch.
    ``length <= capacity``.
    """

    kv: torch.Tensor  # (n_layers, capacity, 2, n_kv_heads, head_dim)
    length: int = 0

    @property
    def capacity(self) -> int:
        return self.kv.shape[1]

    @property
    def n_layers(self) -> int:
        return self.kv.shape[0]

    def rows(self, layer: int, start: int, stop: int) -> torch.Tensor:
        """``kv[layer, start:stop]``: one contiguous ``(stop - start, 2, heads, head_dim)`` run."""
        if not 0 <= start <= stop <= self.capacity:
            raise IndexError(f"rows [{start}, {stop}) outside a cache of {self.capacity}")
        return self.kv[layer, start:stop]

    def reserve(self, capacity: int) -> None:
        """Grows the cache to hold ``capacity`` tokens (one copy; callers size it up front)."""
        if capacity <= self.capacity:
            return
        grown = self.kv.new_zeros((self.kv.shape[0], capacity, *self.kv.shape[2:]))
        grown[:, : self.length] = self.kv[:, : self.length]
        self.kv = grown


@dataclass(slots=True, kw_only=True)
class LayerWeights:
    """One decoder layer, Hugging Face layout: linear weights are ``(out, in)``."""

    attn_norm: torch.Tensor
    wq: torch.Tensor
    wk: torch.Tensor
    wv: torch.Tensor
    wo: torch.Tensor
    mlp_norm: torch.Tensor
    w_gate: torch.Tensor
    w_up: torch.Tensor
    w_down: torch.Tensor


# Hugging Face tensor names of one layer, by LayerWeights field.
_HF_LAYER_NAMES = {
    "attn_norm": "input_layernorm.weight",
    "wq": "self_attn.q_proj.weight",
    "wk": "self_attn.k_proj.weight",
    "wv": "self_attn.v_proj.weight",
    "wo": "self_attn.o_proj.weight",
    "mlp_norm": "post_attention_layernorm.weight",
    "w_gate": "mlp.gate_proj.weight",
    "w_up": "mlp.up_proj.weight",
    "w_down": "mlp.down_proj.weight",
}


def _layer_shapes(c: ModelConfig) -> dict[str, tuple[int, ...]]:
    hd = c.head_dim
    return {
        "attn_norm": (c.dim,), "wq": (c.n_heads * hd, c.dim), "wk": (c.n_kv_heads * hd, c.dim),
        "wv": (c.n_kv_heads * hd, c.dim), "wo": (c.dim, c.n_heads * hd), "mlp_norm": (c.dim,),
        "w_gate": (c.ffn_dim, c.dim), "w_up": (c.ffn_dim, c.dim), "w_down": (c.dim, c.ffn_dim),
    }


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


@dataclass(slots=True, kw_only=True)
class LlamaModel:
    """Weights plus the forward passes. Not an ``nn.Module``: inference only, no autograd.

    ``name`` identifies the weights (seed or content hash) and goes into the store
    namespace, so two different models never share cached KV.
    """

    config: ModelConfig
    embed: torch.Tensor  # (vocab, dim)
    layers: list[LayerWeights]
    norm: torch.Tensor  # (dim,)
    lm_head: torch.Tensor  # (vocab, dim); the embedding itself when tied
    name: str
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    _cos: torch.Tensor = field(init=False, repr=False)
    _sin: torch.Tensor = field(init=False, repr=False)

    def __post_init__(self) -> None:
        c = self.config
        inv_freq = 1.0 / (c.rope_theta ** (torch.arange(0, c.head_dim, 2, dtype=torch.float64)
                                           / c.head_dim))
        freqs = torch.outer(torch.arange(c.max_seq_len, dtype=torch.float64), inv_freq)
        emb = torch.cat((freqs, freqs), dim=-1)
        self._cos = emb.cos().to(device=self.device, dtype=c.torch_dtype)
        self._sin = emb.sin().to(device=self.device, dtype=c.torch_dtype)

    # ---- construction --------------------------------------------------------------------

    @classmethod
    def random(cls, config: ModelConfig, seed: int = 0, *, device: str | torch.device = "cpu"
               ) -> LlamaModel:
        """Seeded random weights: the same ``(config, seed)`` gives bit-identical weights in
        every process (drawn on the CPU generator, then moved), which is what lets a
        prefill and a decode process share KV through the store.

        Linear weights are N(0, 1/fan_in) and norms 1 + N(0, 0.1^2), so activations keep
        their scale through the layers and logits are well separated (greedy decoding is
        not decided by rounding noise).
        """
        g = torch.Generator().manual_seed(seed)
        dt = config.torch_dtype

        def draw(shape: tuple[int, ...]) -> torch.Tensor:
            if len(shape) == 1:
                t = 1.0 + 0.1 * torch.randn(shape, generator=g)
            else:
                t = torch.randn(shape, generator=g) / math.sqrt(shape[1])
            return t.to(device=device, dtype=dt)

        embed = torch.randn((config.vocab_size, config.dim), generator=g).to(device=device,
                                                                             dtype=dt)
        shapes = _layer_shapes(config)
        layers = [LayerWeights(**{k: draw(s) for k, s in shapes.items()})
                  for _ in range(config.n_layers)]
        norm = draw((config.dim,))
        lm_head = embed if config.tie_embeddings else draw((config.vocab_size, config.dim))
        digest = xxhash.xxh3_64_hexdigest(json.dumps(config.to_dict(), sort_keys=True).encode())
        return cls(config=config, embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                   name=f"llama-random-s{seed}-{digest}", device=torch.device(device))

    @classmethod
    def from_pretrained(cls, path: str | Path, *, device: str | torch.device = "cpu",
                        dtype: str | None = None) -> LlamaModel:
        """Loads a Hugging Face Llama checkpoint from a local directory (``config.json`` and
        ``*.safetensors``; no network). ``dtype`` overrides the checkpoint's.

        The model name carries a hash of every tensor's bytes, so a changed checkpoint
        gets a new store namespace.
        """
        from safetensors import safe_open

        root = Path(path)
        config_path = root / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"{config_path}: no config.json")
        config = ModelConfig.from_hf(json.loads(config_path.read_text()))
        if dtype is not None:
            config = config.replace(dtype=dtype)
        files = sorted(root.glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"{root}: no *.safetensors files")
        tensors: dict[str, torch.Tensor] = {}
        for f in files:
            with safe_open(str(f), framework="pt", device="cpu") as st:
                for name in st.keys():  # noqa: SIM118 (safe_open is not a mapping)
                    tensors[name] = st.get_tensor(name)
        hasher = xxhash.xxh3_64()
        hasher.update(json.dumps(config.to_dict(), sort_keys=True).encode())

        def take(name: str, shape: tuple[int, ...]) -> torch.Tensor:
            t = tensors.get(name)
            if t is None:
                raise KeyError(f"{root}: checkpoint has no tensor {name!r}")
            if tuple(t.shape) != shape:
                raise ValueError(f"{root}: {name} has shape {tuple(t.shape)}, expected {shape}")
            hasher.update(name.encode())
            # .data, the array's buffer: numpy's stub declares the buffer protocol for
            # Python 3.12+ only.
            hasher.update(t.contiguous().view(torch.uint8).numpy().data)
            return t.to(device=device, dtype=config.torch_dtype).contiguous()

        c = config
        embed = take("model.embed_tokens.weight", (c.vocab_size, c.dim))
        shapes = _layer_shapes(c)
        layers = [
            LayerWeights(**{k: take(f"model.layers.{i}.{_HF_LAYER_NAMES[k]}", s)
                            for k, s in shapes.items()})
            for i in range(c.n_layers)
        ]
        norm = take("model.norm.weight", (c.dim,))
        if "lm_head.weight" in tensors:
            lm_head = take("lm_head.weight", (c.vocab_size, c.dim))
        elif c.tie_embeddings:
            lm_head = embed
        else:
            raise KeyError(f"{root}: checkpoint has no lm_head.weight and does not tie embeddings")
        return cls(config=config, embed=embed, layers=layers, norm=norm, lm_head=lm_head,
                   name=f"llama-{root.name}-{hasher.hexdigest()}", device=torch.device(device))

    def save_pretrained(self, path: str | Path) -> None:
        """Writes ``config.json`` + ``model.safetensors`` in the Hugging Face layout."""
        from safetensors.torch import save_file

        c = self.config
        root = Path(path)
        root.mkdir(parents=True, exist_ok=True)
        hf = {
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "vocab_size": c.vocab_size, "hidden_size": c.dim, "num_hidden_layers": c.n_layers,
            "num_attention_heads": c.n_heads, "num_key_value_heads": c.n_kv_heads,
            "intermediate_size": c.ffn_dim, "rope_theta": c.rope_theta,
            "rms_norm_eps": c.norm_eps, "max_position_embeddings": c.max_seq_len,
            "torch_dtype": c.dtype, "head_dim": c.head_dim, "hidden_act": "silu",
            "tie_word_embeddings": c.tie_embeddings, "rope_scaling": None,
        }
        (root / "config.json").write_text(json.dumps(hf, indent=2))
        tensors = {"model.embed_tokens.weight": self.embed, "model.norm.weight": self.norm}
        for i, layer in enumerate(self.layers):
            for k, hf_name in _HF_LAYER_NAMES.items():
                tensors[f"model.layers.{i}.{hf_name}"] = getattr(layer, k)
        if not c.tie_embeddings:
            tensors["lm_head.weight"] = self.lm_head
        save_file({k: v.detach().cpu().contiguous() for k, v in tensors.items()},
                  str(root / "model.safetensors"))

    # ---- cache ---------------------------------------------------------------------------

    def new_cache(self, capacity: int) -> KVCache:
        """An empty cache for up to ``capacity`` tokens (rows zeroed)."""
        c = self.config
        if not 0 < capacity <= c.max_seq_len:
            raise ValueError(f"cache capacity must be in [1, {c.max_seq_len}], got {capacity}")
        kv = torch.zeros((c.n_layers, capacity, 2, c.n_kv_heads, c.head_dim),
                         dtype=c.torch_dtype, device=self.device)
        return KVCache(kv=kv)

    def check_tokens(self, tokens: Sequence[int]) -> None:
        """ValueError unless every id is an int in ``[0, vocab_size)``."""
        v = self.config.vocab_size
        for t in tokens:
            if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < v:
                raise ValueError(f"token ids must be integers in [0, {v}), got {t!r}")

    # ---- forward -------------------------------------------------------------------------

    def _norm(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        # Hugging Face order: normalise in float32, cast back, then scale.
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.config.norm_eps)
        return weight * xf.to(x.dtype)

    def _rope(self, x: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """``x``: ``(n, heads, head_dim)``, ``positions``: ``(n,)``."""
        cos = self._cos[positions].unsqueeze(1)
        sin = self._sin[positions].unsqueeze(1)
        return x * cos + _rotate_half(x) * sin

    def _mlp(self, x: torch.Tensor, w: LayerWeights) -> torch.Tensor:
        h = self._norm(x, w.mlp_norm)
        return F.linear(F.silu(F.linear(h, w.w_gate)) * F.linear(h, w.w_up), w.w_down)

    def _qkv(self, x: torch.Tensor, w: LayerWeights, positions: torch.Tensor
             ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        c = self.config
        n = x.shape[0]
        h = self._norm(x, w.attn_norm)
        q = F.linear(h, w.wq).view(n, c.n_heads, c.head_dim)
        k = F.linear(h, w.wk).view(n, c.n_kv_heads, c.head_dim)
        v = F.linear(h, w.wv).view(n, c.n_kv_heads, c.head_dim)
        return self._rope(q, positions), self._rope(k, positions), v

    def _attend(self, q: torch.Tensor, cache: KVCache, layer: int, stop: int, *, causal_from: int
                ) -> torch.Tensor:
        """Attention of queries ``q`` (``(n, heads, head_dim)`` at positions
        ``causal_from .. causal_from + n - 1``) over cache rows ``[0, stop)``."""
        n = q.shape[0]
        rows = cache.kv[layer, :stop]
        # 4-D (batch 1) inputs: torch's CPU flash kernel takes those (3-D ones fall back
        # to the much slower math path). K and V stay strided views of the cache.
        k = rows[:, 0].transpose(0, 1)[None]  # (1, kv_heads, stop, head_dim)
        v = rows[:, 1].transpose(0, 1)[None]
        qh = q.transpose(0, 1)[None]
        if n == 1:
            out = F.scaled_dot_product_attention(qh, k, v, enable_gqa=True)
        elif causal_from == 0:
            out = F.scaled_dot_product_attention(qh, k, v, is_causal=True, enable_gqa=True)
        else:
            mask = torch.ones((n, stop), dtype=torch.bool, device=q.device).tril(causal_from)
            out = F.scaled_dot_product_attention(qh, k, v, attn_mask=mask, enable_gqa=True)
        out = out[0]
        return out.transpose(0, 1).reshape(n, -1)

    def _logits(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(self._norm(x, self.norm), self.lm_head).float()

    @torch.inference_mode()
    def prefill(self, tokens: Sequence[int], past: KVCache | None = None, *,
                on_layer_done: LayerCallback | None = None) -> tuple[torch.Tensor, KVCache]:
        """Runs ``tokens`` (the tokens after ``past.length``) through the model, layer by
        layer, appending their keys and values to ``past`` (a new cache if None).

        Returns the float32 logits of the last token and the cache. ``on_layer_done`` is
        called in this thread as soon as layer ``l``'s rows are in the cache, before
        layer ``l + 1`` starts: a consumer may read ``cache.rows(l, ...)`` from another
        thread from then on, while later layers compute.
        """
        n = len(tokens)
        if n == 0:
            raise ValueError("prefill needs at least one token")
        self.check_tokens(tokens)
        start = 0 if past is None else past.length
        stop = start + n
        if stop > self.config.max_seq_len:
            raise ValueError(f"{stop} tokens exceed max_seq_len {self.config.max_seq_len}")
        cache = past if past is not None else self.new_cache(n)
        cache.reserve(stop)
        positions = torch.arange(start, stop, device=self.device)
        x = self.embed[torch.tensor(list(tokens), device=self.device)]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, positions)
            rows = cache.kv[i, start:stop]
            rows[:, 0] = k
            rows[:, 1] = v
            x = x + F.linear(self._attend(q, cache, i, stop, causal_from=start), w.wo)
            x = x + self._mlp(x, w)
            if on_layer_done is not None:
                on_layer_done(i, rows[:, 0], rows[:, 1])
        cache.length = stop
        return self._logits(x[-1:])[0], cache

    @torch.inference_mode()
    def decode_batch(self, tokens: Sequence[int], caches: Sequence[KVCache]) -> torch.Tensor:
        """One decode step for several sequences: token ``tokens[i]`` is appended to
        ``caches[i]`` (at its own position). Projections and the MLP run batched;
        attention runs per sequence, since lengths differ. Returns ``(batch, vocab)``
        float32 logits."""
        if len(tokens) != len(caches) or not tokens:
            raise ValueError(f"{len(tokens)} tokens for {len(caches)} caches")
        self.check_tokens(tokens)
        for cache in caches:
            if cache.length + 1 > self.config.max_seq_len:
                raise ValueError(f"sequence exceeds max_seq_len {self.config.max_seq_len}")
            cache.reserve(cache.length + 1)
        positions = torch.tensor([c.length for c in caches], device=self.device)
        x = self.embed[torch.tensor(list(tokens), device=self.device)]
        for i, w in enumerate(self.layers):
            q, k, v = self._qkv(x, w, positions)
            outs = []
            for b, cache in enumerate(caches):
                pos = cache.length
                cache.kv[i, pos, 0] = k[b]
                cache.kv[i, pos, 1] = v[b]
                outs.append(self._attend(q[b : b + 1], cache, i, pos + 1, causal_from=pos))
            x = x + F.linear(torch.cat(outs), w.wo)
            x = x + self._mlp(x, w)
        for cache in caches:
            cache.length += 1
        return self._logits(x)

    def decode_step(self, token: int, cache: KVCache) -> torch.Tensor:
        """Appends ``token`` to ``cache``; float32 logits of the next token."""
        return self.decode_batch([token], [cache])[0]

    def generate(self, tokens: Sequence[int], max_new_tokens: int, *,
                 stop_token_ids: Sequence[int] = ()) -> list[int]:
        """Greedy generation without any store: the reference the workers must match.
        Returns up to ``max_new_tokens`` tokens (ending early after a stop token)."""
        if max_new_tokens <= 0:
            return []
        cache = self.new_cache(len(tokens) + max_new_tokens)
        logits, cache = self.prefill(tokens, cache)
        out = [int(logits.argmax())]
        while len(out) < max_new_tokens and out[-1] not in stop_token_ids:
            out.append(int(self.decode_step(out[-1], cache).argmax()))
        return out


def load_model(spec: str, *, seed: int = 0, device: str = "cpu", dtype: str | None = None
               ) -> LlamaModel:
    """``spec``: a preset name (``tiny``, ``small``), a directory holding a Hugging Face
    checkpoint, or a JSON file of ``ModelConfig`` fields (random weights from ``seed``)."""
    if spec in PRESETS:
        config = PRESETS[spec]
        return LlamaModel.random(config.replace(dtype=dtype) if dtype else config, seed,
                                 device=device)
    path = Path(spec)
    if path.is_dir():
        return LlamaModel.from_pretrained(path, device=device, dtype=dtype)
    if path.is_file():
        config = ModelConfig.from_dict(json.loads(path.read_text()))
        return LlamaModel.random(config.replace(dtype=dtype) if dtype else config, seed,
                                 device=device)
    raise ValueError(f"model config {spec!r}: not a preset ({', '.join(PRESETS)}), "
                     f"a checkpoint directory or a JSON file")
