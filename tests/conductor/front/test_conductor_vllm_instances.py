"""``conductor.front.vllm_instances``: reading vLLM's /metrics and calibrating from observations."""

from __future__ import annotations

import asyncio

import httpx
import pytest

from conductor.front.vllm_instances import (
    DEFAULT_DECODE_STEP_S,
    DEFAULT_PREFILL_S_PER_TOKEN,
    HEAD_CREDIT,
    Calibration,
    InstanceLoad,
    VllmInstance,
    metric_sum,
    parse_metrics,
)

TEXT = """# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="/m"} 3.0
vllm:num_requests_waiting{engine="0",model_name="/m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="/m"} 1.0
vllm:kv_cache_usage_perc{engine="0",model_name="/m"} 0.25
vllm:external_prefix_cache_hits_total{engine="0",model_name="/m"} 192.0
vllm:cache_config_info{block_size="32",engine="0",name="a \\"q\\" b",num_gpu_blocks="2048"} 1.0
not a metric line
"""


def test_parse_metrics_reads_labels_and_sums_label_sets() -> None:
    m = parse_metrics(TEXT)
    assert metric_sum(m, "vllm:num_requests_running") == 3.0
    assert metric_sum(m, "vllm:num_requests_waiting") == 3.0
    assert metric_sum(m, "vllm:kv_cache_usage_perc") == 0.25
    assert metric_sum(m, "vllm:absent") == 0
    [(labels, value)] = m["vllm:cache_config_info"]
    assert labels["block_size"] == "32" and labels["num_gpu_blocks"] == "2048"
    assert labels["name"] == 'a \\"q\\" b'
    assert value == 1.0


def test_calibration_starts_from_defaults_and_follows_observations() -> None:
    cal = Calibration()
    cost = cal.cost()
    assert cost.prefill_s(1000, 0) == pytest.approx(1000 * DEFAULT_PREFILL_S_PER_TOKEN)
    assert cost.decode_step_s(1, 100) == DEFAULT_DECODE_STEP_S
    cal.observe_prefill(computed_tokens=4, seconds=0.02)  # tiny: the fixed overhead
    assert cal.prefill_fixed_s.value == 0.02
    cal.observe_prefill(computed_tokens=200, seconds=0.22)  # (0.22 - 0.02) / 200
    assert cal.prefill_s_per_token.value == pytest.approx(0.001)
    cal.observe_prefill(computed_tokens=200, seconds=0.42)  # 0.002/token, EMA alpha 0.3
    assert cal.prefill_s_per_token.value == pytest.approx(0.7 * 0.001 + 0.3 * 0.002)
    cal.observe_decode(tokens=10, seconds=0.2)
    assert cal.cost().decode_step_s(4, 1000) == pytest.approx(0.02)
    cal.observe_decode(tokens=0, seconds=1.0)  # nothing to learn
    cal.observe_prefill(computed_tokens=100, seconds=float("nan"))
    assert cal.decode_step_s.samples == 1
    assert cal.prefill_s_per_token.samples == 2
    assert cal.cost().prefill_s(100, 0) == pytest.approx(0.02 + 100 * (0.7e-3 + 0.6e-3))


class Clock:
    """A clock the test moves."""

    def __init__(self, t: float = 100.0) -> None:
        self.t = t

    def __call__(self) -> float:
        return self.t


def instance(clock: Clock | None = None) -> VllmInstance:
    inst = VllmInstance("127.0.0.1:1", role="colocated", http=httpx.AsyncClient(),
                        clock=clock or Clock())
    inst.calibration.prefill_s_per_token.add(0.001)  # 1,000 tokens/s, no fixed part
    return inst


