"""``NodeClient``: the typed errors it maps a node's refusals to, with and without the
reason a node sends beside the status code; the one check every put passes; a put resent
after its answer was lost, reported stored; and a closed client's calls failing as
Unavailable (a pool closes a departed peer's client while other
threads may still call it).

A node before reasons cannot be started from this tree, so ``_ReplyBoundNode`` stands in
for one: a real gRPC server that refuses every read of more than one key the way a node
refuses a read past its reply bound, with (as this tree's node) or without (as an older
node) the reason in the trailing metadata.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from typing import Any, get_type_hints

import grpc
import pytest
from conftest import NodeProcess, lose_first_answer

from kvstore.core.errors import (
    REASON_HEADER,
    REPLY_BOUND,
    BufferTooSmall,
    InvalidArgument,
    ReplyTooLarge,
    ResourceExhausted,
    Unavailable,
)
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol.wire import Op
from kvstore.remote.node_client import NodeClient, PutBatch


class _ReplyBoundNode(pb_grpc.KVStoreServicer):
    """Answers a BatchGet of one key (value: the key); refuses more as past its bound."""

    def __init__(self, *, sends_reason: bool) -> None:
        self.sends_reason = sends_reason
        self.asked: list[int] = []  # keys per BatchGet, in order
        self._lock = threading.Lock()

    def BatchGet(self, request: pb.BatchGetRequest, context: grpc.ServicerContext
                 ) -> pb.BatchGetResponse:
        with self._lock:
            self.asked.append(len(request.keys))
        if len(request.keys) > 1:
            if self.sends_reason:
                context.set_trailing_metadata(((REASON_HEADER, ReplyTooLarge.reason),))
            context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                          f"BatchGet reply would be too many bytes, over the {REPLY_BOUND}: "
                          f"ask for fewer keys per request")
        return pb.BatchGetResponse(items=[pb.GetResponse(found=True, value=k)
                                          for k in request.keys])


@pytest.fixture(params=[True, False], ids=["this-node", "node-before-reasons"])
def stand_in(request: pytest.FixtureRequest) -> Iterator[tuple[_ReplyBoundNode, str]]:
    servicer = _ReplyBoundNode(sends_reason=request.param)
    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    pb_grpc.add_KVStoreServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        server.stop(grace=None)


def test_a_refusal_with_the_reason_is_split_and_one_without_is_raised_as_sent(
        stand_in: tuple[_ReplyBoundNode, str]) -> None:
    servicer, addr = stand_in
    keys = [bytes([i]) * 16 for i in range(4)]
    with NodeClient(addr, transport="grpc", timeout=10) as c:
        if servicer.sends_reason:
            assert c.get_batch(keys) == keys  # asked again in halves, down to one key
            assert servicer.asked == [4, 2, 1, 1, 2, 1, 1]
            return
        # Without the reason the refusal is the code's own class, as sent: the client
        # does not read the message to guess (it is not split).
        with pytest.raises(ResourceExhausted, match=REPLY_BOUND) as err:
            c.get_batch(keys)
        assert type(err.value) is ResourceExhausted
        assert servicer.asked == [4]


# ---- every put is checked, once ------------------------------------------------------------

NOWHERE = "127.0.0.1:1"  # nothing listens: a put that reached the network would be Unavailable
GOOD_KEY = b"k" * 16
MALFORMED: dict[str, tuple[list[Any], list[Any], dict[str, Any]]] = {
    "short key": ([b"k" * 15], [b"v"], {}),
    "more values than keys": ([GOOD_KEY], [b"v", b"w"], {}),
    "more parents than keys": ([GOOD_KEY], [b"v"], {"parents": [None, None]}),
    "malformed parent": ([GOOD_KEY], [b"v"], {"parents": [b"p"]}),
    "value not bytes-like": ([GOOD_KEY], [object()], {}),
    "negative retention": ([GOOD_KEY], [b"v"], {"retain_s": -1.0}),
}
"""Arguments of a batch put that ``PutBatch.check`` refuses."""


def _node_puts(c: NodeClient) -> dict[str, Callable[[list[Any], list[Any], dict[str, Any]],
                                                     object]]:
    """Every put of ``NodeClient`` that takes raw arguments, as one batch call."""
    def one(keys: list[Any], values: list[Any], kw: dict[str, Any]) -> object:
        parents = kw.get("parents")
        return c.put(keys[0], values[0], parent=None if parents is None else parents[0],
                     retain_s=kw.get("retain_s"))

    return {
        "put": one,
        "put_batch": lambda keys, values, kw: c.put_batch(keys, values, **kw),
        "put_batch_replicated": lambda keys, values, kw: c.put_batch_replicated(
            keys, values, copies=2, write_quorum=1, **kw),
    }


CHECKED_PUTS = {"put_checked", "put_checked_replicated"}
"""Puts that take a ``PutBatch``: checked by construction."""


def test_every_put_of_the_node_client_is_known_here() -> None:
    # A new put joins _node_puts (and is then tested below) or CHECKED_PUTS (its batch
    # parameter is a PutBatch): no put path is left out of the check.
    puts = {n for n in dir(NodeClient) if n.startswith("put") and callable(getattr(NodeClient, n))}
    with NodeClient(NOWHERE, transport="tcp", timeout=1) as c:
        assert puts == set(_node_puts(c)) | CHECKED_PUTS
    for name in CHECKED_PUTS:
        assert get_type_hints(getattr(NodeClient, name))["batch"] is PutBatch


ONE_ITEM = {"put"}  # one key, value and parent by signature: no count to get wrong


@pytest.mark.parametrize("call, case", [
    (call, case) for call in ("put", "put_batch", "put_batch_replicated")
    for case in sorted(MALFORMED) if call not in ONE_ITEM or "than keys" not in case])
def test_every_put_checks_before_it_connects(call: str, case: str) -> None:
    keys, values, kw = MALFORMED[case]
    with NodeClient(NOWHERE, transport="tcp", timeout=1) as c, pytest.raises(InvalidArgument):
        _node_puts(c)[call](keys, values, kw)


def test_a_checked_batch_keeps_what_was_checked() -> None:
    batch = PutBatch.check([b"a" * 16, b"b" * 16, b"c" * 16], [b"1", bytearray(b"22"), b"333"],
                           parents=[None, b"a" * 16, b""], pin=True, retain_s=2.5)
    assert (batch.pin, batch.retain_s, len(batch)) == (True, 2.5, 3)
    assert batch.parents == [None, b"a" * 16, None]
    part = batch.pick([2, 0])
    assert part.keys == [b"c" * 16, b"a" * 16]
    assert [bytes(v) for v in part.values] == [b"333", b"1"]
    assert part.parents == [None, None] and (part.pin, part.retain_s) == (True, 2.5)


@pytest.mark.parametrize("transport", ["grpc", "auto"])
def test_calls_on_a_closed_client_are_unavailable(node: NodeProcess, transport: str) -> None:
    c = NodeClient(node.addr, transport=transport)
    assert c.put(b"\x07" * 16, b"v")
    c.close()
    with pytest.raises(Unavailable):
        c.exists([b"\x07" * 16])  # gRPC: ValueError from the closed channel before
    with pytest.raises(Unavailable):
        c.get(b"\x07" * 16)
    with pytest.raises(Unavailable):
        c.remove(b"\x07" * 16)



def test_a_put_whose_answer_was_lost_is_resent_and_reported_stored(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The node stores the batch, then the stream resets before the client reads the
    answer: the client resends on a new connection, the node finds every key stored, and
    the keys still count as stored by this put (its first try stored them)."""
    lost = lose_first_answer(monkeypatch, Op.PUT)
    keys = [bytes([0x5A, i]) * 8 for i in range(5)]
    values = [bytes([i]) * 100 for i in range(5)]
    c = NodeClient(node.addr, transport="tcp")
    try:
        assert c.put_batch(keys, values) == [True] * 5
        assert lost == [5]  # the first answer was lost: the flags are the resend's
        assert c.put_batch(keys, values) == [False] * 5  # not resent: stored already
        assert c.get_batch(keys) == values
    finally:
        c.close()


