"""``conductor.front.openai_api``: request checks and error bodies."""

from __future__ import annotations

import pytest

from conductor.front.openai_api import (
    DEFAULT_MAX_TOKENS,
    BadRequest,
    check_sampling,
    choices,
    error_body,
    max_tokens,
    output_tokens,
    prefill_body,
    prompt_token_ids,
    with_retention,
    with_stored,
)
from kvstore.integrations.vllm.describe import RETAIN_PARAM, STORED_PARAM


def test_prompt_token_ids_accepts_ids_and_a_batch_of_one() -> None:
    assert prompt_token_ids({"prompt": [1, 2, 3]}) == [1, 2, 3]
    assert prompt_token_ids({"prompt": [[4, 5]]}) == [4, 5]


@pytest.mark.parametrize("prompt", [None, [], "text", [[1], [2]], [1, -1], [1, True], [1.5]])
def test_prompt_token_ids_refuses_what_it_cannot_route(prompt: object) -> None:
    with pytest.raises(BadRequest):
        prompt_token_ids({"prompt": prompt})


def test_max_tokens_and_sampling_checks() -> None:
    assert max_tokens({}) == DEFAULT_MAX_TOKENS
    assert max_tokens({"max_tokens": None}) == DEFAULT_MAX_TOKENS
    assert max_tokens({"max_tokens": 7}) == 7
    for bad in (0, -1, "3", 2.0, True):
        with pytest.raises(BadRequest, match="max_tokens must be an integer >= 1"):
            max_tokens({"max_tokens": bad})
    check_sampling({"n": 1, "stream": True})
    check_sampling({"n": 3})  # vLLM answers n choices; the front passes them through
    assert choices({"n": 3}) == 3 and choices({}) == 1 and choices({"n": None}) == 1
    for bad in (0, "2", 1.5, True):
        with pytest.raises(BadRequest, match="n must be an integer >= 1"):
            check_sampling({"n": bad})
    with pytest.raises(BadRequest, match="stream must be true or false"):
        check_sampling({"stream": "yes"})


def test_error_body_is_openais_shape() -> None:
    assert error_body(429, "request rejected: x", reason="x") == {"error": {
        "message": "request rejected: x", "type": "rate_limit_exceeded", "param": None,
        "code": 429, "reason": "x"}}
    assert error_body(400, "bad")["error"]["type"] == "invalid_request_error"
    assert error_body(504, "slow")["error"]["type"] == "timeout"


def test_output_budget_of_completions_and_chat() -> None:
    assert output_tokens({}, chat=False) == DEFAULT_MAX_TOKENS
    assert output_tokens({}, chat=True) is None  # the server's default: what is left
    assert output_tokens({"max_tokens": 5}, chat=True) == 5
    assert output_tokens({"max_completion_tokens": 7, "max_tokens": 5}, chat=True) == 7
    with pytest.raises(BadRequest):
        output_tokens({"max_completion_tokens": 0}, chat=True)


def test_the_prefill_copy_keeps_the_prompt_and_drops_what_shapes_the_answer() -> None:
    body = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "n": 3,
            "stream": True, "stream_options": {"include_usage": True}, "logprobs": True,
            "top_logprobs": 2, "max_completion_tokens": 50, "temperature": 0.5,
            "kv_transfer_params": {"kvstore_retain_s": 60}}
    assert prefill_body(body) == {
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "temperature": 0.5,
        "kv_transfer_params": {"kvstore_retain_s": 60}, "max_tokens": 1, "stream": False}
    assert body["n"] == 3  # the client's request is left as it was


def test_a_session_turn_asks_the_connector_to_save_retained() -> None:
    assert RETAIN_PARAM == "kvstore_retain_s"
    body = {"model": "m", "prompt": [1, 2]}
    assert with_retention(body, 120.0) == (
        {"model": "m", "prompt": [1, 2], "kv_transfer_params": {RETAIN_PARAM: 120.0}}, True)
    assert body == {"model": "m", "prompt": [1, 2]}  # the client's request is left as it was
    other = {"prompt": [1], "kv_transfer_params": {"kvstore_describe": True}}
    assert with_retention(other, 60.0) == (
        {"prompt": [1], "kv_transfer_params": {"kvstore_describe": True, RETAIN_PARAM: 60.0}},
        True)
    assert with_retention({"prompt": [1], "kv_transfer_params": None}, 60.0)[0] == {
        "prompt": [1], "kv_transfer_params": {RETAIN_PARAM: 60.0}}


@pytest.mark.parametrize("params", [{RETAIN_PARAM: 5}, {RETAIN_PARAM: 0}, "x", [1]])
def test_a_clients_own_retention_or_bad_params_are_left_alone(params: object) -> None:
    body = {"prompt": [1], "kv_transfer_params": params}
    assert with_retention(body, 60.0) == (body, False)


def test_the_fronts_lookup_goes_to_the_instance_in_kv_transfer_params() -> None:
    assert STORED_PARAM == "kvstore_stored_blocks"
    body = {"model": "m", "prompt": [1, 2], "kv_transfer_params": {RETAIN_PARAM: 5.0}}
    assert with_stored(body, 3) == {"model": "m", "prompt": [1, 2],
                                    "kv_transfer_params": {RETAIN_PARAM: 5.0, STORED_PARAM: 3}}
    assert body["kv_transfer_params"] == {RETAIN_PARAM: 5.0}  # left as it was
    assert with_stored({"prompt": [1]}, 0) == {"prompt": [1],
                                               "kv_transfer_params": {STORED_PARAM: 0}}


@pytest.mark.parametrize("params", [{STORED_PARAM: 7}, "x", [1]])
def test_a_clients_own_stored_blocks_or_bad_params_are_left_alone(params: object) -> None:
    body = {"prompt": [1], "kv_transfer_params": params}
    assert with_stored(body, 2) is body
