"""The exceptions kvstore raises, one per failure a caller can act on.

Each carries the gRPC status code that expresses it on the wire; the server
maps exceptions to codes and the client maps codes back, each at one place.

A few errors refine one of these (``ReplyTooLarge`` is a ``ResourceExhausted``) so a
caller can act on them without reading the message. Such a class has a ``reason``,
which travels beside the code: in the gRPC call's trailing metadata under
``REASON_HEADER``, and in the transfer channel's error frame (``kvstore.protocol.wire``).
Both are additive: a peer that predates the reason ignores it and reads the code and
the message, which are unchanged; a failure that arrives without a reason (from such a
peer) maps to the code's own class.
"""

from __future__ import annotations

from typing import ClassVar

import grpc


class KVStoreError(Exception):
    """Base of every kvstore error."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    reason: ClassVar[str] = ""
    """Names a refinement of the code's class on the wire; "" for the code's own class."""


class InvalidArgument(KVStoreError, ValueError):
    """A malformed key, value or request. Retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(KVStoreError):
    """The value does not fit: larger than the tier, or everything left is pinned or being read."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


REPLY_BOUND = "bound of one reply"
"""Words every ``ReplyTooLarge`` message carries. Clients before the error's ``reason``
split a batch when they find these words; new clients go by the type."""


class ReplyTooLarge(ResourceExhausted):
    """A read whose reply would pass the node's bound on one reply (its message names
    ``REPLY_BOUND``). Fewer keys per request fit: the node clients split the batch and ask
    again, down to one key (a single block always fits)."""

    reason = "reply-too-large"


class BufferTooSmall(InvalidArgument):
    """A caller's buffer is smaller than the value read into it (``get_into``,
    ``get_batch_into``); raised by the client, never sent by a node."""


class Unavailable(KVStoreError, ConnectionError):
    """The node is draining, stopped or unreachable. Another node, or a later retry, may serve."""

    code = grpc.StatusCode.UNAVAILABLE


class Unauthenticated(KVStoreError):
    """No valid credentials: a missing or unknown bearer token, or no client certificate."""

    code = grpc.StatusCode.UNAUTHENTICATED


class PermissionDenied(KVStoreError):
    """Valid credentials that may not do this."""

    code = grpc.StatusCode.PERMISSION_DENIED


class FailedPrecondition(KVStoreError):
    """The node cannot do this in its present role (a replicated put to a node outside
    a cluster)."""

    code = grpc.StatusCode.FAILED_PRECONDITION


class InternalError(KVStoreError):
    """A bug in the node; the message says where."""

    code = grpc.StatusCode.INTERNAL


_BY_CODE: dict[grpc.StatusCode, type[KVStoreError]] = {
    cls.code: cls for cls in (InvalidArgument, ResourceExhausted, Unavailable, InternalError,
                              Unauthenticated, PermissionDenied, FailedPrecondition)
}
_BY_CODE[grpc.StatusCode.DEADLINE_EXCEEDED] = Unavailable
_BY_REASON: dict[str, type[KVStoreError]] = {cls.reason: cls for cls in (ReplyTooLarge,)}

REASON_HEADER = "x-kvstore-reason"
"""The gRPC trailing-metadata key of a failure's ``reason`` (absent for none)."""


def error_for_code(code: grpc.StatusCode, message: str, reason: str = "") -> KVStoreError:
    """The exception for a status code (and the reason beside it, if any) received from a
    node. A reason this client does not know, or one that does not refine ``code``'s class,
    is ignored: the code's own class."""
    refined = _BY_REASON.get(reason)
    if refined is not None and refined.code == code:
        return refined(message)
    return _BY_CODE.get(code, KVStoreError)(message)
