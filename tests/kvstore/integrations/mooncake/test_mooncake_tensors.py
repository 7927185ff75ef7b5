"""Mooncake's tensor object format (``mooncake_tensors``), byte for byte, and the tensor
methods' refusals on a real node (the wheel reads the same bytes: tests/engines)."""

from __future__ import annotations

import struct
from collections.abc import Iterator

import pytest
import torch
from conftest import start_node

from kvstore.integrations.mooncake.store import INVALID_PARAMS, OK, MooncakeDistributedStore
from kvstore.integrations.mooncake.tensors import META_BYTES, pack_header, parse_header


def test_header_layout() -> None:
    head = pack_header("bfloat16", [2, 3], 12)
    assert META_BYTES == len(head) == 304
    assert struct.unpack_from("<IHHiiIIQQ", head) == (0x4D4F4F4E, 1, 304, 12, 2, 0, 0, 304, 12)
    dims = (2, 3, -1, -1, -1, -1, -1, -1)
    assert struct.unpack_from("<8q", head, 40) == dims == struct.unpack_from("<8q", head, 104)
    assert head[168:] == bytes(136)  # axis count, reserved, four unused axes
    assert parse_header(head + bytes(12)) == ("bfloat16", (2, 3), 304, 12)


@pytest.mark.parametrize("bad", [
    b"", bytes(303), pack_header("float32", [1], 4),  # payload missing
    b"X" + pack_header("float32", [1], 4)[1:] + bytes(4),  # magic
])
def test_parse_refuses(bad: bytes) -> None:
    assert parse_header(bad) is None


def test_pack_refuses() -> None:
    with pytest.raises(ValueError, match="complex64 has no Mooncake tensor code"):
        pack_header("complex64", [1], 8)
    with pytest.raises(ValueError, match="9 dimensions; Mooncake tensors have at most 8"):
        pack_header("float32", [1] * 9, 4)


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[MooncakeDistributedStore]:
    node = start_node(tmp_path_factory.mktemp("mc-tensors"))
    s = MooncakeDistributedStore()
    assert s.setup("h", "", 0, 0, "tcp", "", node.addr) == OK
    yield s
    s.close()
    node.stop()


def test_round_trips_and_refusals(store: MooncakeDistributedStore) -> None:
    t = torch.randn(2, 3, 4).to(torch.float16)
    assert store.put_tensor("t/a", t) == OK
    back = store.get_tensor("t/a")
    assert back.dtype == torch.float16 and torch.equal(back, t)
    assert store.put_tensor("t/list", [1, 2]) == INVALID_PARAMS
    assert store.put_tensor("t/complex", torch.zeros(2, dtype=torch.complex64)) == INVALID_PARAMS
    assert store.put_tensor("t/9d", torch.zeros([1] * 9)) == INVALID_PARAMS
    assert store.batch_put_tensor(["t/x"], [t, t]) == [INVALID_PARAMS]
    assert store.batch_get_tensor_into(["t/a"], [1], [1, 2]) == [None]
    assert store.get_tensor_into("t/a", 12345, 10) is None  # not registered
    empty = torch.zeros(0, 5)
    assert store.put_tensor("t/empty", empty) == OK
    assert store.get_tensor("t/empty").shape == (0, 5)
