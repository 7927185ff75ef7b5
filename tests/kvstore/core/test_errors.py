"""The error classes and the one mapping from a status code (and its reason) back to them."""

from __future__ import annotations

import grpc
import pytest

from kvstore.core.errors import (
    REPLY_BOUND,
    BufferTooSmall,
    FailedPrecondition,
    InvalidArgument,
    ReplyTooLarge,
    ResourceExhausted,
    error_for_code,
)


def test_refinements_are_caught_where_their_base_is() -> None:
    # What callers caught before the refinements existed still catches them.
    assert issubclass(ReplyTooLarge, ResourceExhausted)
    assert ReplyTooLarge.code is grpc.StatusCode.RESOURCE_EXHAUSTED
    assert issubclass(BufferTooSmall, InvalidArgument) and issubclass(BufferTooSmall, ValueError)
    assert BufferTooSmall.code is grpc.StatusCode.INVALID_ARGUMENT
    # Pinned: the reason is on the wire (gRPC trailing metadata).
    assert ReplyTooLarge.reason == "reply-too-large"
    assert ResourceExhausted.reason == InvalidArgument.reason == BufferTooSmall.reason == ""


def test_a_reason_beside_its_code_is_the_refined_class() -> None:
    err = error_for_code(grpc.StatusCode.RESOURCE_EXHAUSTED, "why", "reply-too-large")
    assert type(err) is ReplyTooLarge and str(err) == "why"


@pytest.mark.parametrize("code, reason, cls", [
    # A node before reasons: its message names the bound, but no reason came with it.
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "", ResourceExhausted),
    # A reason from a newer node that this client does not know.
    (grpc.StatusCode.RESOURCE_EXHAUSTED, "something-newer", ResourceExhausted),
    # A reason that does not refine the code's class is ignored.
    (grpc.StatusCode.FAILED_PRECONDITION, "reply-too-large", FailedPrecondition),
])
def test_without_a_known_matching_reason_the_code_decides(code: grpc.StatusCode, reason: str,
                                                          cls: type) -> None:
    err = error_for_code(code, f"over the {REPLY_BOUND}", reason)
    assert type(err) is cls
