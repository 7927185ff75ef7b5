"""A request's retention through ``kv_transfer_params["kvstore_retain_s"]``: vLLM's own
Request and SchedulerOutput types on the scheduler side, then vLLM's real engine (CPU)
saving into a real kvstore node whose stats count the retained blocks."""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_fakes import FakeManager, request_id, tokens
from vllm_llm import external_hits, kvstore_llm

from kvstore import Client, block_keys

pytestmark = pytest.mark.timeout(600)

BLOCK = 32
NAMESPACE = f"retention-test-{time.time_ns()}"
PROMPT_TOKENS = 200  # 6 full blocks; with 12 output tokens still 6 (212 < 224)


def request(tokens: list[int], params: dict[str, Any] | None) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    extra = None if params is None else {"kv_transfer_params": params}
    return Request(request_id(), tokens, SamplingParams(max_tokens=64,
                                                                extra_args=extra), None)


def sched_output(new: list[tuple[Any, list[int]]], scheduled: dict[str, int]) -> Any:
    from vllm.v1.core.sched.output import CachedRequestData, NewRequestData, SchedulerOutput

    return SchedulerOutput(
        scheduled_new_reqs=[NewRequestData.from_request(r, (ids,)) for r, ids in new],
        scheduled_cached_reqs=CachedRequestData.make_empty(), num_scheduled_tokens=scheduled,
        total_num_scheduled_tokens=sum(scheduled.values()), scheduled_spec_decode_tokens={},
        scheduled_encoder_inputs={}, finished_req_ids=set(), free_encoder_mm_hashes=[])


def test_a_retained_requests_lookup_and_saves_cover_its_whole_prefix(make_connector: Any,
                                                                  store_node: Any,
                                                                  client: Client) -> None:
    sched = make_connector("SCHEDULER", store_node.addr, namespace=f"s-{time.time_ns()}",
                           load_inline_when_idle=False)
    sched.bind_kv_cache_manager(FakeManager())
    toks = tokens(200, 1)
    keys = block_keys(toks, BLOCK, sched.namespace)
    client.put_batch(keys[:2], [b"x" * 64] * 2)  # the store already holds 2 blocks

    def held() -> int:
        return int(client.stats()["node"]["retained_blocks"])

    kept, plain = request(toks, {"kvstore_retain_s": 600}), request(toks, None)
    before = held()
    assert sched.get_num_new_matched_tokens(plain, 0) == (64, True)
    assert held() == before
    assert sched.get_num_new_matched_tokens(kept, 0) == (64, True)
    assert held() == before + 2  # the retained request's lookup kept the store's two
    for req in (kept, plain):
        sched._kv_cache_manager.blocks[req.request_id] = list(range(7))
        req.num_computed_tokens = 64  # the two blocks loaded
    meta = sched.build_connector_meta(sched_output(
        [(kept, list(range(7))), (plain, list(range(7)))],
        {kept.request_id: 136, plain.request_id: 136}))  # 64 loaded + 136 = 200 tokens
    by_req = {s.req_id: s for s in meta.saves}
    retained, ordinary = by_req[kept.request_id], by_req[plain.request_id]
    # Retained: the four new blocks, saved with the retention (the store's two were
    # retained at the lookup, without sending their bytes again), so all six are kept.
    assert (retained.keys, retained.block_ids, retained.parent, retained.retain_s) == (
        keys[2:6], [2, 3, 4, 5], keys[1], 600.0)
    assert (ordinary.keys, ordinary.parent, ordinary.retain_s) == (keys[2:6], keys[1], 0.0)
    client.retain(keys[:2], 0)  # leave the shared node as it was
    assert held() == before


@pytest.mark.parametrize("bad", [-5, "ten", float("inf"), 10**7])
def test_a_bad_retention_is_ignored_with_a_warning(make_connector: Any, store_node: Any,
                                                   caplog: pytest.LogCaptureFixture,
                                                   bad: Any) -> None:
    from kvstore.integrations.vllm_connector import request_retain_s

    req = request(tokens(64, 2), {"kvstore_retain_s": bad})
    with caplog.at_level(logging.WARNING, logger="vllm.kvstore_connector"):
        assert request_retain_s(req) == 0.0
    assert f"{req.request_id}: ignoring kvstore_retain_s: retain_s" in caplog.text
    assert request_retain_s(request(tokens(64, 2), {"kvstore_retain_s": 30})) == 30.0
    assert request_retain_s(request(tokens(64, 2), {"other": 1})) == 0.0


