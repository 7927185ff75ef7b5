"""Names shared by the SSD tier's modules: the alignment, the errors and the location types.

They live here, below :mod:`tiers.ssd.io`, :mod:`tiers.ssd.index` and :mod:`tiers.ssd.tier`, so
each of those can import them without a cycle; :mod:`tiers.ssd.tier` re-exports all of them.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.errors import TierError

ALIGNMENT = 4096
"""Offset, length and buffer alignment of every O_DIRECT transfer."""


class SsdError(TierError):
    """Base of SSD-tier errors."""


class SsdFormatError(SsdError, ValueError):
    """The index or data file does not match what this tier was opened with."""


class UringUnavailableError(SsdError, RuntimeError):
    """``io="uring"`` was requested but the native io_uring backend cannot run here."""


class NotRecoveredError(SsdError, RuntimeError):
    """The index holds blocks but :meth:`SsdTier.recover` has not run: allocating could
    overwrite them."""


@dataclass(frozen=True, slots=True, kw_only=True)
class SsdLocation:
    """Where one block lives: ``nbytes`` of value at the start of ``extent``."""

    extent: Extent
    nbytes: int
    checksum: int  # xxh3_64 of the value bytes


@dataclass(frozen=True, slots=True, kw_only=True)
class SsdRecord:
    """One index entry, as :meth:`SsdTier.recover` returns it."""

    key: BlockKey
    parent: BlockKey | None
    location: SsdLocation
