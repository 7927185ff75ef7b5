"""Byte sizes as operators write them: ``64KiB``, ``1.5GiB``, ``4096``."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
    "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(text: str | int) -> int:
    """Bytes from ``text``: binary KiB/MiB/GiB/TiB (or K/M/G/T), decimal KB/MB/GB/TB.

    Raises ValueError with the accepted forms for anything else.
    """
    if isinstance(text, bool):
        raise ValueError(f"not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise ValueError(f"size must be >= 0, got {text}")
        return text
    m = _SIZE.match(text)
    unit = m.group(2).lower() if m else None
    if m is None or unit not in _UNITS:
        raise ValueError(f"not a size: {text!r} (use e.g. 4096, 64KiB, 512MiB, 1GiB)")
    value = float(m.group(1)) * _UNITS[unit]
    if value != int(value):
        raise ValueError(f"size must be a whole number of bytes: {text!r}")
    return int(value)


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps a value >= 1."""
    for unit, scale in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"
