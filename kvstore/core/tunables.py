"""Argument checks shared by tunables across layers (the cluster's rates, half-lives, weights)."""

from __future__ import annotations

import math


def positive_finite(name: str, value: float) -> float:
    """``value`` as a float if it is a real number (not a bool), finite and > 0; else
    ValueError naming ``name``."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value) or value <= 0:
        raise ValueError(f"{name} must be finite and > 0, got {value!r}")
    return float(value)
