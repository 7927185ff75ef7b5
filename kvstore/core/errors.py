"""The exceptions kvstore raises, one per failure a caller can act on.

Each carries the gRPC status code that expresses it on the wire; the server
maps exceptions to codes and the client maps codes back, each at one place.
"""

from __future__ import annotations

import grpc


class KVStoreError(Exception):
    """Base of every kvstore error."""

    code: grpc.StatusCode = grpc.StatusCode.INTERNAL


class InvalidArgument(KVStoreError, ValueError):
    """A malformed key, value or request. Retrying it unchanged fails again."""

    code = grpc.StatusCode.INVALID_ARGUMENT


class ResourceExhausted(KVStoreError):
    """The value does not fit: larger than the tier, or everything left is pinned or being read."""

    code = grpc.StatusCode.RESOURCE_EXHAUSTED


REPLY_BOUND = "bound of one reply"
"""Words every refusal of a too-large read carries: clients split the batch and retry."""


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


def error_for_code(code: grpc.StatusCode, message: str) -> KVStoreError:
    """The exception for a status code received from a node."""
    return _BY_CODE.get(code, KVStoreError)(message)
