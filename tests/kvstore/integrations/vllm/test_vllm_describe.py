"""``kvstore.integrations.vllm.describe``: the connector's answer to a router that asks
(the engine tests ask real vLLM servers through the OpenAI API)."""

from __future__ import annotations

from kvstore.integrations.vllm.describe import DESCRIBE_PARAM, REPLY_KEY, describe_reply


def test_only_a_request_that_asks_gets_the_description() -> None:
    kw = {"namespace": "llama/bf16", "block_tokens": 32, "kv_role": "kv_consumer"}
    assert describe_reply({DESCRIBE_PARAM: True}, **kw) == {REPLY_KEY: {
        "version": 1, "namespace": "llama/bf16", "block_tokens": 32,
        "kv_role": "kv_consumer", "shards": []}}
    for params in (None, {}, {"kvstore_retain_s": 30}, {DESCRIBE_PARAM: "yes"},
                   {DESCRIBE_PARAM: 1}, [DESCRIBE_PARAM]):
        assert describe_reply(params, **kw) is None


def test_a_parallel_engine_names_its_shards() -> None:
    reply = describe_reply({DESCRIBE_PARAM: True}, namespace="ns", block_tokens=32,
                           kv_role="kv_both", shards=("tp0of2.pp0of1", "tp1of2.pp0of1"))
    assert reply == {REPLY_KEY: {"version": 1, "namespace": "ns", "block_tokens": 32,
                                 "kv_role": "kv_both",
                                 "shards": ["tp0of2.pp0of1", "tp1of2.pp0of1"]}}