@pytest.fixture(scope="module")
def engine(tiny_llama: Path, store_node: Any) -> Iterator[Any]:
    with kvstore_llm(tiny_llama, store_node.addr, NAMESPACE) as llm:
        yield llm


def generate(llm: Any, toks: list[int], params: dict[str, Any] | None) -> int:
    """Runs one greedy request; vLLM's external-hit count for it."""
    from vllm import SamplingParams

    before = external_hits(llm)
    extra = None if params is None else {"kv_transfer_params": params}
    llm.generate([{"prompt_token_ids": toks}],
                 SamplingParams(max_tokens=12, temperature=0.0, detokenize=False,
                                extra_args=extra), use_tqdm=False)
    return external_hits(llm) - before


def wait_for(predicate: Any, what: str) -> None:
    deadline = time.monotonic() + 30
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def retained(client: Client) -> tuple[int, int]:
    node = client.stats()["node"]
    return node["retained_blocks"], node["retained_bytes"]


def test_the_engine_saves_a_requests_blocks_with_its_retention(engine: Any,
                                                               client: Client) -> None:
    first, second = tokens(PROMPT_TOKENS, 11), tokens(PROMPT_TOKENS, 12)
    keys1 = [bytes(k) for k in block_keys(first, BLOCK, NAMESPACE)]
    keys2 = [bytes(k) for k in block_keys(second, BLOCK, NAMESPACE)]
    assert len(keys1) == len(keys2) == 6
    # A plain request: stored, nothing retained.
    assert generate(engine, first, None) == 0
    wait_for(lambda: all(client.exists(keys1)), "the plain request's blocks saved")
    assert retained(client) == (0, 0)
    (size,) = {n for n in (len(client.get(k) or b"") for k in keys1)}
    # The same prompt with retention: its prefix loads from the store, and its lookup
    # retains those six blocks (one retain call, no bytes sent again).
    assert engine.reset_prefix_cache()  # vLLM forgets its local copy
    assert generate(engine, first, {"kvstore_retain_s": 600}) == 192
    wait_for(lambda: retained(client)[0] == 6, "the stored prefix retained")
    assert retained(client) == (6, 6 * size)
    # A plain request, then the same prompt with retention from vLLM's own prefix cache
    # (nothing to load): the lookup still finds the blocks stored and retains them.
    assert generate(engine, second, None) == 0
    wait_for(lambda: all(client.exists(keys2)), "the second prompt's blocks saved")
    assert retained(client) == (6, 6 * size)
    assert generate(engine, second, {"kvstore_retain_s": 60}) == 0
    wait_for(lambda: retained(client)[0] == 12, "the second prompt's blocks retained")
    assert retained(client) == (12, 12 * size)


def test_the_openai_servers_kv_transfer_params_field_carries_it(
        tiny_llama: Path, store_node: Any, client: Client,
        tmp_path_factory: pytest.TempPathFactory) -> None:
    """``python -m vllm.entrypoints.openai.api_server``: a completion's request body field
    ``kv_transfer_params`` reaches the connector."""
    import sys

    import httpx

    from conductor.front.vllm_procs import start_vllm, wait_ready

    namespace = f"{NAMESPACE}-server"
    server = start_vllm(sys.executable, tiny_llama, tmp_path_factory.mktemp("vllm"),
                        name="retain", store=store_node.addr, namespace=namespace,
                        max_model_len=512)
    try:
        wait_ready(server, "/v1/models", 400)
        before = retained(client)
        toks = tokens(PROMPT_TOKENS, 21)
        body = {"prompt": toks, "max_tokens": 4, "temperature": 0,
                "kv_transfer_params": {"kvstore_retain_s": 120}}
        reply = httpx.post(server.url + "/v1/completions", json=body, timeout=120)
        assert reply.status_code == 200, reply.text
        keys = [bytes(k) for k in block_keys(toks, BLOCK, namespace)]
        wait_for(lambda: all(client.exists(keys)), "the server's blocks saved")
        wait_for(lambda: retained(client)[0] == before[0] + 6, "the blocks retained")
    finally:
        assert server.stop() == 0, server.output()
