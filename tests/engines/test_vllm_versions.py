"""The connector under the installed vLLM (0.32 in make test-vllm, 0.33 in make
test-vllm033): it is listed, an unlisted version is refused by name at import, and the
parts of the connector API that 0.33 added or uses differently behave."""

from __future__ import annotations

import importlib.util
import time
from typing import Any

import pytest
from vllm_fakes import FakeManager, request_id, tokens

from kvstore import Client, block_keys
from kvstore.integrations.vllm.versions import (
    SUPPORTED,
    UnsupportedVLLMVersion,
    minor_of,
)

BLOCK = 32


def test_the_installed_vllm_is_listed() -> None:
    import vllm

    from kvstore.integrations.vllm import connector

    assert minor_of(vllm.__version__) in [e.minor for e in SUPPORTED]
    assert connector.VLLM_VERSION.minor == minor_of(vllm.__version__)


def test_an_unlisted_vllm_is_refused_at_import(monkeypatch: pytest.MonkeyPatch) -> None:
    """The connector module run afresh under a vLLM that says it is 0.34.0."""
    import vllm

    from kvstore.integrations.vllm import connector

    monkeypatch.setattr(vllm, "__version__", "0.34.0")
    spec = importlib.util.spec_from_file_location("kvstore_connector_under_034",
                                                  connector.__file__)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    with pytest.raises(UnsupportedVLLMVersion, match=r"found vLLM 0\.34\.0"):
        spec.loader.exec_module(module)


def test_sleep_mode_is_refused(make_connector: Any, store_node: Any) -> None:
    """vLLM 0.33 asks the connector class before it allows enable_sleep_mode (0.32 never
    asks; its CPU platform has no sleep mode at all)."""
    from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory

    conn = make_connector("SCHEDULER", store_node.addr)
    ktc = conn._vllm_config.kv_transfer_config
    cls = KVConnectorFactory.get_connector_class(ktc)
    assert cls.supports_sleep_mode(ktc) is False


def test_a_load_whose_allocation_is_reported_steps_later(make_connector: Any,
                                                         store_node: Any) -> None:
    """vLLM 0.33 may defer ``update_state_after_alloc`` of an asynchronous load to a later
    step (``defer_async_loads``): the steps in between hand the worker nothing for the
    request, and the load, once reported, names the blocks the lookup offered."""
    from vllm import SamplingParams
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.kv_cache_utils import KVCacheBlock
    from vllm.v1.core.sched.output import CachedRequestData, SchedulerOutput
    from vllm.v1.request import Request

    conn = make_connector("SCHEDULER", store_node.addr, namespace=f"defer-{time.time_ns()}",
                          load_inline_when_idle=False)
    conn.bind_kv_cache_manager(FakeManager())
    toks = tokens(200, 31)
    keys = block_keys(toks, BLOCK, conn.namespace)
    with Client(store_node.addr) as c:
        c.put_batch(keys, [b"x" * 64 for _ in keys])
    req = Request(request_id(), toks, SamplingParams(max_tokens=8), None)

    def empty_step() -> Any:
        return SchedulerOutput(
            scheduled_new_reqs=[], scheduled_cached_reqs=CachedRequestData.make_empty(),
            num_scheduled_tokens={}, total_num_scheduled_tokens=0,
            scheduled_spec_decode_tokens={}, scheduled_encoder_inputs={},
            finished_req_ids=set(), free_encoder_mm_hashes=[])

    assert conn.get_num_new_matched_tokens(req, 32) == (160, True)
    # Asked again in a later step (vLLM retries a request it could not schedule): the
    # same answer, nothing handed to the worker twice.
    assert conn.get_num_new_matched_tokens(req, 32) == (160, True)
    for _ in range(2):
        meta = conn.build_connector_meta(empty_step())
        assert meta.loads == [] and meta.saves == []
    blocks = KVCacheBlocks(([KVCacheBlock(block_id=i) for i in range(70, 77)],))
    conn.update_state_after_alloc(req, blocks, 160)
    (load,) = conn.build_connector_meta(empty_step()).loads
    assert load.keys == [bytes(k) for k in keys[1:6]]
    assert load.block_ids == [71, 72, 73, 74, 75]
    assert conn.build_connector_meta(empty_step()).loads == []
