"""kvstore.core.checks: the transports' key checks apply keys.ensure_key's one rule; values of
any type become memoryviews in one place."""

from __future__ import annotations

from array import array

import pytest

from kvstore.core.checks import buffer_view, byte_view, check_key, check_keys, check_parent
from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import ensure_key


def test_check_key_refuses_what_ensure_key_refuses_as_invalid_argument() -> None:
    cases = [(b"x" * 15, "15"), (bytearray(17), "17"), ("x" * 16, "str"), (None, "NoneType")]
    for bad, got in cases:
        with pytest.raises(ValueError) as plain:
            ensure_key(bad)
        assert type(plain.value) is ValueError
        assert str(plain.value) == f"a block key must be 16 bytes, got {got}"
        with pytest.raises(InvalidArgument) as wire:
            check_key(bad)
        assert str(wire.value) == f"key must be 16 bytes, got {got}"


def test_a_key_is_sixteen_bytes_not_sixteen_items() -> None:
    words = memoryview(array("I", range(16)))  # 16 items, 64 bytes
    with pytest.raises(InvalidArgument, match="got 64"):
        check_key(words)
    four = memoryview(array("I", range(4)))  # 4 items, 16 bytes
    assert check_key(four) == bytes(four) == ensure_key(four)


def test_parent_and_batch_checks_use_the_same_rule() -> None:
    assert check_parent(None) is None and check_parent(b"") is None
    with pytest.raises(InvalidArgument, match=r"^parent key must be 16 bytes, got 3$"):
        check_parent(b"abc")
    assert check_keys([b"k" * 16, bytearray(b"j" * 16)]) == [b"k" * 16, b"j" * 16]


def test_byte_view_flattens_any_buffer_to_bytes_sharing_its_memory() -> None:
    words = array("I", [1, 0x01020304])
    view = byte_view(words)
    assert (view.format, view.itemsize, view.nbytes, view.readonly) == ("B", 1, 8, False)
    view[0] = 7
    assert words[0] == 7  # a view, not a copy
    assert bytes(byte_view(memoryview(b"ab\x00"))) == b"ab\x00"
    assert buffer_view(words).format == "I"  # buffer_view keeps the format


def test_a_non_buffer_or_a_non_contiguous_buffer_is_a_type_error() -> None:
    for bad in (None, "text", 5, [1, 2]):
        with pytest.raises(TypeError):
            buffer_view(bad)
        with pytest.raises(TypeError):
            byte_view(bad)
    strided = memoryview(bytearray(range(8)))[::2]
    assert buffer_view(strided).nbytes == 4  # a view, whatever its layout
    with pytest.raises(TypeError, match="C-contiguous"):
        byte_view(strided)
