"""``kvstore.integrations.vllm.describe``: the connector's answer to a router that asks
(the engine tests ask real vLLM servers through the OpenAI API)."""

from __future__ import annotations

from kvstore.integrations.vllm.describe import DESCRIBE_PARAM, REPLY_KEY, describe_reply


def test_only_a_request_that_asks_gets_the_description() -> None:
    kw = {"namespace": "llama/bf16", "block_tokens": 32, "kv_role": "kv_consumer"}
    assert describe_reply({DESCRIBE_PARAM: True}, **kw) == {REPLY_KEY: {
        "version": 1, "namespace": "llama/bf16", "block_tokens": 32,
        "kv_role": "kv_consumer"}}
    for params in (None, {}, {"kvstore_retain_s": 30}, {DESCRIBE_PARAM: "yes"},
                   {DESCRIBE_PARAM: 1}, [DESCRIBE_PARAM]):
        assert describe_reply(params, **kw) is None
