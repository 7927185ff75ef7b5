"""Checking a put's ``retain_s`` (semantics: ``tiers.retention``): a leaf module, so the
client checks before it sends and every transport of the node checks the same way.

``retain_s`` is finite, ``>= 0`` and at most ``MAX_RETAIN_S`` (7 days: longer is an
error, not a clamp); None or 0 asks for no retention.
"""

from __future__ import annotations

import math

from kvstore.core.errors import InvalidArgument

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
