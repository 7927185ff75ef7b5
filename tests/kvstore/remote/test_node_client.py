"""``NodeClient`` against nodes of another version: the typed errors it maps a node's
refusals to, with and without the reason a node sends beside the status code.

A node before reasons cannot be started from this tree, so ``_ReplyBoundNode`` stands in
for one: a real gRPC server that refuses every read of more than one key the way a node
refuses a read past its reply bound, with (as this tree's node) or without (as an older
node) the reason in the trailing metadata.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from concurrent import futures

import grpc
import pytest

from kvstore.core.errors import REASON_HEADER, REPLY_BOUND, ReplyTooLarge, ResourceExhausted
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.remote.node_client import NodeClient


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
