"""``kvstore.integrations.vllm.loads``: chunked loads from a real node, the next chunk's
fetch overlapping this one's checks and copies; the order, the leading-sound-blocks rule
and every refusal kept as in one batch."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
import torch

from kvstore import Client, block_keys
from kvstore.integrations.vllm.blocks import HEADER_BYTES, BlockLayout
from kvstore.integrations.vllm.loads import chunk_bounds, load_blocks

LAYOUT = BlockLayout(layer_shapes=((2, 4, 8), (2, 4, 8)), dtype=torch.float32)
"""Two layers of 256 bytes per block: a value of HEADER_BYTES + 512 bytes."""


@pytest.fixture
def fetcher() -> Iterator[ThreadPoolExecutor]:
    with ThreadPoolExecutor(1, thread_name_prefix="test-fetch") as pool:
        yield pool


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


CHUNK3 = 3 * LAYOUT.value_bytes


def test_chunk_bounds_cover_every_block_once() -> None:
    assert chunk_bounds(10, 100, 300) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    assert chunk_bounds(2, 1000, 10) == [(0, 1), (1, 2)]  # at least one block a chunk
    assert chunk_bounds(0, 100, 300) == []


def test_a_chunked_load_writes_every_block_in_order(client: Client,
                                                    fetcher: ThreadPoolExecutor) -> None:
    keys, rows = stored_rows(client, 10, "all")
    ids = list(range(20, 30))
    rec = Recorder()
    out = load_blocks(client, fetcher, LAYOUT, keys, ids, rec, chunk_bytes=CHUNK3)
    assert (out.loaded, out.missing, out.refused, out.error) == (10, 0, [], None)
    assert rec.calls == [[20, 21, 22], [23, 24, 25], [26, 27, 28], [29]]
    assert all(rec.cache[20 + i] == bytes(rows[i].numpy()) for i in range(10))


def test_the_load_stops_at_the_first_bad_block_and_reports_every_refusal(
        client: Client, fetcher: ThreadPoolExecutor) -> None:
    keys, rows = stored_rows(client, 9, "bad")
    for i in (4, 7):  # corrupt payloads: their checksums no longer match
        forged = bytearray(rows[i].numpy())
        forged[-1] ^= 0xFF
        client.remove(keys[i])  # a put never overwrites a stored block
        client.put(keys[i], bytes(forged))
    client.remove(keys[5])  # missing
    rec = Recorder()
    out = load_blocks(client, fetcher, LAYOUT, keys, list(range(9)), rec, chunk_bytes=CHUNK3)
    assert out.loaded == 4 and out.missing == 1 and out.error is None
    assert [k for k, _ in out.refused] == [keys[4], keys[7]]
    assert all("checksum" in why for _, why in out.refused)
    assert rec.calls == [[0, 1, 2], [3]]  # nothing after the first refused block


class FailingSecondFetch:
    """A client whose second ``get_batch_into`` fails; records which thread fetched."""

    def __init__(self, client: Client) -> None:
        self.client = client
        self.calls = 0
        self.threads: set[str] = set()

    def get_batch_into(self, keys: list[bytes], outs: list[Any]) -> list[int | None]:
        self.calls += 1
        self.threads.add(threading.current_thread().name)
        if self.calls == 2:
            raise ConnectionError("node went away")
        return self.client.get_batch_into(keys, outs)


def test_a_failed_fetch_keeps_what_came_before_it(client: Client,
                                                  fetcher: ThreadPoolExecutor) -> None:
    keys, _ = stored_rows(client, 7, "fail")
    flaky = FailingSecondFetch(client)
    rec = Recorder()
    out = load_blocks(flaky, fetcher, LAYOUT, keys, list(range(7)),  # type: ignore[arg-type]  # duck-typed client
                      rec, chunk_bytes=CHUNK3)
    assert out.loaded == 3 and isinstance(out.error, ConnectionError)
    assert rec.calls == [[0, 1, 2]]
    assert flaky.calls == 2  # the third chunk was never asked for
    assert all(t.startswith("test-fetch") for t in flaky.threads)  # fetches on the fetcher


def test_keys_and_block_ids_must_pair(client: Client, fetcher: ThreadPoolExecutor) -> None:
    with pytest.raises(ValueError, match="2 keys for 3 block ids"):
        load_blocks(client, fetcher, LAYOUT, [b"a" * 16, b"b" * 16], [1, 2, 3], Recorder())
