"""The cyclic garbage collector, paused while a node builds what it keeps for its life.

A restart recovers millions of index records at once (the SSD tier's records, the tier
index's entries); each allocation past the collector's threshold would run a collection,
and the full ones walk every object made so far, again and again. None of these objects
form cycles, and ``kvstore serve`` freezes them out of the collector once the node serves
(``gc.freeze``): the collections in between find nothing to free.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager

__all__ = ["collector_paused"]


@contextmanager
def collector_paused() -> Iterator[None]:
    """No automatic collection inside the scope; the collector is enabled again on the way
    out if it was enabled on the way in (process-wide: another thread's garbage waits for
    the scope's end too, it is not lost)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()
