"""KVStoreConnector's scheduler side with vLLM's own Request and SchedulerOutput types and
a real kvstore node, no engine (seconds, not a minute)."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm_fakes import FakeManager, blocks_of, request, request_id, sched_output, tokens

from kvstore import Client, block_keys
from kvstore.core.ports import free_port

BLOCK = 32


@pytest.fixture
def sched(make_connector: Any, store_node: Any) -> Any:
    # The lookup's rules, on the asynchronous path (test_vllm_load_mode: when loads are inline).
    conn = make_connector("SCHEDULER", store_node.addr, namespace=f"sched-{time.time_ns()}",
                          load_inline_when_idle=False)
    conn.bind_kv_cache_manager(FakeManager())
    return conn


def store(client: Client, keys: list[bytes]) -> None:
    client.put_batch(keys, [b"x" * 64 for _ in keys])


def test_lookup_offers_the_stored_prefix_beyond_the_local_hit(sched: Any, client: Client
                                                              ) -> None:
    toks = tokens(200, 1)  # 6 full blocks
    keys = block_keys(toks, BLOCK, sched.namespace)
    assert len(keys) == 6
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (0, False)

    store(client, keys[:4])
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (128, True)
    # vLLM's own prefix cache already has 2 blocks: only the rest is offered.
    assert sched.get_num_new_matched_tokens(request(toks), 64) == (64, True)
    assert sched.get_num_new_matched_tokens(request(toks), 128) == (0, False)

    store(client, keys[4:])
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (192, True)
    # A prompt of exactly 6 blocks: its last token is computed by vLLM, so 5 blocks.
    assert sched.get_num_new_matched_tokens(request(toks[:192]), 0) == (160, True)
    # Shorter than a block: nothing to look up.
    assert sched.get_num_new_matched_tokens(request(toks[:31]), 0) == (0, False)


def test_keys_carry_salt_and_differ_from_plain_text(sched: Any, client: Client) -> None:
    toks = tokens(100, 2)
    store(client, block_keys(toks, BLOCK, sched.namespace))
    assert sched.get_num_new_matched_tokens(request(toks), 0) == (96, True)
    assert sched.get_num_new_matched_tokens(request(toks, cache_salt="tenant-a"), 0) == (0, False)


def test_an_unreachable_store_is_a_miss(make_connector: Any) -> None:
    conn = make_connector("SCHEDULER", f"127.0.0.1:{free_port()}", timeout=3)
    t0 = time.monotonic()
    assert conn.get_num_new_matched_tokens(request(tokens(100, 3)), 0) == (0, False)
    assert time.monotonic() - t0 < 10


def test_the_store_is_asked_once_per_request_and_again_after_a_preemption(
        sched: Any, client: Client) -> None:
    toks = tokens(200, 8)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys[:2])
    req = request(toks)
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    store(client, keys[2:])
    # vLLM asks on every scheduler pass the request waits through: the first answer holds
    # (the store is not asked again, so the blocks stored since are not seen).
    assert sched.get_num_new_matched_tokens(req, 0) == (64, True)
    assert sched.get_num_new_matched_tokens(req, 32) == (32, True)
    assert (sched.stats["store_lookups"], sched.stats["lookups_reused"]) == (1, 2)
    # Preempted after an output token: its tokens grew, so the store is asked again.
    req.append_output_token_ids(7)
    assert sched.get_num_new_matched_tokens(req, 0) == (192, True)
    assert sched.stats["store_lookups"] == 2


def hinted(toks: list[int], params: dict[str, Any], **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(request_id(), toks, SamplingParams(
        max_tokens=64, extra_args={"kv_transfer_params": params}), None, **kw)


def test_a_routers_stored_blocks_stand_for_the_lookup(sched: Any, client: Client) -> None:
    toks = tokens(200, 9)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys[:5])
    # The router found 3 blocks: the connector offers those, asking the store nothing.
    assert sched.get_num_new_matched_tokens(hinted(toks, {"kvstore_stored_blocks": 3}), 0
                                            ) == (96, True)
    # More than the prompt's full blocks: its last token is still computed by vLLM.
    assert sched.get_num_new_matched_tokens(hinted(toks, {"kvstore_stored_blocks": 99}), 0
                                            ) == (192, True)
    assert sched.get_num_new_matched_tokens(hinted(toks, {"kvstore_stored_blocks": 0}), 0
                                            ) == (0, False)
    assert (sched.stats["store_lookups"], sched.stats["lookups_from_router"]) == (0, 3)
    # Keys the router did not compute (a cache salt) or a value that is not a block
    # count: the store is asked.
    assert sched.get_num_new_matched_tokens(
        hinted(toks, {"kvstore_stored_blocks": 6}, cache_salt="t"), 0) == (0, False)
    for bad in (-1, "3", 2.0, True):
        assert sched.get_num_new_matched_tokens(hinted(toks, {"kvstore_stored_blocks": bad}),
                                                0) == (160, True)
    assert (sched.stats["store_lookups"], sched.stats["lookups_from_router"]) == (5, 3)


@pytest.mark.parametrize("router", [False, True])
def test_after_a_refused_first_block_the_store_is_asked_again(sched: Any, client: Client,
                                                              router: bool) -> None:
    """vLLM looks a request up again when its load's first block was refused; the kept
    answer (or the router's count) would load the dropped block again, for ever."""
    from vllm.v1.outputs import KVConnectorOutput

    toks = tokens(200, 10 + router)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys)
    req = hinted(toks, {"kvstore_stored_blocks": 6}) if router else request(toks)
    ids = list(range(30, 37))
    sched._kv_cache_manager.blocks[req.request_id] = ids
    assert sched.get_num_new_matched_tokens(req, 0) == (192, True)
    sched.update_state_after_alloc(req, blocks_of(ids), 192)
    sched.build_connector_meta(sched_output())
    client.remove(keys[0])  # the worker refused block 0 and removed it
    sched.update_connector_output(KVConnectorOutput(finished_recving={req.request_id},
                                                    invalid_block_ids=set(ids[:6])))
    asked = sched.stats["store_lookups"]
    assert sched.get_num_new_matched_tokens(req, 0) == (0, False)
    assert sched.stats["store_lookups"] == asked + 1


