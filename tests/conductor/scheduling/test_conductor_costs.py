"""conductor.scheduling.costs: the A800/LLaMA2-70B numbers, calibration and fitting."""

from __future__ import annotations

import pytest

from conductor.scheduling.costs import (
    LLAMA2_70B_KV_BYTES_PER_TOKEN,
    CostModel,
    PolyCostModel,
    a800_kv_capacity_tokens,
    streamed_kv_ready_s,
)


def test_llama2_70b_kv_bytes_per_token_and_block() -> None:
    assert LLAMA2_70B_KV_BYTES_PER_TOKEN == 2 * 80 * 8 * 128 * 2 == 327_680
    m = PolyCostModel.a800_llama2_70b()
    assert isinstance(m, CostModel)
    assert m.kv_bytes_per_token == 327_680
    assert m.block_bytes() == 512 * 327_680 == 160 * 2**20


def test_a800_coefficients_follow_from_the_hardware() -> None:
    m = PolyCostModel.a800_llama2_70b(prefill_mfu=0.5, hbm_efficiency=0.7,
                                      step_overhead_s=0.005, transfer_latency_s=0.001)
    flops = 8 * 312e12 * 0.5
    assert m.p_token == pytest.approx(2 * 69e9 / flops, rel=1e-12)
    assert m.p_pair == pytest.approx(4 * 80 * 8192 / flops, rel=1e-12)
    # 12k-token prompt: dense 1.656e15 + attention 2.62e6 * 12000**2 / 2 FLOPs.
    assert m.prefill_s(12_000, 0) == pytest.approx(
        (2 * 69e9 * 12_000 + 4 * 80 * 8192 * 12_000 * 6_000) / flops, rel=1e-12)
    # Cached tokens make the new ones attend further: quadratic-ish, but much cheaper.
    assert m.prefill_s(1_000, 11_000) < m.prefill_s(12_000, 0) / 5
    hbm = 8 * 2.039e12 * 0.7
    assert m.decode_step_s(1, 0) == pytest.approx(138e9 / hbm + 0.005 + 2 * 69e9 / (8 * 312e12))
    assert m.decode_step_s(10, 1_000_000) - m.decode_step_s(10, 0) == pytest.approx(
        1_000_000 * 327_680 / hbm)
    assert m.transfer_s(512 * 327_680) == pytest.approx(0.001 + 512 * 327_680 / 87e9)


def test_zero_work_costs_nothing() -> None:
    m = PolyCostModel.a800_llama2_70b()
    assert m.prefill_s(0, 5_000) == 0.0
    assert m.transfer_s(0) == 0.0
    assert m.decode_step_s(0, 123) == 0.0


