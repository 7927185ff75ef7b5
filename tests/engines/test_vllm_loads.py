"""``kvstore.integrations.vllm.loads``: loads from a real node; the leading-sound-blocks
rule, every refusal reported, a failed fetch writing nothing."""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

import pytest
import torch

from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, BlockLayout
from kvstore.integrations.vllm.loads import Staging, load_blocks

LAYOUT = BlockLayout(layer_shapes=((2, 4, 8), (2, 4, 8)), dtype=torch.float32)
"""Two layers of 256 bytes per block: a value of HEADER_BYTES + 512 bytes."""


def stored_rows(client: Client, n: int, tag: str) -> tuple[list[bytes], torch.Tensor]:
    """``n`` sealed blocks put under fresh keys; their rows."""
    keys: list[bytes] = list(block_keys(list(range(n * 4)), 4, f"loads-{tag}-{time.time_ns()}"))
    rows = LAYOUT.new_staging(n)
    rows[:, HEADER_BYTES:] = torch.randint(0, 255, (n, LAYOUT.value_bytes - HEADER_BYTES),
                                           dtype=torch.uint8)
    LAYOUT.seal(rows, keys)
    client.put_batch(keys, [bytes(rows[i].numpy()) for i in range(n)])
    return keys, rows


class Recorder:
    """A scatter that writes into a dict of block id -> row, recording each call."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []
        self.cache: dict[int, bytes] = {}

    def __call__(self, rows: torch.Tensor, ids: Sequence[int]) -> None:
        self.calls.append(list(ids))
        for r, i in zip(rows, ids, strict=True):
            self.cache[i] = bytes(r.numpy())


def test_a_load_writes_every_block_once_in_order(client: Client) -> None:
    keys, rows = stored_rows(client, 10, "all")
    ids = list(range(20, 30))
    rec = Recorder()
    out = load_blocks(client, LAYOUT, keys, ids, rec, Staging())
    assert (out.loaded, out.missing, out.refused, out.error) == (10, 0, [], None)
    assert rec.calls == [ids]
    assert all(rec.cache[20 + i] == bytes(rows[i].numpy()) for i in range(10))


def test_the_load_stops_at_the_first_bad_block_and_reports_every_refusal(
        client: Client) -> None:
    keys, rows = stored_rows(client, 9, "bad")
    for i in (4, 7):  # corrupt payloads: their checksums no longer match
        forged = bytearray(rows[i].numpy())
        forged[-1] ^= 0xFF
        client.remove(keys[i])  # a put never overwrites a stored block
        client.put(keys[i], bytes(forged))
    client.remove(keys[5])  # missing
    rec = Recorder()
    out = load_blocks(client, LAYOUT, keys, list(range(9)), rec, Staging())
    assert out.loaded == 4 and out.missing == 1 and out.error is None
    assert [k for k, _ in out.refused] == [keys[4], keys[7]]
    assert all("checksum" in why for _, why in out.refused)
    assert rec.calls == [[0, 1, 2, 3]]  # nothing after the first refused block


class FailingFetch:
    def get_batch_into(self, keys: list[bytes], outs: list[Any]) -> list[int | None]:
        raise ConnectionError("node went away")


def test_a_failed_fetch_writes_nothing(client: Client) -> None:
    keys, _ = stored_rows(client, 3, "fail")
    rec = Recorder()
    out = load_blocks(FailingFetch(), LAYOUT, keys, [0, 1, 2],  # type: ignore[arg-type]  # duck-typed client
                      rec, Staging())
    assert out.loaded == 0 and isinstance(out.error, ConnectionError)
    assert rec.calls == []


def test_keys_and_block_ids_must_pair(client: Client) -> None:
    with pytest.raises(ValueError, match="2 keys for 3 block ids"):
        load_blocks(client, LAYOUT, [b"a" * 16, b"b" * 16], [1, 2, 3], Recorder(), Staging())
    assert load_blocks(client, LAYOUT, [], [], Recorder(), Staging()).loaded == 0


def test_staging_rows_are_reused_and_grown() -> None:
    st = Staging()
    a = st.rows(LAYOUT, 3)
    assert a.shape == (3, LAYOUT.value_bytes)
    b = st.rows(LAYOUT, 2)
    assert b.data_ptr() == a.data_ptr()  # the same memory, no new allocation
    c = st.rows(LAYOUT, 5)
    assert c.shape == (5, LAYOUT.value_bytes)
    assert st.rows(LAYOUT, 5).data_ptr() == c.data_ptr()
