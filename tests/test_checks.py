"""kvstore.checks: the transports' key checks apply keys.ensure_key's one rule."""

from __future__ import annotations

from array import array

import pytest

from kvstore.checks import check_key, check_keys, check_parent
from kvstore.errors import InvalidArgument
from kvstore.keys import ensure_key


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
