"""Prefix-hash keys: pinned vectors, the prefix property, and input validation."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any, cast

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvstore.core import keys
from kvstore.core.keys import (
    KEY_BYTES,
    block_keys,
    encode_token_ids,
    ensure_key,
    leading_run,
    namespace_root_key,
    parse_key,
)

VECTORS = json.loads((Path(__file__).parents[2] / "vectors" / "block_keys.json").read_text())


@pytest.mark.parametrize("case", VECTORS["cases"],
                         ids=lambda c: f"{c['namespace']}-{c['block_tokens']}")
def test_vectors_pin_exact_bytes(case: dict) -> None:
    keys = block_keys(case["token_ids"], case["block_tokens"], case["namespace"],
                      extra=bytes.fromhex(case["extra_hex"]))
    assert [k.hex() for k in keys] == case["keys_hex"]


def test_root_key_vector() -> None:
    assert namespace_root_key("llama3-8b/bf16/tp0").hex() == VECTORS["root_llama3-8b/bf16/tp0"]


def test_partial_last_block_gets_no_key() -> None:
    assert len(block_keys(list(range(9)), 4, "ns")) == 2
    assert block_keys(list(range(3)), 4, "ns") == []
    assert block_keys(list(range(8)), 4, "ns") == block_keys(list(range(11)), 4, "ns")


def test_same_across_processes() -> None:
    code = ("from kvstore.core.keys import block_keys;"
            "print(','.join(k.hex() for k in block_keys(list(range(64)), 16, 'x')))")
    outs = {
        subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                       env={"PYTHONHASHSEED": seed, "PATH": ""}, cwd=Path(__file__).parents[3]
                       ).stdout.strip()
        for seed in ("1", "2")
    }
    assert outs == {",".join(k.hex() for k in block_keys(list(range(64)), 16, "x"))}


def test_accepts_numpy_and_lists_alike() -> None:
    toks = list(range(1000, 1064))
    assert block_keys(np.array(toks, dtype=np.int64), 16, "a") == block_keys(toks, 16, "a")
    assert block_keys(np.array(toks, dtype=np.uint32), 16, "a") == block_keys(toks, 16, "a")


tokens = st.lists(st.integers(0, 2**32 - 1), max_size=80)


@given(prefix=tokens, a=tokens, b=tokens, block=st.integers(1, 8))
def test_shared_full_blocks_share_keys(prefix: list[int], a: list[int], b: list[int],
                                       block: int) -> None:
    ka = block_keys(prefix + a, block, "ns")
    kb = block_keys(prefix + b, block, "ns")
    shared = len(prefix) // block
    assert ka[:shared] == kb[:shared]
    # Beyond the common token prefix keys match exactly when the blocks' tokens do.
    seq_a, seq_b = prefix + a, prefix + b
    for i in range(shared, min(len(ka), len(kb))):
        same_tokens = seq_a[: (i + 1) * block] == seq_b[: (i + 1) * block]
        assert (ka[i] == kb[i]) == same_tokens
    assert all(len(k) == KEY_BYTES for k in ka)


@given(toks=tokens.filter(lambda t: len(t) >= 4))
def test_namespace_and_extra_separate_chains(toks: list[int]) -> None:
    base = block_keys(toks, 4, "model-a")
    assert set(base).isdisjoint(block_keys(toks, 4, "model-b"))
    assert set(base).isdisjoint(block_keys(toks, 4, "model-a", extra=b"lora-1"))


@pytest.mark.parametrize("bad", [[-1], [2**32], [1.5], [[1, 2]]])
def test_rejects_token_ids_outside_u32(bad: list) -> None:
    with pytest.raises(ValueError):
        encode_token_ids(bad)


def test_rejects_nonpositive_block_tokens() -> None:
    with pytest.raises(ValueError, match="block_tokens"):
        block_keys([1, 2], 0, "ns")


def test_leading_run_counts_up_to_the_first_miss_and_reads_no_further() -> None:
    assert leading_run([]) == 0
    assert leading_run([True, True, False, True]) == 2
    assert leading_run([1, b"x", None, 1]) == 2
    assert leading_run([True] * 5) == 5
    seen: list[int] = []

    def held(i: int) -> bool:
        seen.append(i)
        return i != 3

    assert leading_run(held(i) for i in range(10)) == 3
    assert seen == [0, 1, 2, 3]  # lazily: nothing past the first miss is asked


def test_parse_key_round_trip_and_errors() -> None:
    key = block_keys([1, 2, 3, 4], 4, "ns")[0]
    assert parse_key(key.hex()) == key
    assert parse_key(key.hex().upper()) == key
    with pytest.raises(ValueError, match="hex"):
        parse_key("zz" * 16)
    with pytest.raises(ValueError, match="16 bytes"):
        parse_key("ab" * 15)
    with pytest.raises(ValueError, match="16 bytes"):
        ensure_key(b"x" * 17)


# ---- keys derived from other data (tenant salt, worker layer/tail, Mooncake names) ----------

DERIVED = json.loads((Path(__file__).parents[2] / "vectors" / "derived_keys.json").read_text())


@pytest.mark.parametrize("case", DERIVED["salt_key"], ids=lambda c: c["tenant"])
def test_salt_key_vectors(case: dict) -> None:
    got = keys.salt_key(case["tenant"], bytes.fromhex(case["key_hex"]))
    assert got.hex() == case["stored_hex"]


@pytest.mark.parametrize("case", DERIVED["layer_key"], ids=lambda c: str(c["layer"]))
def test_layer_key_vectors(case: dict) -> None:
    got = keys.layer_key(bytes.fromhex(case["key_hex"]), case["layer"])
    assert got.hex() == case["stored_hex"]


@pytest.mark.parametrize("case", DERIVED["tail_key"], ids=lambda c: c["request_id"])
def test_tail_key_vectors(case: dict) -> None:
    got = keys.tail_key(case["namespace"], case["request_id"], case["token_ids"])
    assert got.hex() == case["stored_hex"]


@pytest.mark.parametrize("case", DERIVED["mooncake_key"], ids=lambda c: c["key"][:20])
def test_mooncake_key_vectors(case: dict) -> None:
    assert keys.mooncake_key(case["key"]).hex() == case["stored_hex"]
    assert keys.mooncake_key(case["key"].encode()).hex() == case["stored_hex"]


@pytest.mark.parametrize("case", DERIVED["shard_key"], ids=lambda c: c["shard"])
def test_shard_key_vectors(case: dict) -> None:
    got = keys.shard_key(bytes.fromhex(case["key_hex"]), case["shard"])
    assert got.hex() == case["stored_hex"]


def test_callers_name_the_one_derivation() -> None:
    """The modules that use a derivation hand on kvstore.core.keys' function, never a copy."""
    from kvstore.auth import security, tenancy
    from kvstore.integrations.mooncake import store as mooncake_compat
    from kvstore.integrations.mooncake import types as mooncake_types

    assert security.salt_key is tenancy.salt_key is keys.salt_key
    assert mooncake_types.mooncake_key is mooncake_compat.mooncake_key is keys.mooncake_key
    assert mooncake_types.KEY_DOMAIN == b"kvstore-mooncake-v1\x00"
    assert security.TENANT_DOMAIN == b"kvstore-tenant-v1\x00"


def test_mooncake_key_refuses_other_types() -> None:
    with pytest.raises(TypeError, match="a Mooncake key is a str"):
        keys.mooncake_key(cast(Any, 3))


def test_derived_keys_are_block_keys_in_their_own_domains() -> None:
    k = bytes.fromhex(DERIVED["layer_key"][0]["key_hex"])
    derived = {keys.salt_key("ns", k), keys.layer_key(k, 0), keys.mooncake_key("ns"),
               keys.tail_key("ns", "r", []), namespace_root_key("ns"),
               keys.shard_key(k, "ns")}
    assert len(derived) == 6 and all(len(d) == KEY_BYTES for d in derived)
