"""kvstore.protocol.kv_event_wire: vLLM's KV-event shapes without vLLM (decoded schema-free here;
tests/engines/test_vllm_kv_events.py decodes them with vLLM's own classes)."""

from __future__ import annotations

import msgspec
import pytest

from kvstore.protocol.kv_event_wire import (
    END_SEQ,
    SNAPSHOT_SEQ,
    Cleared,
    Removed,
    Stored,
    check_endpoint,
    encoder,
    medium_of,
    seq_bytes,
)

K1, K2 = bytes(range(16)), bytes(range(16, 32))


def test_batch_shape_is_vllms() -> None:
    payload = encoder(clock=lambda: 12.5)(
        [Cleared(), Stored(key=K2, parent=K1, medium="CPU"), Removed(key=K1, medium="GPU")])
    assert msgspec.msgpack.decode(payload) == [12.5, [
        {"type": "AllBlocksCleared"},
        {"type": "BlockStored", "block_hashes": [K2], "parent_block_hash": K1,
         "token_ids": [], "block_size": 0, "lora_id": None, "medium": "CPU",
         "lora_name": None},
        {"type": "BlockRemoved", "block_hashes": [K1], "medium": "GPU"},
    ], None]


def test_int_hashes_are_the_low_64_bits_big_endian() -> None:
    payload = encoder(int_hashes=True, clock=lambda: 0.0)(
        [Stored(key=K2, parent=K1, medium="CPU"), Removed(key=K1, medium="CPU")])
    _ts, (stored, removed), _ = msgspec.msgpack.decode(payload)
    assert stored["block_hashes"] == [0x18191A1B1C1D1E1F]
    assert stored["parent_block_hash"] == 0x08090A0B0C0D0E0F
    assert removed["block_hashes"] == [0x08090A0B0C0D0E0F]


def test_sequence_framing() -> None:
    assert seq_bytes(1) == b"\x00" * 7 + b"\x01"
    assert END_SEQ == b"\xff" * 8
    assert seq_bytes(SNAPSHOT_SEQ) == END_SEQ  # -1 as 8 bytes asks for a snapshot


def test_media() -> None:
    assert [medium_of(t) for t in ("hbm", "dram", "ssd", "nvme")] == [
        "GPU", "CPU", "STORAGE", "NVME"]


@pytest.mark.parametrize("ok", ["tcp://127.0.0.1:5557", "tcp://*:0", "tcp://[::1]:5557",
                                "ipc:///tmp/kv-events"])
def test_endpoints_accepted(ok: str) -> None:
    check_endpoint("kv_events_endpoint", ok)


@pytest.mark.parametrize("bad", ["", "127.0.0.1:5557", "tcp://127.0.0.1", "tcp://:5557",
                                 "tcp://host:port", "tcp://host:70000", "udp://h:1", "ipc://"])
def test_endpoints_refused(bad: str) -> None:
    with pytest.raises(ValueError, match=r"^kv_events_endpoint must be tcp://HOST:PORT"):
        check_endpoint("kv_events_endpoint", bad)
