"""When KVStoreConnector's scheduler side asks for an inline load (vLLM's
``load_kv_async=False``: the worker loads in the step) and when for an asynchronous one:
with vLLM's own Request and SchedulerOutput types and a real kvstore node, no engine."""

from __future__ import annotations

import time
from typing import Any

import pytest
from vllm_fakes import FakeManager, blocks_of, request, sched_output, tokens

from kvstore import Client, block_keys

BLOCK = 32


BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4
"""conftest's KV cache: K and V x 2 layers x 32 tokens x 2 heads x 32 floats."""


def connector(make_connector: Any, store_node: Any, **extra: Any) -> Any:
    """Busy engines load asynchronously unless ``load_inline_busy_max_bytes`` says."""
    extra.setdefault("load_inline_busy_max_bytes", 0)
    conn = make_connector("SCHEDULER", store_node.addr, namespace=f"mode-{time.time_ns()}",
                          **extra)
    conn.bind_kv_cache_manager(FakeManager())
    return conn


def stored_request(conn: Any, client: Client, seed: int) -> Any:
    """A 200-token request whose 6 full blocks are stored (all 6 loadable: its last token
    is past them)."""
    toks = tokens(200, seed)
    keys = block_keys(toks, BLOCK, conn.namespace)
    client.put_batch(keys, [b"x" * 64 for _ in keys])
    return request(toks)


def allocate(conn: Any, req: Any, first_id: int) -> list[Any]:
    """vLLM's allocation after a 192-token hit; returns the loads planned so far."""
    ids = list(range(first_id, first_id + 7))
    conn._kv_cache_manager.blocks[req.request_id] = ids
    conn.update_state_after_alloc(req, blocks_of(ids), 192)
    return conn._pending_loads


def inline_then_async_in_one_pass(conn: Any, first: Any, second: Any) -> None:
    """``first`` loads inline; ``second``, planned in the same scheduler pass, overlaps
    (the step's bound would be passed); the pass's metadata carries both, in order."""
    assert conn.get_num_new_matched_tokens(first, 0) == (192, False)
    allocate(conn, first, 10)
    assert conn.get_num_new_matched_tokens(second, 0) == (192, True)
    allocate(conn, second, 20)
    meta = conn.build_connector_meta(sched_output(new=[(first, list(range(10, 17)))],
                                                  scheduled={first.request_id: 40}))
    assert [(s.req_id, s.inline) for s in meta.loads] == [(first.request_id, True),
                                                          (second.request_id, False)]


def test_an_idle_engine_loads_inline_then_a_busy_one_asynchronously(
        make_connector: Any, store_node: Any, client: Client) -> None:
    conn = connector(make_connector, store_node)
    first, second, third = (stored_request(conn, client, s) for s in (1, 2, 3))

    # Nothing runs: the first request loads in the step (vLLM allocates its blocks
    # before it looks the next waiting request up). Same scheduler pass, its load already
    # planned: the second would wait for it.
    inline_then_async_in_one_pass(conn, first, second)
    assert (conn.stats["loads_inline"], conn.stats["loads_async"]) == (1, 1)

    # The first runs and the second loads: the third overlaps its load with them.
    assert conn.get_num_new_matched_tokens(third, 0) == (192, True)


def test_the_engine_is_idle_again_once_its_requests_finished_and_loads_landed(
        make_connector: Any, store_node: Any, client: Client) -> None:
    from vllm.v1.outputs import KVConnectorOutput

    conn = connector(make_connector, store_node)
    running, loading, later = (stored_request(conn, client, s) for s in (4, 5, 6))
    conn.build_connector_meta(sched_output(new=[(running, [1])],
                                           scheduled={running.request_id: 8}))
    assert conn.get_num_new_matched_tokens(loading, 0) == (192, True)
    allocate(conn, loading, 30)
    conn.build_connector_meta(sched_output())

    conn.request_finished(running, [1])
    # Still a load in flight: the loader thread and the step would compete for no gain.
    assert conn.get_num_new_matched_tokens(later, 0) == (192, True)
    conn.update_connector_output(KVConnectorOutput(finished_recving={loading.request_id}))
    # Loaded; scheduled and run; finished: nothing left.
    conn.build_connector_meta(sched_output(new=[(loading, list(range(30, 37)))],
                                           scheduled={loading.request_id: 40}))
    conn.request_finished(loading, list(range(30, 37)))
    again = stored_request(conn, client, 7)
    assert conn.get_num_new_matched_tokens(again, 0) == (192, False)