def test_load_spec_names_the_external_blocks(sched: Any, client: Client) -> None:
    toks = tokens(200, 4)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys)
    req = request(toks)
    assert sched.get_num_new_matched_tokens(req, 64) == (128, True)
    sched.update_state_after_alloc(req, blocks_of(list(range(40, 47))), 128)
    meta = sched.build_connector_meta(sched_output())
    assert len(meta.loads) == 1
    load = meta.loads[0]
    assert load.req_id == req.request_id
    assert load.keys == keys[2:6]
    assert load.block_ids == [42, 43, 44, 45]
    assert meta.saves == []
    # Handed over once.
    assert sched.build_connector_meta(sched_output()).loads == []


def test_saves_follow_computed_full_blocks_with_parents(sched: Any, client: Client) -> None:
    toks = tokens(200, 5)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys[:2])  # the store has 2 blocks; vLLM computes everything itself
    req = request(toks)
    assert sched.get_num_new_matched_tokens(req, 192) == (0, False)  # local hit covers them
    ids = list(range(7, 14))
    sched._kv_cache_manager.blocks[req.request_id] = ids

    # Chunked prefill: 100 tokens, then the other 100.
    meta = sched.build_connector_meta(sched_output(new=[(req, ids)],
                                                   scheduled={req.request_id: 100}))
    (save,) = meta.saves
    assert save.keys == keys[2:3] and save.block_ids == [9] and save.parent == keys[1]
    req.num_computed_tokens = 100
    meta = sched.build_connector_meta(sched_output(cached=[(req, 100)],
                                                   scheduled={req.request_id: 100}))
    (save,) = meta.saves
    assert save.keys == keys[3:6] and save.block_ids == [10, 11, 12] and save.parent == keys[2]

    # Decode: block 6 (tokens 192..223) is saved once its tokens are known and computed.
    for n in range(200, 224):
        meta = sched.build_connector_meta(sched_output(cached=[(req, n)],
                                                       scheduled={req.request_id: 1}))
        assert meta.saves == [], n
        req.append_output_token_ids(300 + n % 100)
    meta = sched.build_connector_meta(sched_output(cached=[(req, 223)],
                                                   scheduled={req.request_id: 1}))
    (save,) = meta.saves
    expected = block_keys(list(req.all_token_ids), BLOCK, sched.namespace)
    assert save.keys == [expected[6]] and save.block_ids == [13] and save.parent == keys[5]

    assert sched.request_finished(req, ids) == (False, None)


