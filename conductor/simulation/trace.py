"""Typed loader of Mooncake request traces (the FAST'25 release's JSONL format).

Each line is one request::

    {"timestamp": 27482, "input_length": 6955, "output_length": 52, "hash_ids": [46, 47, ...]}

* ``timestamp``: arrival time in milliseconds, relative to the trace start;
* ``input_length`` / ``output_length``: prompt and generated tokens;
* ``hash_ids``: one id per ``BLOCK_TOKENS``-token block of the prompt, the last one
  possibly covering a partial block. Ids are prefix-closed: two requests share a
  block id only if they share the whole prefix up to and including that block.

``load_trace`` checks every field's type and sign and names the offending line
(1-based) of any malformed request in a ``TraceFormatError``. Blank lines are
skipped; other fields are ignored.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

BLOCK_TOKENS = 512
"""Tokens per block (hash id) in the Mooncake traces."""


class TraceFormatError(ValueError):
    """A trace line is not a valid request; the message names the file and line."""

    def __init__(self, path: str, lineno: int, reason: str) -> None:
        super().__init__(f"{path}:{lineno}: {reason}")
        self.path = path
        self.lineno = lineno
        self.reason = reason


@dataclass(slots=True, kw_only=True, frozen=True)
class TraceRequest:
    """One request of a trace."""

    timestamp_ms: int
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def full_blocks(self) -> int:
        """Number of full ``BLOCK_TOKENS`` blocks in the prompt (its keyed blocks).

        ``input_length // BLOCK_TOKENS``, capped at ``len(hash_ids)``; a partial
        last block has an id in the trace but would get no key in a store.
        """
        return min(self.input_length // BLOCK_TOKENS, len(self.hash_ids))


def _int_field(obj: dict[str, Any], name: str) -> int:
    if name not in obj:
        raise ValueError(f"missing field {name!r}")
    v = obj[name]
    if type(v) is not int:  # bool is an int subclass: refuse it too
        raise ValueError(f"field {name!r} must be an integer, got {v!r}")
    if v < 0:
        raise ValueError(f"field {name!r} must be >= 0, got {v}")
    return v


def parse_request(line: str) -> TraceRequest:
    """One request from one JSON line; ValueError (without a line number) if malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc.msg} (column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a request must be a JSON object, got {type(obj).__name__}")
    timestamp = _int_field(obj, "timestamp")
    input_length = _int_field(obj, "input_length")
    output_length = _int_field(obj, "output_length")
    if "hash_ids" not in obj:
        raise ValueError("missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list):
        raise ValueError(f"field 'hash_ids' must be a list, got {type(ids).__name__}")
    for i, h in enumerate(ids):
        if type(h) is not int or h < 0:
            raise ValueError(f"hash_ids[{i}] must be a non-negative integer, got {h!r}")
    return TraceRequest(timestamp_ms=timestamp, input_length=input_length,
                        output_length=output_length, hash_ids=tuple(ids))


def load_trace(path: str | os.PathLike[str]) -> list[TraceRequest]:
    """Every request of the JSONL trace at ``path``, in file order.

    Raises TraceFormatError naming the line of the first malformed request, and
    OSError if the file cannot be read.
    """
    name = os.fspath(path)
    out: list[TraceRequest] = []
    with open(name, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                out.append(parse_request(line))
            except ValueError as exc:
                raise TraceFormatError(name, lineno, str(exc)) from None
    return out
