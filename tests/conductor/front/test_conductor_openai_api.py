"""``conductor.front.openai_api``: request checks and error bodies."""

from __future__ import annotations

import pytest

from conductor.front.openai_api import (
    DEFAULT_MAX_TOKENS,
    BadRequest,
    check_sampling,
    error_body,
    max_tokens,
    prompt_token_ids,
)


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
    with pytest.raises(BadRequest, match="n > 1"):
        check_sampling({"n": 2})
    with pytest.raises(BadRequest, match="stream must be true or false"):
        check_sampling({"stream": "yes"})


def test_error_body_is_openais_shape() -> None:
    assert error_body(429, "request rejected: x", reason="x") == {"error": {
        "message": "request rejected: x", "type": "rate_limit_exceeded", "param": None,
        "code": 429, "reason": "x"}}
    assert error_body(400, "bad")["error"]["type"] == "invalid_request_error"
    assert error_body(504, "slow")["error"]["type"] == "timeout"
