"""The bytes of inbound gRPC requests a node holds at once (``--max-request-bytes``).

Every gRPC call's message is charged, at its wire size, from the moment its handler
has it until the handler returns (``RequestBudget.hold``, a context manager: the charge
ends however the call ends). A message that would take the total past the limit is
refused with RESOURCE_EXHAUSTED at once, before it is decoded (decoding would copy it)
or stored, and its bytes are dropped.

What the budget cannot count, and what bounds it instead (docs/security.md, "Bounded
inbound requests"): gRPC reads a unary call's message before any handler code runs, in
the handler thread (``--grpc-workers`` of them), so at most that many messages are
being received at a moment, each at most the server's largest message
(``max_message_bytes``: 512 MiB, or the budget if that is smaller, refused by gRPC on its
length prefix, before its body is read). A call waiting for a handler thread holds only
its HTTP/2 stream window, because the server turns off gRPC's bandwidth-delay probing
(which would widen every stream's window until whole messages sit in the transport).
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

from kvstore.core.errors import ResourceExhausted
from kvstore.core.sizes import format_size
from kvstore.protocol.grpc_options import MAX_MESSAGE_BYTES

MIN_REQUEST_BYTES = 64 << 20
"""The smallest budget: the Python client sends gRPC batches of at most 32 MiB of values
(``kvstore.remote.node_client``), and one must always fit with room for another."""
MAX_DEFAULT_REQUEST_BYTES = 1 << 30


def default_request_bytes(dram_bytes: int) -> int:
    """The budget of a node whose DRAM tier holds ``dram_bytes``: a quarter of it, from
    64 MiB to 1 GiB (requests are staged in memory beside the tier, so a node's request
    memory grows with the node, and a small node is not promised gigabytes of it)."""
    return min(MAX_DEFAULT_REQUEST_BYTES, max(MIN_REQUEST_BYTES, dram_bytes // 4))


def max_message_bytes(limit: int) -> int:
    """The largest gRPC message the server receives under a budget of ``limit`` bytes: one
    larger could never be held, so gRPC refuses it on its length prefix."""
    return min(MAX_MESSAGE_BYTES, limit)


class RequestBudget:
    """Counts the request bytes held by gRPC handlers against ``limit``; thread-safe."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"the request budget must be positive, got {limit}")
        self.limit = limit
        self._lock = threading.Lock()
        # guarded by _lock:
        self._held = 0
        self._refused = 0

    @contextmanager
    def hold(self, nbytes: int, what: str) -> Iterator[None]:
        """Holds ``nbytes`` of the budget for the scope; ResourceExhausted (nothing held)
        if they do not fit beside what the other requests hold."""
        with self._lock:
            held = self._held
            if held + nbytes > self.limit:
                self._refused += 1
            else:
                self._held = held + nbytes
        if held + nbytes > self.limit:
            raise ResourceExhausted(
                f"{what} request of {nbytes} bytes ({format_size(nbytes)}) refused: gRPC "
                f"requests being processed here hold {held} bytes, and this one would pass "
                f"the node's {self.limit}-byte ({format_size(self.limit)}) "
                f"--max-request-bytes; retry later, or put through the transfer channel "
                f"(which streams values into the tier without holding them)")
        try:
            yield
        finally:
            with self._lock:
                self._held -= nbytes

    @property
    def held(self) -> int:
        with self._lock:
            return self._held

    def stats(self) -> dict[str, object]:
        """The node-section items of ``Stats`` (and the metrics read from them)."""
        with self._lock:
            return {"request_bytes_held": self._held, "request_bytes_limit": self.limit,
                    "requests_refused_for_memory": self._refused}
