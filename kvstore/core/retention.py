"""Checking a put's ``retain_s`` (semantics: ``tiers.retention``) and a ``retain`` call on
blocks already stored: a leaf module, so the client checks before it sends and every
transport of the node checks the same way.

``retain_s`` is finite, ``>= 0`` and at most ``MAX_RETAIN_S`` (7 days: longer is an
error, not a clamp); None or 0 asks for no retention.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from enum import StrEnum

from kvstore.core.checks import check_key
from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey

MAX_RETAIN_S = 7 * 24 * 3600.0
"""Longest retention one put may ask for, in seconds (a week)."""


def check_retain_s(retain_s: float | None) -> float:
    """``retain_s`` as a float (None: 0.0, no retention); ValueError with the reason."""
    if retain_s is None:
        return 0.0
    if isinstance(retain_s, bool) or not isinstance(retain_s, (int, float)):
        raise ValueError(f"retain_s must be a number of seconds, got {retain_s!r}")
    s = float(retain_s)
    if not math.isfinite(s) or s < 0:
        raise ValueError(f"retain_s must be finite and >= 0, got {retain_s!r}")
    if s > MAX_RETAIN_S:
        raise ValueError(f"retain_s {retain_s!r} is over the limit of {MAX_RETAIN_S:.0f} s "
                         f"(7 days)")
    return s


def retain_seconds(retain_s: float | None) -> float:
    """``check_retain_s``, with INVALID_ARGUMENT (the node's and the client's error)."""
    try:
        return check_retain_s(retain_s)
    except ValueError as exc:
        raise InvalidArgument(str(exc)) from None


MAX_RETAIN_KEYS = 4096
"""Most keys one ``retain`` call may name (as a prefetch: a session's context of 4096
blocks of 256 tokens is a million tokens). More is INVALID_ARGUMENT, from the client before
it sends and from the node, never split into several calls."""


class RetainOutcome(StrEnum):
    """What a ``retain`` call did with one key stored before it (docs/node.md, "Retaining
    stored blocks"). A ``str``: ``outcome == "retained"`` holds, and JSON writes the value."""

    RETAINED = "retained"
    """(``retain_s > 0``) Retained until at least ``retain_s`` from now, refreshed by reads as
    a put's retention is; a deadline already further away is kept."""
    DENIED = "denied"
    """(``retain_s > 0``) Stored, but retaining it would pass the node's cap
    (``--max-retained-fraction``) or the tenant's share of its quota: left ordinary."""
    RELEASED = "released"
    """(``retain_s == 0``) Stored, and ordinary now: its retention (if any) ended, and it
    leaves by the eviction policy like any other block."""
    MISSING = "missing"
    """Not stored on this node (never put, evicted, or another tenant's)."""


_RANK = (RetainOutcome.RETAINED, RetainOutcome.DENIED, RetainOutcome.RELEASED,
         RetainOutcome.MISSING)


def merged_outcome(outcomes: Sequence[RetainOutcome]) -> RetainOutcome:
    """One key's outcome over the copies asked (the cluster client asks every holder): the
    first of retained, denied, released, missing that any copy answered; none: missing."""
    return min(outcomes, key=_RANK.index, default=RetainOutcome.MISSING)


def check_retain(keys: Sequence[object], retain_s: float | None) -> tuple[list[BlockKey], float]:
    """The checked keys and seconds (0.0: release); InvalidArgument for a malformed key,
    more than ``MAX_RETAIN_KEYS`` keys, or a ``retain_s`` ``check_retain_s`` refuses (None is
    refused too: a release names 0 on purpose)."""
    if len(keys) > MAX_RETAIN_KEYS:
        raise InvalidArgument(f"at most {MAX_RETAIN_KEYS} keys per retain, got {len(keys)}")
    if retain_s is None:
        raise InvalidArgument("retain_s must be a number of seconds (0 releases), got None")
    return [check_key(k) for k in keys], retain_seconds(retain_s)