def test_pending_prefills_are_the_queue_until_released_once() -> None:
    inst = instance()
    assert inst.queue_s(mean_prompt_tokens=500) == 0.0
    a = inst.start_prefill(300)
    b = inst.start_prefill(200)
    assert (a.ahead, b.ahead) == (0, 300)
    assert inst.pending_prefill_tokens == 500
    assert inst.queue_s(mean_prompt_tokens=999) == pytest.approx(0.5)
    a.release(seconds=None)
    a.release(seconds=None)  # the second call changes nothing
    assert inst.pending_prefill_tokens == 200
    b.release(seconds=None)
    assert inst.pending_prefill_tokens == 0
    assert inst.calibration.prefill_s_per_token.samples == 1  # nothing observed


def test_a_prefill_behind_others_is_observed_with_their_tokens() -> None:
    """Its time to first token covers the 300 tokens ahead: the rate learnt is the
    engine's 1 ms/token, not 2.5 ms/token (which would be its queue counted as compute)."""
    inst = instance()
    inst.start_prefill(300)
    b = inst.start_prefill(200)
    b.release(seconds=0.5)
    assert inst.calibration.prefill_s_per_token.value == pytest.approx(0.001)
    b.release(seconds=9.0)  # released already: not observed again
    assert inst.calibration.prefill_s_per_token.samples == 2


def test_the_head_prefill_s_progress_comes_off_the_queue() -> None:
    """A 1,000-token head sent at t=100 has computed 0.3 s by t=100.3: 0.7 s of it and the
    500 tokens behind it are left. Its progress takes off at most half its estimate (an
    overdue prefill is not known to be nearly done); once it releases, the next head
    begins then."""
    assert HEAD_CREDIT == 0.5
    clock = Clock(100.0)
    inst = instance(clock)
    head = inst.start_prefill(1000)
    clock.t = 100.2
    second = inst.start_prefill(500)  # sent while the head computes: the head began at 100
    assert inst.queue_s(mean_prompt_tokens=1, now=100.3) == pytest.approx(0.7 + 0.5)
    clock.t = 100.45
    assert inst.queue_s(mean_prompt_tokens=1) == pytest.approx(0.55 + 0.5)
    assert inst.queue_s(mean_prompt_tokens=1, now=100.8) == pytest.approx(0.5 + 0.5)
    assert inst.queue_s(mean_prompt_tokens=1, now=102.0) == pytest.approx(0.5 + 0.5)  # overdue
    second.release(seconds=None)  # not the head: the head's start stays
    assert inst.queue_s(mean_prompt_tokens=1, now=100.4) == pytest.approx(0.6)
    third = inst.start_prefill(200)
    clock.t = 101.2
    head.release(seconds=None)  # the head is over: the third begins now
    assert inst.queue_s(mean_prompt_tokens=1, now=101.25) == pytest.approx(0.15)
    assert inst.queue_s(mean_prompt_tokens=1, now=101.5) == pytest.approx(0.1)  # half, at most
    third.end()
    assert inst.queue_s(mean_prompt_tokens=1, now=101.3) == 0.0
    clock.t = 101.4
    inst.start_prefill(100)  # nothing pending before it: it begins when sent
    assert inst.queue_s(mean_prompt_tokens=1, now=101.4) == pytest.approx(0.1)
    assert inst.queue_s(mean_prompt_tokens=1, now=101.43) == pytest.approx(0.07)


def test_decoding_requests_and_the_engine_queue() -> None:
    """Requests past their first token are not prefill work ahead; the engine's waiting
    requests that are not the front's (other clients') count at the mean prompt, on top of
    the front's own."""
    inst = instance()
    inst.in_flight = 5  # all decoding
    assert inst.queue_s(mean_prompt_tokens=400) == 0.0
    inst.load = InstanceLoad(running=5, waiting=2, kv_usage=0.1, external_hits=0)
    assert inst.queue_s(mean_prompt_tokens=400) == pytest.approx(0.8)
    inst.start_prefill(1000)
    assert inst.queue_s(mean_prompt_tokens=400) == pytest.approx(1.8)


