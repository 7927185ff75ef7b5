"""A router's side of a node's KV events: subscribe, detect gaps, recover by snapshot.

``KVEventSubscriber`` speaks the protocol of ``kvstore.node.kv_events`` (which is vLLM's):
a SUB socket for the live batches and a DEALER socket for replay requests.
``BlockLocations`` is the state a router keeps from them: which media hold each block.
``follow`` ties the two together the way a router should: apply batches in sequence
order; on a gap (a missed batch, or a node restart, which jumps the sequence) ask the
replay endpoint from the last seq + 1, which answers with the missed batches or, when it
no longer has them, with a snapshot that starts with ``AllBlocksCleared``.

A node that serves its events over CURVE (``--kv-events-secret-key``) admits only the
client keys it lists: give the subscriber its own ``.key_secret`` file (``secret_key``)
and the node's public ``.key`` file (``server_key``), files of ``kvstore.auth.curve``
(``kvstore kv-events keygen`` makes them). Without them, or with a key the node does not
list, the handshake fails and nothing arrives: ``recv`` times out, ``replay`` raises
TimeoutError.

Decoding here is schema-free (``msgspec.msgpack.decode``); consumers with vLLM installed
can decode the same payloads with ``vllm.distributed.kv_events.KVEventBatch``.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kvstore.auth.curve import load_keypair, load_public_key
from kvstore.protocol.kv_event_wire import END_SEQ, SNAPSHOT_SEQ, seq_bytes

Batch = tuple[int, bytes]  # (seq, msgpack payload)


def decode(payload: bytes) -> list[dict[str, Any]]:
    """The events of one batch payload, as maps (each with its ``"type"``)."""
    import msgspec

    _ts, events, *_ = msgspec.msgpack.decode(payload)
    return list(events)


@dataclass(slots=True, kw_only=True)
class BlockLocations:
    """Block hash -> the media holding it, from applied events; ``last_seq`` applied."""

    media: dict[bytes | int, set[str]] = field(default_factory=dict)
    last_seq: int = -1

    def apply(self, seq: int, payload: bytes) -> None:
        for e in decode(payload):
            kind = e["type"]
            if kind == "AllBlocksCleared":
                self.media.clear()
            elif kind == "BlockStored":
                for h in e["block_hashes"]:
                    self.media.setdefault(h, set()).add(e["medium"])
            elif kind == "BlockRemoved":
                for h in e["block_hashes"]:
                    held = self.media.get(h)
                    if held is not None:
                        held.discard(e["medium"])
                        if not held:
                            del self.media[h]
        self.last_seq = seq


class KVEventSubscriber:
    """Sockets to one node's KV events (``endpoint``) and replays (``replay_endpoint``)."""

    def __init__(self, endpoint: str, replay_endpoint: str = "", *, topic: bytes = b"",
                 secret_key: str = "", server_key: str = "") -> None:
        """``secret_key``/``server_key``: CURVE key files (this client's ``.key_secret``,
        the node's public ``.key``) for a node that requires them; both or neither."""
        import zmq

        if bool(secret_key) != bool(server_key):
            raise ValueError("CURVE needs both secret_key (this client's .key_secret file) "
                             "and server_key (the node's public .key file)")
        curve: list[tuple[int, bytes]] = []
        if secret_key:
            pair = load_keypair(secret_key)
            curve = [(zmq.CURVE_SERVERKEY, load_public_key(server_key)),
                     (zmq.CURVE_PUBLICKEY, pair.public), (zmq.CURVE_SECRETKEY, pair.secret)]
        self._zmq = zmq
        self._ctx = zmq.Context()
        self._sub = self._ctx.socket(zmq.SUB)
        self._sub.setsockopt(zmq.LINGER, 0)
        self._sub.setsockopt(zmq.SUBSCRIBE, topic)
        for opt, value in curve:  # before connect: a handshake uses what is set then
            self._sub.setsockopt(opt, value)
        self._sub.connect(endpoint)
        self._replay: Any = None
        if replay_endpoint:
            self._replay = self._ctx.socket(zmq.DEALER)
            self._replay.setsockopt(zmq.LINGER, 0)
            for opt, value in curve:
                self._replay.setsockopt(opt, value)
            self._replay.connect(replay_endpoint)

    def recv(self, timeout: float) -> Batch | None:
        """The next live batch, or None after ``timeout`` seconds."""
        if not self._sub.poll(int(timeout * 1000)):
            return None
        _topic, seq, payload = self._sub.recv_multipart()
        return int.from_bytes(seq, "big"), payload

    def replay(self, start_seq: int, timeout: float = 10.0) -> list[Batch]:
        """The node's answer to a replay from ``start_seq``: its buffered batches from
        there, or a one-batch snapshot; TimeoutError if it does not finish in time."""
        if self._replay is None:
            raise ValueError("no replay endpoint given")
        self._replay.send_multipart((b"", seq_bytes(start_seq)))
        out: list[Batch] = []
        while True:
            if not self._replay.poll(int(timeout * 1000)):
                raise TimeoutError(f"no replay reply in {timeout}s")
            frames = self._replay.recv_multipart()
            _empty, _topic, seq, payload = frames
            if seq == END_SEQ:
                return out
            out.append((int.from_bytes(seq, "big"), payload))

    def snapshot(self, timeout: float = 10.0) -> Batch:
        """Every block the node holds, as of the returned seq."""
        (batch,) = self.replay(SNAPSHOT_SEQ, timeout)
        return batch

    def follow(self, state: BlockLocations, timeout: float) -> Batch | None:
        """Receives one live batch into ``state``, first recovering any gap before it.

        Returns the live batch (None on timeout). A batch at or before ``state.last_seq``
        (already covered by a snapshot) is skipped."""
        got = self.recv(timeout)
        if got is None:
            return None
        seq, payload = got
        if state.last_seq < 0 or seq > state.last_seq + 1:
            for rseq, rpayload in self.replay(state.last_seq + 1):
                if rseq > state.last_seq:
                    state.apply(rseq, rpayload)
        if seq > state.last_seq:
            state.apply(seq, payload)
        return got

    def close(self) -> None:
        self._ctx.destroy(linger=0)