def test_a_refused_block_is_saved_again_after_recompute(sched: Any, client: Client) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    toks = tokens(200, 6)
    keys = block_keys(toks, BLOCK, sched.namespace)
    store(client, keys)
    req = request(toks)
    ids = list(range(20, 27))
    sched._kv_cache_manager.blocks[req.request_id] = ids
    assert sched.get_num_new_matched_tokens(req, 0) == (192, True)
    sched.update_state_after_alloc(req, blocks_of(ids), 192)
    sched.build_connector_meta(sched_output())
    # The worker refused block 3 (and so everything after it).
    sched.update_connector_output(KVConnectorOutput(finished_recving={req.request_id},
                                                    invalid_block_ids={23, 24, 25}))
    # vLLM recomputes from block 3: those blocks are saved again.
    req.num_computed_tokens = 96
    meta = sched.build_connector_meta(sched_output(new=[(req, ids)],
                                                   scheduled={req.request_id: 104}))
    (save,) = meta.saves
    assert save.keys == keys[3:6] and save.block_ids == [23, 24, 25]


@pytest.mark.parametrize(("role", "loads", "saves"),
                         [("kv_consumer", True, False), ("kv_producer", False, True)])
def test_roles(make_connector: Any, store_node: Any, client: Client, role: str, loads: bool,
               saves: bool) -> None:
    conn = make_connector("SCHEDULER", store_node.addr, kv_role=role,
                          namespace=f"role-{role}-{time.time_ns()}", load_inline_when_idle=False)
    conn.bind_kv_cache_manager(FakeManager())
    toks = tokens(100, 7)
    keys = block_keys(toks, BLOCK, conn.namespace)
    store(client, keys[:1])
    req = request(toks)
    assert conn.get_num_new_matched_tokens(req, 0) == ((32, True) if loads else (0, False))
    conn._kv_cache_manager.blocks[req.request_id] = [1, 2, 3, 4]
    meta = conn.build_connector_meta(sched_output(new=[(req, [1, 2, 3, 4])],
                                                  scheduled={req.request_id: 100}))
    assert [s.keys for s in meta.saves] == ([keys[1:3]] if saves else [])


def test_default_namespace_names_model_dtype_and_shape(make_connector: Any, store_node: Any,
                                                       tiny_llama: Any) -> None:
    ns = make_connector("SCHEDULER", store_node.addr).namespace
    assert ns.startswith("vllm-v1/")
    for part in (f"model={tiny_llama}", "kv_dtype=torch.float32", "layers=2", "kv_heads=2",
                 "head_size=32", "block=32", "layout=LBHNC", "device=cpu"):
        assert part in ns.split("/") or part in ns, part


def test_the_documented_server_line_parses_with_vllms_own_parser(tiny_llama: Any,
                                                                 store_node: Any) -> None:
    """The `vllm serve` configuration docs/engines/vllm.md gives, through vLLM's argument
    parser into a config the connector starts from."""
    import re
    import shlex
    from pathlib import Path

    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
    from vllm.engine.arg_utils import EngineArgs
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    page = (Path(__file__).resolve().parents[2] / "docs" / "engines" / "vllm.md").read_text()
    (line,) = re.findall(r"^vllm serve MODEL .*$", page, flags=re.M)
    argv = shlex.split(line)[3:]
    argv = [a.replace("127.0.0.1:7600", store_node.addr) for a in argv]
    parser = EngineArgs.add_cli_args(FlexibleArgumentParser())
    args = parser.parse_args(["--model", str(tiny_llama), "--skip-tokenizer-init", *argv])
    cfg = EngineArgs.from_cli_args(args).create_engine_config()
    ktc = cfg.kv_transfer_config
    assert ktc.kv_connector == "KVStoreConnector"
    assert ktc.kv_load_failure_policy == "recompute"
    assert ktc.is_kv_producer and ktc.is_kv_consumer
    assert cfg.cache_config.block_size == BLOCK
    cls = KVConnectorFactory.get_connector_class(ktc)
    # The documented module path hands on the module that moved (one module object).
    assert ktc.kv_connector_module_path == "kvstore.integrations.vllm_connector"
    assert cls.__module__ == "kvstore.integrations.vllm.connector"
