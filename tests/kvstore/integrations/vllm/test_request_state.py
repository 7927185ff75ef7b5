"""A request's keys hashed block by block as it grows equal the prefix-hash spec's, and
the router's stored-block count read from its ``kv_transfer_params`` (no vLLM needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from kvstore import block_keys
from kvstore.core.keys import namespace_root_key
from kvstore.integrations.vllm.request_state import RequestState, request_stored_blocks

BLOCK = 4


@dataclass
class FakeRequest:
    """What the connector reads of vLLM's Request."""

    all_token_ids: list[int]
    kv_transfer_params: Any = None
    request_id: str = "r"


def test_keys_grow_block_by_block_and_equal_block_keys_in_every_group() -> None:
    namespaces = ["ns", "ns/kv-group=1:sliding_window"]
    roots = [namespace_root_key(n) for n in namespaces]
    req = FakeRequest(list(range(3, 13)))  # 10 tokens: 2 full blocks
    st = RequestState(request=req, extra=b"salt=t")
    assert st.keys_upto(2, 0, roots=roots, block_size=BLOCK) == block_keys(
        req.all_token_ids, BLOCK, "ns", extra=b"salt=t")
    first = list(st.keys[1])
    req.all_token_ids += list(range(100, 111))  # 21 tokens: 5 full blocks
    assert st.keys_upto(3, 1, roots=roots, block_size=BLOCK) == block_keys(
        req.all_token_ids, BLOCK, namespaces[1], extra=b"salt=t")[:3]
    assert st.keys[1][:2] == first  # extended, not recomputed differently
    for g, ns in enumerate(namespaces):
        assert st.keys_upto(5, g, roots=roots, block_size=BLOCK) == block_keys(
            req.all_token_ids, BLOCK, ns, extra=b"salt=t")
    # Fewer than held: a prefix, nothing hashed.
    assert st.keys_upto(1, 0, roots=roots, block_size=BLOCK) == st.keys[0][:1]


@pytest.mark.parametrize(("params", "expected"), [
    ({"kvstore_stored_blocks": 3}, 3), ({"kvstore_stored_blocks": 0}, 0),
    ({"kvstore_stored_blocks": -1}, None), ({"kvstore_stored_blocks": "3"}, None),
    ({"kvstore_stored_blocks": 2.0}, None), ({"kvstore_stored_blocks": True}, None),
    ({"other": 1}, None), (None, None), ("not an object", None)])
def test_a_routers_stored_block_count(params: Any, expected: int | None) -> None:
    assert request_stored_blocks(FakeRequest([], kv_transfer_params=params)) == expected
