"""Which tier index runs: the pure-Python one or the native one (issue #24).

The index is the TierManager's block table (``tiers.block_table``) and the allocators'
live tables (``tiers.live_table``). ``KVSTORE_NATIVE_INDEX=1`` selects the native one
wherever a caller does not name a kind, ``0`` the Python one; unset, ``DEFAULT_INDEX``,
except for a node planned for ``AUTO_NATIVE_BLOCKS`` blocks or more, which names the
native one itself (``for_planned_blocks``).
Without the built extension (``python -m cffi_build.block_index_build``) an unnamed
request falls back to the Python index; a caller that names ``"native"`` gets
``IndexUnavailable``.
"""

from __future__ import annotations

import importlib
import os

from tiers.errors import TierError
from tiers.index_budget import INDEX_KINDS, IndexKind

ENV = "KVSTORE_NATIVE_INDEX"
MODULE = "tiers._block_index"
DEFAULT_INDEX: IndexKind = "python"
"""The index a TierManager runs when neither its caller nor ``KVSTORE_NATIVE_INDEX`` says."""


AUTO_NATIVE_BLOCKS = 1_000_000
"""From this many blocks planned (a node's tiers at full occupancy in its ``--block-bytes``)
a node runs the native index when nobody named one and it is built: there the Python
index's full collections pause every request for 0.2 s (1 million blocks) to 2 s (10
million), and its objects take about 2.7 times the native index's memory
(``benchmarks/RESULTS.md``, "The tier index at 1, 10 and 50 million blocks"). Below it
the Python index, cheaper per operation, stays the default."""


class IndexUnavailable(TierError):
    """The native index was asked for by name and its extension is not built."""


def requested_kind() -> IndexKind | None:
    """What ``KVSTORE_NATIVE_INDEX`` asks for (None: unset or empty)."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return None
    if value in ("1", "native"):
        return "native"
    if value in ("0", "python"):
        return "python"
    raise ValueError(f"{ENV} must be 1 (native) or 0 (python), got {value!r}")


def native_available() -> bool:
    try:
        importlib.import_module(MODULE)
    except ImportError:
        return False
    return True


def resolve(kind: str | None) -> IndexKind:
    """The index to run for a caller that names ``kind`` (None: the environment's)."""
    if kind is not None and kind not in INDEX_KINDS:
        raise ValueError(f"index must be one of {', '.join(INDEX_KINDS)}, got {kind!r}")
    named: IndexKind | None = "native" if kind == "native" else "python" if kind else None
    chosen = named or requested_kind() or DEFAULT_INDEX
    if chosen == "native" and not native_available():
        if kind is not None:
            raise IndexUnavailable("the native tier index is not built "
                                   "(python -m cffi_build.block_index_build)")
        return "python"
    return chosen


def for_planned_blocks(blocks: int) -> IndexKind:
    """The index for a node planned to hold ``blocks`` blocks: what ``KVSTORE_NATIVE_INDEX``
    asks when set (as ``resolve``), else the native one from ``AUTO_NATIVE_BLOCKS`` on
    where it is built, else ``DEFAULT_INDEX``."""
    if requested_kind() is not None:
        return resolve(None)
    if blocks >= AUTO_NATIVE_BLOCKS and native_available():
        return "native"
    return DEFAULT_INDEX
