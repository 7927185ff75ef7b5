"""vLLM's own KV-event classes decoding what a real ``kvstore serve`` node publishes.

The node's frames are read with plain ZeroMQ sockets as vLLM's subscribers read vLLM's
publisher (SUB for ``(topic, seq, payload)``; a replay request of 8 big-endian bytes on
DEALER or REQ), and every payload is decoded with
``msgspec.msgpack.Decoder(vllm.distributed.kv_events.KVEventBatch)``, then re-encoded
with vLLM's encoder, which must give back the node's bytes exactly: the wire shapes are
vLLM's, not merely decodable. Includes a restart of a node with an SSD tier.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import msgspec
import zmq
from main_conftest import main
from vllm.distributed.kv_events import (
    MEDIUM_CPU,
    MEDIUM_STORAGE,
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)

from kvstore import Client

BLOCK = 256 << 10
END_SEQ = (-1).to_bytes(8, "big", signed=True)
DECODER = msgspec.msgpack.Decoder(KVEventBatch)
ENCODER = msgspec.msgpack.Encoder()


def key(i: int) -> bytes:
    return bytes([i]) * 16


def vllm_batch(payload: bytes) -> KVEventBatch:
    batch = DECODER.decode(payload)
    assert ENCODER.encode(batch) == payload  # byte for byte vLLM's own encoding
    return batch


def stored(i: int, medium: str, parent: int | None = None) -> BlockStored:
    return BlockStored(block_hashes=[key(i)], parent_block_hash=None if parent is None
                       else key(parent), token_ids=[], block_size=0, lora_id=None,
                       medium=medium, lora_name=None)


def removed(i: int, medium: str) -> BlockRemoved:
    return BlockRemoved(block_hashes=[key(i)], medium=medium)


class Replay:
    """A DEALER on the node's replay endpoint (vLLM's ROUTER protocol)."""

    def __init__(self, ctx: Any, endpoint: str) -> None:
        self.sock = ctx.socket(zmq.DEALER)
        self.sock.connect(endpoint)

    def ask(self, start: int) -> list[tuple[int, KVEventBatch]]:
        self.sock.send_multipart((b"", start.to_bytes(8, "big")))
        out = []
        while True:
            assert self.sock.poll(10_000), "no replay reply"
            empty, topic, seq, payload = self.sock.recv_multipart()
            assert (empty, topic) == (b"", b"")
            if seq == END_SEQ:
                assert payload == b""
                return out
            out.append((int.from_bytes(seq, "big"), vllm_batch(payload)))


def events_from(replay: Replay, first: int, n: int) -> list[Any]:
    got: list[Any] = []

    def enough() -> bool:
        nonlocal got
        batches = replay.ask(first)
        assert [s for s, _ in batches] == list(range(first, first + len(batches)))
        got = [e for _, b in batches for e in b.events]
        return len(got) >= n

    main.wait_until(enough, what=f"{n} KV events")
    return got


def test_vllm_decodes_a_node_across_a_restart(tmp_path: Path) -> None:
    pub_port, replay_port = main.free_port(), main.free_port()
    pub_ep, replay_ep = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{replay_port}"
    args = ("--ssd-path", str(tmp_path / "kv.img"), "--ssd-bytes", "8MiB", "--ssd-io", "python",
            "--kv-events-endpoint", pub_ep, "--kv-events-replay-endpoint", replay_ep)
    ctx = zmq.Context()
    node = main.start_node(tmp_path, *args, dram="1MiB")
    try:
        sub = ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        sub.connect(pub_ep)
        replay = Replay(ctx, replay_ep)
        # A snapshot request (-1) answers one batch: as of the start batch, nothing stored.
        ((base, snap),) = replay.ask((1 << 64) - 1)
        assert snap.events == [AllBlocksCleared()] and snap.data_parallel_rank is None
        with Client(node.addr, transport="grpc") as c:
            assert c.put(key(1), b"a" * BLOCK)
            assert c.put(key(2), b"b" * BLOCK, parent=key(1))
            assert c.remove(key(2))
            assert c.put(key(3), b"c" * BLOCK)
            assert c.put(key(4), b"d" * BLOCK)
            assert c.put(key(5), b"e" * BLOCK)  # past the high watermark: 1 moves to SSD
        events = events_from(replay, base, 9)
        assert events[:6] == [AllBlocksCleared(), stored(1, MEDIUM_CPU),
                              stored(2, MEDIUM_CPU, parent=1), removed(2, MEDIUM_CPU),
                              stored(3, MEDIUM_CPU), stored(4, MEDIUM_CPU)]
        move = [stored(1, MEDIUM_STORAGE), removed(1, MEDIUM_CPU)]
        s5 = stored(5, MEDIUM_CPU)
        assert events[6:] in ([*move, s5], [s5, *move])  # the mover runs beside the put
        # The live stream: (topic, 8-byte big-endian seq, payload), vLLM's PUB frames.
        assert sub.poll(10_000)
        topic, seq, payload = sub.recv_multipart()
        assert topic == b"" and len(seq) == 8
        assert base <= int.from_bytes(seq, "big") < base + 10
        vllm_batch(payload)
        assert node.stop() == 0, node.output()

        node = main.start_node(tmp_path, *args, dram="1MiB")
        assert "1 blocks recovered" in node.output()
        # vLLM's example subscriber asks with a REQ socket from its last seq + 1: the new
        # process has no such batch, so the answer is a snapshot of what it recovered.
        req = ctx.socket(zmq.REQ)
        req.connect(replay_ep)
        req.send((base + 10).to_bytes(8, "big"))
        assert req.poll(10_000)
        topic, seq, payload = req.recv_multipart()
        new_base = int.from_bytes(seq, "big")
        assert new_base > base + 10  # the restart is a jump in the sequence
        assert vllm_batch(payload).events == [AllBlocksCleared(), stored(1, MEDIUM_STORAGE)]
        # The first batch of the new process says the same (from its replay buffer).
        (only,) = Replay(ctx, replay_ep).ask(new_base)
        assert only[0] == new_base
        assert only[1].events == [AllBlocksCleared(), stored(1, MEDIUM_STORAGE)]
    finally:
        ctx.destroy(linger=0)
        code = node.stop()
    assert code == 0, node.output()


def test_media_are_vllms() -> None:
    from vllm.distributed.kv_events import MEDIUM_GPU

    from kvstore.protocol.kv_event_wire import MEDIA

    assert MEDIA == {"hbm": MEDIUM_GPU, "dram": MEDIUM_CPU, "ssd": MEDIUM_STORAGE}


def test_int_hashes_decode_as_vllms_int_form() -> None:
    """``int_hashes``: what vLLM sends with VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=1 (its
    ``maybe_convert_block_hash``: the hash bytes big-endian, low 64 bits)."""
    from kvstore.kv_event_subscriber import KVEventSubscriber
    from kvstore.node.kv_events import KVEventPublisher, KVEventSettings
    from kvstore.node.semantics import Node, NodeSettings

    node = Node(NodeSettings(dram_bytes=1 << 20, prefault=False))
    pub = KVEventPublisher(node, KVEventSettings(endpoint="tcp://127.0.0.1:0",
                                                 replay_endpoint="tcp://127.0.0.1:0",
                                                 int_hashes=True))
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        assert pub.ready.wait(10.0)
        node.put(key(1), memoryview(b"a" * 100))
        node.put(key(2), memoryview(b"b" * 100), parent=key(1))
        _seq, payload = sub.snapshot()
        as_int = [int.from_bytes(key(i), "big") & ((1 << 64) - 1) for i in (1, 2)]
        assert vllm_batch(payload).events == [
            AllBlocksCleared(),
            BlockStored(block_hashes=[as_int[0]], parent_block_hash=None, token_ids=[],
                        block_size=0, lora_id=None, medium=MEDIUM_CPU, lora_name=None),
            BlockStored(block_hashes=[as_int[1]], parent_block_hash=as_int[0], token_ids=[],
                        block_size=0, lora_id=None, medium=MEDIUM_CPU, lora_name=None)]
    finally:
        sub.close()
        pub.close()
        node.close()