def test_the_front_s_own_waiting_requests_count_by_what_they_compute() -> None:
    """Two of the three waiting requests of the reading are the front's own hits computing
    24 tokens each: they count as 48 tokens, not as two mean prompts, before and after
    they start."""
    metrics = TEXT  # 3 waiting
    inst = VllmInstance("127.0.0.1:1", role="colocated", http=httpx.AsyncClient(
        transport=httpx.MockTransport(lambda _: httpx.Response(200, text=metrics))),
        clock=Clock())
    inst.calibration.prefill_s_per_token.add(0.001)
    a, b = inst.start_prefill(24, cached=1200), inst.start_prefill(24, cached=1200)
    asyncio.run(inst.read_load())
    assert inst.queue_s(mean_prompt_tokens=400) == pytest.approx(0.048 + 0.4)
    a.release(seconds=0.05)
    b.release(seconds=0.05)  # the reading still shows them waiting: it lags
    assert inst.queue_s(mean_prompt_tokens=400) == pytest.approx(0.4)


def test_a_prefill_mostly_from_cache_is_not_learnt_as_compute() -> None:
    """1,200 tokens loaded and 24 computed in 45 ms is not 1.9 ms per computed token."""
    inst = instance()
    hit = inst.start_prefill(24, cached=1200)
    hit.release(seconds=0.045)
    assert inst.calibration.prefill_s_per_token.value == pytest.approx(0.001)
    assert inst.pending_prefill_tokens == 0
    half = inst.start_prefill(600, cached=600)  # as much computed as cached: observed
    half.release(seconds=1.2)
    assert inst.calibration.prefill_s_per_token.samples == 2


def test_a_request_leaves_in_flight_once_and_frees_its_prefill_if_it_had_no_first_token(
        ) -> None:
    inst = instance()
    a, b = inst.start_prefill(300), inst.start_prefill(200)
    assert inst.in_flight == 2 and inst.pending_prefill_tokens == 500
    a.release(seconds=0.3)  # first token: decoding, still in flight
    assert inst.in_flight == 2 and inst.pending_prefill_tokens == 200
    a.end()
    a.end()  # the second call changes nothing
    b.end()  # ended before any first token: its prefill leaves the queue too
    assert inst.in_flight == 0 and inst.pending_prefill_tokens == 0


def test_a_request_holds_its_blocks_in_the_kv_room_from_sending_until_it_ends() -> None:
    """Expected over at its first token's estimate plus its decode (15 steps of 20 ms); at
    its first token, from then; out of the room when it ends. Without ``first_by`` or a
    room nothing is counted."""
    from conductor.front.kv_room import KvRoom
    from kvstore import block_keys

    clock = Clock(100.0)
    inst = instance(clock)
    inst.calibration.decode_step_s.add(0.02)
    doc = block_keys(list(range(1216)), 32, "ns")  # 38 blocks
    other = block_keys(list(range(5000, 6216)), 32, "ns")
    assert inst.kv_wait_s(other, prompt_tokens=1240, out_tokens=16, now=100.0) == 0.0
    inst.kv_room = KvRoom(capacity_tokens=2200, block_tokens=32)
    untracked = inst.start_prefill(1240, keys=doc, out_tokens=16)  # no first_by
    assert inst.kv_room.held_blocks() == 0
    untracked.end()
    a = inst.start_prefill(1240, keys=doc, out_tokens=16, first_by=100.5)
    assert inst.kv_room.held_blocks() == 40  # 38 + the last 24 tokens and 16 out: 2
    wait = inst.kv_wait_s(other, prompt_tokens=1240, out_tokens=16, now=100.0)
    assert wait == pytest.approx(0.5 + 15 * 0.02)
    clock.t = 100.2
    a.release(seconds=0.2)  # first token sooner than estimated
    assert inst.kv_wait_s(other, prompt_tokens=1240, out_tokens=16,
                          now=100.2) == pytest.approx(15 * 0.02)
    a.end()
    assert inst.kv_room.held_blocks() == 0 and len(inst.kv_room) == 0
    assert inst.kv_wait_s(other, prompt_tokens=1240, out_tokens=16, now=100.2) == 0.0