def test_a_request_finished_before_it_ran_leaves_no_trace(make_connector: Any,
                                                          store_node: Any,
                                                          client: Client) -> None:
    """An aborted waiting request (looked up, never scheduled) does not keep the engine
    'busy' for ever; nor does one that finished with its load in flight."""
    conn = connector(make_connector, store_node)
    waiting, aborted = (stored_request(conn, client, s) for s in (8, 9))
    conn.build_connector_meta(sched_output(new=[(waiting, [1])],
                                           scheduled={waiting.request_id: 8}))
    assert conn.get_num_new_matched_tokens(aborted, 0) == (192, True)
    allocate(conn, aborted, 40)
    conn.build_connector_meta(sched_output())
    conn.request_finished(aborted, [])
    conn.request_finished(waiting, [1])
    assert conn.get_num_new_matched_tokens(stored_request(conn, client, 10), 0) == (192, False)


def test_inline_loads_can_be_turned_off(make_connector: Any, store_node: Any, client: Client
                                        ) -> None:
    conn = connector(make_connector, store_node, load_inline_when_idle=False)
    assert conn.get_num_new_matched_tokens(stored_request(conn, client, 11), 0) == (192, True)


def test_a_busy_engine_loads_inline_what_fits_in_the_step_s_bound(
        make_connector: Any, store_node: Any, client: Client) -> None:
    """Each 192-token hit is 6 blocks; the bound holds 10: the first busy load is inline,
    the second in the same pass would pass the bound and overlaps; the next pass starts
    from nothing again."""
    conn = connector(make_connector, store_node, load_inline_busy_max_bytes=10 * BLOCK_BYTES)
    running, first, second, third = (stored_request(conn, client, s) for s in (21, 22, 23, 24))
    conn.build_connector_meta(sched_output(new=[(running, [1])],
                                           scheduled={running.request_id: 8}))
    inline_then_async_in_one_pass(conn, first, second)
    assert conn.get_num_new_matched_tokens(third, 0) == (192, False)


def test_the_default_bound_is_16_mib(make_connector: Any, store_node: Any, client: Client
                                     ) -> None:
    conn = make_connector("SCHEDULER", store_node.addr, namespace=f"mode-{time.time_ns()}")
    conn.bind_kv_cache_manager(FakeManager())
    assert (conn._inline.busy_max_bytes, conn._block_bytes) == (16 << 20, BLOCK_BYTES)
    running, hit = (stored_request(conn, client, s) for s in (25, 26))
    conn.build_connector_meta(sched_output(new=[(running, [1])],
                                           scheduled={running.request_id: 8}))
    assert conn.get_num_new_matched_tokens(hit, 0) == (192, False)  # 192 KiB: inline


@pytest.mark.parametrize("bad", [-1, 1.5, "16", True, None])
def test_the_bound_takes_a_non_negative_integer_only(make_connector: Any, store_node: Any,
                                                     bad: Any) -> None:
    with pytest.raises(ValueError, match="load_inline_busy_max_bytes must be an integer"):
        connector(make_connector, store_node, load_inline_busy_max_bytes=bad)


@pytest.mark.parametrize("bad", ["false", 0, None])
def test_the_switch_takes_a_boolean_only(make_connector: Any, store_node: Any, bad: Any
                                         ) -> None:
    with pytest.raises(ValueError, match="load_inline_when_idle must be true or false"):
        connector(make_connector, store_node, load_inline_when_idle=bad)