def test_kv_capacity_of_an_8_gpu_decode_instance() -> None:
    free = 8 * 80 * 2**30 * 0.9 - 2 * 69e9
    assert a800_kv_capacity_tokens() == int(free // 327_680) == 1_466_294
    with pytest.raises(ValueError, match="weights"):
        a800_kv_capacity_tokens(gpus=1)


def test_calibrated_takes_measured_speed() -> None:
    m = PolyCostModel.calibrated(prefill_tokens_per_s=4_000, decode_step_s=0.03,
                                 kv_bytes_per_token=1_000, net_bytes_per_s=1e9,
                                 decode_s_per_context_token=1e-8, transfer_latency_s=0.002)
    assert m.prefill_s(2_000, 0) == pytest.approx(0.5)
    assert m.decode_step_s(4, 1_000_000) == pytest.approx(0.04)
    assert m.transfer_s(10**9) == pytest.approx(1.002)
    with pytest.raises(ValueError):
        PolyCostModel.calibrated(prefill_tokens_per_s=0, decode_step_s=0.03,
                                 kv_bytes_per_token=1, net_bytes_per_s=1.0)


def test_fit_recovers_the_coefficients_of_exact_samples() -> None:
    truth = PolyCostModel(kv_bytes_per_token=100, p_fixed=0.01, p_token=2e-4, p_pair=3e-9,
                          net_bytes_per_s=1e9, d_fixed=0.02, d_seq=1e-4, d_ctx=2e-8)
    prefill = [(n, c, truth.prefill_s(n, c)) for n in (100, 1_000, 4_000, 16_000)
               for c in (0, 2_000, 30_000)]
    decode = [(b, ctx, truth.decode_step_s(b, ctx)) for b in (1, 8, 64)
              for ctx in (1_000, 200_000, 900_000)]
    m = PolyCostModel.fit(prefill=prefill, decode=decode, kv_bytes_per_token=100,
                          net_bytes_per_s=1e9)
    for name in ("p_fixed", "p_token", "p_pair", "d_fixed", "d_seq", "d_ctx"):
        assert getattr(m, name) == pytest.approx(getattr(truth, name), rel=1e-6, abs=1e-12)


def test_fit_keeps_coefficients_non_negative() -> None:
    # Decode time falling with batch size is noise: d_seq is clipped to 0 and refitted.
    decode = [(1, 0, 0.030), (2, 0, 0.029), (4, 0, 0.028), (8, 0, 0.027)]
    prefill = [(1_000, 0, 0.1), (2_000, 0, 0.2), (4_000, 0, 0.4)]
    m = PolyCostModel.fit(prefill=prefill, decode=decode, kv_bytes_per_token=1,
                          net_bytes_per_s=1.0)
    assert m.d_seq == 0.0
    assert m.d_fixed == pytest.approx(0.0285)
    assert m.p_token == pytest.approx(1e-4)
    with pytest.raises(ValueError, match="at least 3"):
        PolyCostModel.fit(prefill=prefill[:2], decode=decode, kv_bytes_per_token=1,
                          net_bytes_per_s=1.0)


def test_negative_coefficients_are_refused() -> None:
    with pytest.raises(ValueError, match="p_token"):
        PolyCostModel(kv_bytes_per_token=1, p_token=-1.0, net_bytes_per_s=1.0, d_fixed=0.0)
    with pytest.raises(ValueError):
        PolyCostModel(kv_bytes_per_token=1, p_token=1.0, net_bytes_per_s=0.0, d_fixed=0.0)


def test_streamed_kv_overlaps_the_transfer_with_the_prefill() -> None:
    # Compute-bound: 1 s of prefill, 0.5 s of transfer, 4 layers: the last layer is
    # computed at 1.0 and sent in 0.125 -> 1.125 (not 1.5).
    assert streamed_kv_ready_s(1.0, 0.5, 4) == 1.125
    # Transfer-bound: 1 s of prefill, 2 s of transfer: the link starts after the first
    # layer (0.25) and is busy from then on -> 2.25.
    assert streamed_kv_ready_s(1.0, 2.0, 4) == 2.25
    # One layer is no overlap; no bytes is no transfer; a fully cached prompt (no compute)
    # waits for the whole transfer.
    assert streamed_kv_ready_s(1.0, 0.5, 1) == 1.5
    assert streamed_kv_ready_s(1.0, 0.0, 80) == 1.0
    assert streamed_kv_ready_s(0.0, 0.5, 80) == 0.5
    with pytest.raises(ValueError, match="layers"):
        streamed_kv_ready_s(1.0, 0.5, 0)


def test_streamed_kv_of_a_12k_prompt_on_the_a800_model() -> None:
    # 12k tokens: prefill ~1.48 s, whole transfer 1 ms + 3.93 GB / 87 GB/s ~ 46 ms; over 80
    # layers the decode gets the KV one layer's transfer (~0.6 ms) after the prefill.
    m = PolyCostModel.a800_llama2_70b()
    p = m.prefill_s(12_000, 0)
    t = m.transfer_s(12_000 * m.kv_bytes_per_token)
    assert t == pytest.approx(0.001 + 12_000 * 327_680 / 87e9)
    assert streamed_kv_ready_s(p, t, 80) - p == pytest.approx(t / 80)
