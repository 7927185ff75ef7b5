"""A node's memory dumps on demand, for finding where its heap grows (off by default).

With ``KVSTORE_TRACEMALLOC_DIR`` set in its environment, ``kvstore serve`` starts tracing
its allocations (``tracemalloc``, ``KVSTORE_TRACEMALLOC_FRAMES`` frames each, default 16)
once its modules are imported, before it builds the node (``PYTHONTRACEMALLOC`` traces the
imports too, which takes minutes on a loaded machine), and answers SIGUSR2 by writing, into
that folder, ``<pid>-<n>.tracemalloc`` (``tracemalloc.take_snapshot()``, read back with
``tracemalloc.Snapshot.load``) and ``<pid>-<n>.json`` (the live objects the garbage
collector tracks, counted by type name, and the traced bytes). ``n`` counts the dumps of
that process from 0. The signal is handled in the main thread, so a dump is written within
the main loop's tick (0.5 s) of the signal. Only Python's allocations are traced: memory
that C libraries (gRPC's core) allocate themselves is not in the snapshots.
``benchmarks/soak.py --tracemalloc`` dumps node-1 this way and compares the dumps.
"""

from __future__ import annotations

import collections
import gc
import json
import os
import signal
import tracemalloc
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

ENV = "KVSTORE_TRACEMALLOC_DIR"
FRAMES_ENV = "KVSTORE_TRACEMALLOC_FRAMES"
DEFAULT_FRAMES = 16
SIGNAL = signal.SIGUSR2


class MemoryDumper:
    """Writes dump ``n`` of this process into ``directory`` each time it is called."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory
        self.count = 0

    def dump(self) -> Path:
        """Writes the next dump; returns the path of its JSON part (written last, so a
        reader that sees it sees the whole dump)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        stem = self.directory / f"{os.getpid()}-{self.count}"
        self.count += 1
        traced = tracemalloc.is_tracing()
        if traced:
            tracemalloc.take_snapshot().dump(str(stem.with_suffix(".tracemalloc")))
        types = collections.Counter(type(o).__name__ for o in gc.get_objects())
        current, peak = tracemalloc.get_traced_memory() if traced else (0, 0)
        out = stem.with_suffix(".json")
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "tracing": traced,
                                   "traced_bytes": current, "traced_peak_bytes": peak,
                                   "gc_objects": dict(types.most_common())}))
        tmp.replace(out)
        return out


def install_from_env(environ: Mapping[str, str] | None = None) -> MemoryDumper | None:
    """When ``KVSTORE_TRACEMALLOC_DIR`` is set: starts tracing (unless it is on already)
    and installs the SIGUSR2 handler (call from the main thread); returns the dumper, or
    None when the variable is unset or empty. ValueError for frames that are not a
    positive integer."""
    env = os.environ if environ is None else environ
    where = env.get(ENV, "")
    if not where:
        return None
    text = env.get(FRAMES_ENV, "") or str(DEFAULT_FRAMES)
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{FRAMES_ENV} must be a positive integer, got {text!r}")
    if not tracemalloc.is_tracing():
        tracemalloc.start(int(text))
    dumper = MemoryDumper(Path(where))

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        dumper.dump()

    signal.signal(SIGNAL, on_signal)
    return dumper
