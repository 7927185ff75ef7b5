"""vLLM's KV-event wire format, reproduced (vLLM itself is never imported here).

The shapes follow ``vllm/distributed/kv_events.py`` of vLLM 0.32 field for field, so
vLLM's own ``msgspec.msgpack.Decoder(KVEventBatch)`` and every consumer written to it
(vLLM's subscribers, llm-d's KV-cache indexer, Dynamo's KV router) decode what a node
publishes:

* a batch is an *array-like* struct ``[ts, events]`` (``data_parallel_rank`` is a trailing
  default: omitted, since a node is no data-parallel rank);
* an event is a *tagged map* struct (``tag=True``: the tag field is ``"type"``, its value
  the class name), defaults omitted; ``BlockStored`` always carries ``block_hashes``,
  ``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_id``, ``medium`` and
  ``lora_name``, ``BlockRemoved`` ``block_hashes`` and ``medium``.

Over ZeroMQ a batch is one multipart message ``(topic, seq, payload)``: ``seq`` is the
batch's sequence number as 8 bytes big-endian, ``payload`` the msgpack of the batch. A
replay reply ends with ``(b"", END_SEQ, b"")``, ``END_SEQ`` being -1 as 8 signed bytes.

msgspec is imported lazily (``encoder()``): a node without ``--kv-events-endpoint``
needs neither it nor pyzmq (the ``events`` extra).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The sequence number of a replay reply's last message (vLLM's ``END_SEQ``)."""

_LOW64 = (1 << 64) - 1

SNAPSHOT_SEQ = (1 << 64) - 1
"""A replay request for this sequence number (-1 as 8 signed bytes) asks for a snapshot."""

MEDIA: dict[str, str] = {"hbm": "GPU", "dram": "CPU", "ssd": "STORAGE"}
"""kvstore tier name -> the event's ``medium`` (vLLM's MEDIUM_GPU / _CPU / _STORAGE)."""


def medium_of(tier_name: str) -> str:
    return MEDIA.get(tier_name, tier_name.upper())


class Stored(NamedTuple):
    """A block now held on ``medium`` (one ``BlockStored`` event)."""

    key: bytes
    parent: bytes | None
    medium: str


class Removed(NamedTuple):
    """A block no longer held on ``medium`` (one ``BlockRemoved`` event)."""

    key: bytes
    medium: str


class Cleared(NamedTuple):
    """Forget everything this publisher said before (``AllBlocksCleared``)."""


# Events are told apart by length (3, 2, 0), so plain tuples of the same shapes are events
# too: the publisher queues those, the cheapest thing to build under the node's lock.
Event = Stored | Removed | Cleared | tuple[bytes, bytes | None, str] | tuple[bytes, str]


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big")


def _structs() -> tuple[type, type, type, type]:
    import msgspec

    class BlockStored(msgspec.Struct, tag="BlockStored", omit_defaults=True,
                      gc=False):
        block_hashes: list[bytes | int]
        parent_block_hash: bytes | int | None
        token_ids: list[int]
        block_size: int
        lora_id: int | None
        medium: str | None
        lora_name: str | None
        extra_keys: list[tuple[Any, ...] | None] | None = None
        group_idx: int | None = None
        kv_cache_spec_kind: str | None = None
        kv_cache_spec_sliding_window: int | None = None
        locality: str | None = None
        ownership: str | None = None
        session_id: str | None = None

    class BlockRemoved(msgspec.Struct, tag="BlockRemoved", omit_defaults=True,
                       gc=False):
        block_hashes: list[bytes | int]
        medium: str | None
        group_idx: int | None = None
        locality: str | None = None
        ownership: str | None = None

    class AllBlocksCleared(msgspec.Struct, tag="AllBlocksCleared",
                           omit_defaults=True, gc=False):
        pass

    class KVEventBatch(msgspec.Struct, array_like=True, omit_defaults=True,
                       gc=False):
        ts: float
        events: list[BlockStored | BlockRemoved | AllBlocksCleared]
        data_parallel_rank: int | None = None

    return BlockStored, BlockRemoved, AllBlocksCleared, KVEventBatch


def encoder(*, int_hashes: bool = False, clock: Callable[[], float] = time.time
            ) -> Callable[[Sequence[Event]], bytes]:
    """A function from events to one batch's msgpack payload.

    ``int_hashes``: hashes as vLLM's ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES`` sends them
    (the key's big-endian integer, low 64 bits); otherwise the 16 key bytes themselves.
    """
    import msgspec

    block_stored, block_removed, all_cleared, batch = _structs()
    enc = msgspec.msgpack.Encoder()

    # Positional struct arguments and no per-event calls: this runs once per event. The
    # length is tested in the condition itself (not kept in a local) so that the type
    # checker narrows the tuple to its shape.
    def one(e: Event) -> Any:
        if len(e) == 3:
            return block_stored([e[0]], e[1], [], 0, None, e[2], None)
        if len(e) == 2:
            return block_removed([e[0]], e[1])
        return all_cleared()

    def one_int(e: Event) -> Any:
        if len(e) == 3:
            parent = None if e[1] is None else int.from_bytes(e[1], "big") & _LOW64
            return block_stored([int.from_bytes(e[0], "big") & _LOW64], parent, [], 0, None,
                                e[2], None)
        if len(e) == 2:
            return block_removed([int.from_bytes(e[0], "big") & _LOW64], e[1])
        return all_cleared()

    convert = one_int if int_hashes else one

    def encode(events: Sequence[Event]) -> bytes:
        return enc.encode(batch(clock(), [convert(e) for e in events]))

    return encode


def check_endpoint(name: str, endpoint: str) -> None:
    """Raises ValueError unless ``endpoint`` is ``tcp://HOST:PORT`` (``*`` for every
    interface, port 0 for any free one) or ``ipc://PATH``."""
    if endpoint.startswith("ipc://") and len(endpoint) > len("ipc://"):
        return
    host, _, port = endpoint.removeprefix("tcp://").rpartition(":")
    if (not endpoint.startswith("tcp://") or not host.strip("[]") or not port.isdigit()
            or int(port) > 65535):
        raise ValueError(f"{name} must be tcp://HOST:PORT (or ipc://PATH), got {endpoint!r}")
