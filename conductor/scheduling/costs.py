"""Cost models: how long prefill, KV transfer and a decode step take.

The Conductor only ever asks a ``CostModel``; the simulator uses the same model
to advance its clock, so a simulated run is exactly what the Conductor predicts
when nothing else perturbs it. Live, the model is built from measured worker
speed (``PolyCostModel.calibrated`` or ``PolyCostModel.fit``).

``PolyCostModel`` is the one implementation: low-order polynomials that follow
the physics of a transformer, which is enough for scheduling decisions:

* prefill of ``new`` tokens after ``cached`` reused ones costs
  ``p_fixed + p_token*new + p_pair*new*(cached + new/2)`` seconds: the linear
  term is the dense layers (2 FLOPs per parameter per token), the pair term is
  causal attention (every new token attends to the cached prefix and to the new
  tokens before it), hence "quadratic-ish" in the prompt length;
* a transfer of ``n`` bytes costs ``t_fixed + n / net_bytes_per_s`` (0 for 0 bytes);
* a decode step of a batch of ``b`` sequences holding ``ctx`` context tokens
  costs ``d_fixed + d_seq*b + d_ctx*ctx`` (0 for an empty batch): decode is
  memory-bound, so it is reading the weights once per step plus every
  sequence's KV cache, plus a small per-sequence compute term.

``PolyCostModel.a800_llama2_70b()`` derives the coefficients from published
hardware and model numbers (see its docstring for each figure and its source).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from conductor.scheduling.types import BLOCK_TOKENS


@runtime_checkable
class CostModel(Protocol):
    """What the Conductor and the simulator need to know about execution speed."""

    @property
    def kv_bytes_per_token(self) -> int:
        """KV-cache bytes one token occupies (all layers, K and V)."""
        ...

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        """Seconds to prefill ``new_tokens`` after ``cached_tokens`` reused ones."""
        ...

    def transfer_s(self, nbytes: int) -> float:
        """Seconds to move ``nbytes`` of KV cache between instances (0 for 0 bytes)."""
        ...

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        """Seconds for one continuous-batching step: one token for each of ``batch_size``
        sequences holding ``context_tokens`` tokens of KV cache in total."""
        ...


# ---- LLaMA2-70B on one 8 x A800-SXM4-80GB node (the paper's testbed) -----------------------

LLAMA2_70B_PARAMS = 69_000_000_000
"""Parameters of LLaMA2-70B without the embedding tables (~69B of 70B are in the layers)."""
LLAMA2_70B_LAYERS = 80
LLAMA2_70B_ATTN_WIDTH = 8192
"""Query heads x head dim = 64 x 128."""
LLAMA2_70B_KV_BYTES_PER_TOKEN = 2 * 80 * 8 * 128 * 2
"""K and V x 80 layers x 8 KV heads (GQA) x 128 dims x 2 bytes (BF16) = 327,680 bytes."""
LLAMA2_70B_WEIGHT_BYTES = 2 * LLAMA2_70B_PARAMS
A800_BF16_FLOPS = 312e12
"""Dense BF16 tensor-core peak per A800 (same SM as A100)."""
A800_HBM_BYTES_PER_S = 2.039e12
"""HBM2e bandwidth of one A800-SXM4-80GB."""
A800_HBM_BYTES = 80 * 2**30
GPUS_PER_INSTANCE = 8
RDMA_BYTES_PER_S = 87e9
"""Mooncake Transfer Engine's measured bandwidth on 4 x 200 Gbps RoCE (FAST'25, section 4)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class PolyCostModel:
    """The polynomial cost model of the module docstring. All coefficients in seconds."""

    kv_bytes_per_token: int
    p_fixed: float = 0.0
    p_token: float
    p_pair: float = 0.0
    t_fixed: float = 0.0
    net_bytes_per_s: float
    d_fixed: float
    d_seq: float = 0.0
    d_ctx: float = 0.0

    def __post_init__(self) -> None:
        for name in ("p_fixed", "p_token", "p_pair", "t_fixed", "d_fixed", "d_seq", "d_ctx"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0")
        if self.net_bytes_per_s <= 0 or self.kv_bytes_per_token <= 0:
            raise ValueError("net_bytes_per_s and kv_bytes_per_token must be > 0")

    def prefill_s(self, new_tokens: int, cached_tokens: int) -> float:
        if new_tokens <= 0:
            return 0.0
        return (self.p_fixed + self.p_token * new_tokens
                + self.p_pair * new_tokens * (cached_tokens + new_tokens / 2))

    def transfer_s(self, nbytes: int) -> float:
        return 0.0 if nbytes <= 0 else self.t_fixed + nbytes / self.net_bytes_per_s

    def decode_step_s(self, batch_size: int, context_tokens: int) -> float:
        if batch_size <= 0:
            return 0.0
        return self.d_fixed + self.d_seq * batch_size + self.d_ctx * context_tokens

    def block_bytes(self, block_tokens: int = BLOCK_TOKENS) -> int:
        return block_tokens * self.kv_bytes_per_token

    # ---- constructors ------------------------------------------------------------------

    @classmethod
    def a800_llama2_70b(cls, *, prefill_mfu: float = 0.5, hbm_efficiency: float = 0.7,
                        step_overhead_s: float = 0.005, transfer_latency_s: float = 0.001,
                        gpus: int = GPUS_PER_INSTANCE,
                        net_bytes_per_s: float = RDMA_BYTES_PER_S) -> PolyCostModel:
        """LLaMA2-70B served by one instance of ``gpus`` A800s with tensor parallelism.

        Sources and assumptions (documented in benchmarks/RESULTS.md too):

        * prefill: ``2 * 69e9`` FLOPs per token for the dense layers and
          ``4 * 80 layers * 8192`` FLOPs per (query, key) pair for attention, at
          ``prefill_mfu`` (assumed 0.5, the usual range for long-prompt TP8 prefill is
          0.4-0.6) of ``gpus * 312`` TFLOPS. A 12k-token prompt (the conversation
          trace's mean) then takes ~1.5 s, a 128k one ~31 s;
        * decode: every step reads the 138 GB of BF16 weights plus the whole batch's
          KV cache (327,680 B/token) at ``hbm_efficiency`` (assumed 0.7) of
          ``gpus * 2.039`` TB/s, plus ``step_overhead_s`` (assumed 5 ms: tensor-parallel
          all-reduces, launches, sampling) and each sequence's 2 FLOPs/parameter at
          peak. An empty-ish batch steps in ~17 ms, a full one (1.3M tokens) in ~60 ms;
        * transfer: 87 GB/s (Transfer Engine on 4 x 200 Gbps RDMA, FAST'25) plus
          ``transfer_latency_s`` (assumed 1 ms) per transfer: one 512-token block
          (160 MiB) moves in ~1.9 ms.
        """
        flops = gpus * A800_BF16_FLOPS
        hbm = gpus * A800_HBM_BYTES_PER_S * hbm_efficiency
        return cls(
            kv_bytes_per_token=LLAMA2_70B_KV_BYTES_PER_TOKEN,
            p_token=2 * LLAMA2_70B_PARAMS / (flops * prefill_mfu),
            p_pair=4 * LLAMA2_70B_LAYERS * LLAMA2_70B_ATTN_WIDTH / (flops * prefill_mfu),
            t_fixed=transfer_latency_s,
            net_bytes_per_s=net_bytes_per_s,
            d_fixed=LLAMA2_70B_WEIGHT_BYTES / hbm + step_overhead_s,
            d_seq=2 * LLAMA2_70B_PARAMS / flops,
            d_ctx=LLAMA2_70B_KV_BYTES_PER_TOKEN / hbm,
        )

    @classmethod
    def calibrated(cls, *, prefill_tokens_per_s: float, decode_step_s: float,
                   kv_bytes_per_token: int, net_bytes_per_s: float,
                   prefill_pair_s: float = 0.0, decode_s_per_seq: float = 0.0,
                   decode_s_per_context_token: float = 0.0,
                   transfer_latency_s: float = 0.0) -> PolyCostModel:
        """From a worker's measured speed: prefill tokens/s on short prompts, the step
        time of a near-empty decode batch, and optionally the growth terms."""
        if prefill_tokens_per_s <= 0:
            raise ValueError("prefill_tokens_per_s must be > 0")
        return cls(kv_bytes_per_token=kv_bytes_per_token, p_token=1.0 / prefill_tokens_per_s,
                   p_pair=prefill_pair_s, t_fixed=transfer_latency_s,
                   net_bytes_per_s=net_bytes_per_s, d_fixed=decode_step_s,
                   d_seq=decode_s_per_seq, d_ctx=decode_s_per_context_token)

    @classmethod
    def fit(cls, *, prefill: Sequence[tuple[int, int, float]],
            decode: Sequence[tuple[int, int, float]], kv_bytes_per_token: int,
            net_bytes_per_s: float, transfer_latency_s: float = 0.0) -> PolyCostModel:
        """Least-squares coefficients from measurements.

        ``prefill``: ``(new_tokens, cached_tokens, seconds)`` samples; ``decode``:
        ``(batch_size, context_tokens, seconds)`` samples. Coefficients are fitted
        with non-negative least squares by clipping (a negative coefficient is set to
        0 and the rest refitted), so the model stays monotone.
        """
        import numpy as np

        def nnls(a: np.ndarray, y: np.ndarray) -> list[float]:
            keep = list(range(a.shape[1]))
            coef = np.zeros(a.shape[1])
            while keep:
                sol, *_ = np.linalg.lstsq(a[:, keep], y, rcond=None)
                if (sol >= 0).all():
                    coef[keep] = sol
                    break
                keep = [k for k, s in zip(keep, sol, strict=True) if s >= 0]
            return [float(c) for c in coef]

        if len(prefill) < 3 or len(decode) < 3:
            raise ValueError("need at least 3 prefill and 3 decode samples")
        pa = np.array([[1.0, n, n * (c + n / 2)] for n, c, _ in prefill])
        p = nnls(pa, np.array([s for *_, s in prefill]))
        da = np.array([[1.0, b, ctx] for b, ctx, _ in decode])
        d = nnls(da, np.array([s for *_, s in decode]))
        return cls(kv_bytes_per_token=kv_bytes_per_token, p_fixed=p[0], p_token=p[1],
                   p_pair=p[2], t_fixed=transfer_latency_s, net_bytes_per_s=net_bytes_per_s,
                   d_fixed=d[0], d_seq=d[1], d_ctx=d[2])


def streamed_kv_ready_s(prefill_s: float, transfer_s: float, layers: int) -> float:
    """When a prompt's KV has fully reached the decode instance, counted from the start of
    its prefill compute, if it streams layer by layer as each layer is computed (Mooncake's
    layer-wise transfer, FAST'25 section 4).

    A two-stage pipeline of ``layers`` equal layers: the prefill finishes a layer every
    ``prefill_s / layers``, the link sends one in ``transfer_s / layers`` (the whole
    prompt's ``transfer_s`` split evenly, its fixed latency too), in order. The last layer
    lands at ``max(prefill_s + transfer_s / layers, prefill_s / layers + transfer_s)``:
    one layer's transfer after the prefill when compute is the slower stage, the whole
    transfer after the first layer otherwise. The KV of a reused prefix is treated as
    computed with its layer (it could leave earlier): an upper bound. ``layers == 1`` is
    no overlap: ``prefill_s + transfer_s``."""
    if layers < 1:
        raise ValueError("layers must be >= 1")
    if transfer_s <= 0:
        return prefill_s
    return max(prefill_s + transfer_s / layers, prefill_s / layers + transfer_s)


def a800_kv_capacity_tokens(*, gpus: int = GPUS_PER_INSTANCE, reserve_fraction: float = 0.1,
                            kv_bytes_per_token: int = LLAMA2_70B_KV_BYTES_PER_TOKEN) -> int:
    """KV tokens a decode instance of ``gpus`` A800-80GB holds next to LLaMA2-70B's weights,
    keeping ``reserve_fraction`` of HBM for activations and workspace (assumed 10%):
    8 GPUs -> (640 GiB * 0.9 - 138 GB) / 327,680 B = ~1.34M tokens."""
    free = gpus * A800_HBM_BYTES * (1 - reserve_fraction) - LLAMA2_70B_WEIGHT_BYTES
    if free <= 0:
        raise ValueError(f"{gpus} GPUs cannot hold the weights")
    return int(free // kv_bytes_per_token)
