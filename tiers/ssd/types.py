"""Names shared by the SSD tier's modules: the alignment, the errors and the location types.

They live here, below :mod:`tiers.ssd.io`, :mod:`tiers.ssd.index` and :mod:`tiers.ssd.tier`, so
each of those can import them without a cycle; :mod:`tiers.ssd.tier` re-exports all of them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.errors import TierError
from tiers.retention import Retention

__all__ = ["ALIGNMENT", "HEADER_BYTES", "NotRecoveredError", "RebuildReport", "Retention",
           "SsdError", "SsdFormatError", "SsdIndexDamagedError", "SsdLocation", "SsdRecord",
           "UringUnavailableError"]

ALIGNMENT = 4096
"""Offset, length and buffer alignment of every O_DIRECT transfer."""

HEADER_BYTES = ALIGNMENT
"""The header page a block of format 2 carries before its value (:mod:`tiers.ssd.header`)."""


class SsdError(TierError):
    """Base of SSD-tier errors."""


class SsdFormatError(SsdError, ValueError):
    """The index or data file does not match what this tier was opened with."""


class SsdIndexDamagedError(SsdFormatError):
    """The index cannot be read, or it lost writes it had acknowledged: its blocks may
    still be intact on the data region, and only a scan (a rebuild) can find them."""


class UringUnavailableError(SsdError, RuntimeError):
    """``io="uring"`` was requested but the native io_uring backend cannot run here."""


class NotRecoveredError(SsdError, RuntimeError):
    """The index holds blocks but :meth:`SsdTier.recover` has not run: allocating could
    overwrite them."""


class SsdLocation(NamedTuple):
    """Where one block lives: ``nbytes`` of value at the start of ``extent``.

    A named tuple, not a frozen dataclass: a restart makes one per block (millions), and a
    tuple is built in a third of the time. Immutable all the same."""

    extent: Extent
    nbytes: int
    checksum: int  # xxh3_64 of the value bytes
    header: int = 0  # bytes of block header before the value (0: a block of format 1)

    @property
    def value_offset(self) -> int:
        """Where the value starts in the data region."""
        return self.extent.offset + self.header


class SsdRecord(NamedTuple):
    """One index entry, as :meth:`SsdTier.recover` returns it (a named tuple, as
    ``SsdLocation``: one per block at a restart)."""

    key: BlockKey
    parent: BlockKey | None
    location: SsdLocation
    retention: Retention | None = None
    seq: int = 0  # the write's sequence number (0: written before format 2)


@dataclass(frozen=True, slots=True, kw_only=True)
class RebuildReport:
    """What rebuilding a damaged index from the data region found."""

    reason: str  # what was wrong with the index
    rebuilt: int  # blocks found intact (header and checksum) and indexed again
    dropped: int  # blocks found torn, corrupt or superseded by a newer copy: not served
    unverified: int  # pages shaped like a header that fail its MAC (another key, or forged)
    scanned_bytes: int
    kept_at: str | None  # where the damaged index was moved (None: there was none)