def test_a_single_put_whose_answer_was_lost_is_resent_and_reported_stored(
        node: NodeProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """``put`` of one key, on its own path: the same resend and the same answer."""
    lost = lose_first_answer(monkeypatch, Op.PUT)
    with NodeClient(node.addr, transport="tcp") as c:
        assert c.put(b"\x5b" * 16, b"one") and lost == [1]
        assert not c.put(b"\x5b" * 16, b"one")  # not resent: stored already
        assert c.get(b"\x5b" * 16) == b"one"


@pytest.mark.parametrize("transport", ["tcp", "auto", "grpc"])
def test_one_key_calls_answer_as_the_batch_of_one(node: NodeProcess, transport: str) -> None:
    """``put``, ``get`` and ``get_into`` of one key take a path of their own on the transfer
    channel: the same answers and the same errors as the batch calls of one key, and the
    connection stays usable after a refusal."""
    key, absent, value = b"\x11" * 16, b"\x12" * 16, bytes(range(256)) * 40
    with NodeClient(node.addr, transport=transport) as c:
        assert c.put(key, value, parent=absent, retain_s=5.0)
        assert not c.put(key, value) and c.put_batch([key], [value]) == [False]
        for bad in ({"value": "text"}, {"parent": b"short"}, {"retain_s": -1.0}):
            args: dict[str, object] = {"value": value, **bad}
            with pytest.raises(InvalidArgument):
                c.put(absent, **args)  # type: ignore[arg-type]
            with pytest.raises(InvalidArgument):
                c.put_batch([absent], [args["value"]],
                            parents=[args.get("parent")],  # type: ignore[list-item]
                            retain_s=args.get("retain_s"))  # type: ignore[arg-type]
        assert c.exists([absent]) == [False]
        for k in (key, absent):
            assert c.get(k) == c.get_batch([k])[0]
            buf, batch_buf = bytearray(len(value) + 5), bytearray(len(value) + 5)
            assert c.get_into(k, buf) == c.get_batch_into([k], [batch_buf])[0]
            assert buf == batch_buf
        assert c.get(key) == value and c.get(absent) is None
        # The node answers a GET of one key on a path of its own: as one of a batch.
        assert c.get_batch([absent, key, key]) == [None, value, value]
        with pytest.raises(BufferTooSmall):
            c.get_into(key, bytearray(len(value) - 1))
        with pytest.raises(InvalidArgument):
            c.get(b"short")
        with pytest.raises(InvalidArgument):
            c.get_into(key, bytes(len(value)))  # read-only
        out = memoryview(bytearray(len(value)))
        assert c.get_into(key, out) == len(value) and out == value  # still in step
