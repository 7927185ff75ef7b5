"""A node's memory dumps on demand, for finding where its heap grows (off by default).

With ``KVSTORE_TRACEMALLOC_DIR`` set in its environment, ``kvstore serve`` starts tracing
its allocations (``tracemalloc``, ``KVSTORE_TRACEMALLOC_FRAMES`` frames each, default 16;
0: no tracing) once its modules are imported, before it builds the node
(``PYTHONTRACEMALLOC`` traces the imports too, which takes minutes on a loaded machine),
and answers SIGUSR2 by writing, into that folder, ``<pid>-<n>.tracemalloc``
(``tracemalloc.take_snapshot()``, read back with ``tracemalloc.Snapshot.load``; only while
tracing) and ``<pid>-<n>.json``: the live objects the garbage collector tracks, counted by
type name; the traced bytes; Python's object allocator's arenas and the bytes in use in
them, from ``sys._debugmallocstats``, which reports nothing while tracemalloc traces (it
wraps that allocator) and reports to file descriptor 2, briefly pointed at a file, so a
log line written in that moment lands there; and glibc's heap, ``mallinfo2``: bytes in
use and free in its arenas; and the process's RssAnon. If the folder holds a file named
``trim`` when a dump is asked for, the node then calls glibc's ``malloc_trim(0)`` (which
hands free heap pages back to the system) and adds its RssAnon after it: what the trim
gave back was free memory the allocator held, not live objects. ``n`` counts the dumps of
that process from 0. The signal is handled in the main thread, so a dump is written within
the main loop's tick (0.5 s) of the signal. Only Python's allocations are traced: memory
that C libraries (gRPC's core) allocate themselves shows in glibc's heap, not in the
snapshots.
``benchmarks/soak.py --tracemalloc`` dumps node-1 this way and compares the dumps.
"""

from __future__ import annotations

import collections
import ctypes
import ctypes.util
import gc
import json
import os
import signal
import sys
import tempfile
import tracemalloc
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

ENV = "KVSTORE_TRACEMALLOC_DIR"
TRIM = "trim"  # a file of this name in the folder: trim glibc's heap after each dump
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
        pymalloc, malloc = pymalloc_stats(), mallinfo()
        rss = {"rss_anon_kib": rss_anon_kib()}
        if (self.directory / TRIM).exists():
            rss["trimmed"] = malloc_trim()
            rss["rss_anon_after_trim_kib"] = rss_anon_kib()
        out = stem.with_suffix(".json")
        tmp = stem.with_suffix(".json.tmp")
        tmp.write_text(json.dumps({"pid": os.getpid(), "tracing": traced,
                                   "traced_bytes": current, "traced_peak_bytes": peak,
                                   "pymalloc": pymalloc, "malloc": malloc, **rss,
                                   "gc_objects": dict(types.most_common())}))
        tmp.replace(out)
        return out


_MALLINFO2 = ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
              "uordblks", "fordblks", "keepcost")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2]


def mallinfo() -> dict[str, int]:
    """glibc's ``mallinfo2()``: ``arena`` (bytes of its heap, from sbrk/mmap), ``uordblks``
    (in use), ``fordblks`` (free in it), ``hblkhd`` (big blocks mmapped one by one); {}
    where there is no such function (not glibc, or glibc before 2.33)."""
    libc = _libc()
    fn = getattr(libc, "mallinfo2", None) if libc is not None else None
    if fn is None:
        return {}
    fn.restype = _MallInfo2
    info = fn()
    return {f: int(getattr(info, f)) for f in _MALLINFO2}


def _libc() -> ctypes.CDLL | None:
    try:
        return ctypes.CDLL(ctypes.util.find_library("c"))
    except OSError:
        return None


def malloc_trim() -> bool | None:
    """glibc's ``malloc_trim(0)``: True if it gave memory back, None without glibc."""
    libc = _libc()
    fn = getattr(libc, "malloc_trim", None) if libc is not None else None
    if fn is None:
        return None
    return bool(fn(ctypes.c_size_t(0)))


def rss_anon_kib() -> int | None:
    """This process's RssAnon (``/proc/self/status``), None where there is none."""
    try:
        text = Path("/proc/self/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("RssAnon:"):
            return int(line.split()[1])
    return None


def pymalloc_stats() -> dict[str, int]:
    """The totals of ``sys._debugmallocstats()`` (``# arenas allocated current``,
    ``# bytes in allocated blocks``, ...) by their names; {} if it reports none (while
    tracemalloc traces)."""
    sys.stderr.flush()
    with tempfile.TemporaryFile() as f:
        saved = os.dup(2)
        try:
            os.dup2(f.fileno(), 2)
            sys._debugmallocstats()
        finally:
            os.dup2(saved, 2)
            os.close(saved)
        f.seek(0)
        text = f.read().decode(errors="replace")
    out: dict[str, int] = {}
    for line in text.splitlines():
        name, eq, value = line.rpartition("=")
        digits = value.strip().replace(",", "")
        if eq and digits.isdigit() and name.startswith("#"):
            out[" ".join(name.split())] = int(digits)
    return out


def install_from_env(environ: Mapping[str, str] | None = None) -> MemoryDumper | None:
    """When ``KVSTORE_TRACEMALLOC_DIR`` is set: starts tracing (unless it is on already)
    and installs the SIGUSR2 handler (call from the main thread); returns the dumper, or
    None when the variable is unset or empty. ValueError for frames that are not a
    non-negative integer (0: dumps without tracing, which keeps the object allocator's
    statistics)."""
    env = os.environ if environ is None else environ
    where = env.get(ENV, "")
    if not where:
        return None
    text = env.get(FRAMES_ENV, "") or str(DEFAULT_FRAMES)
    if not text.isdigit():
        raise ValueError(f"{FRAMES_ENV} must be a non-negative integer, got {text!r}")
    if int(text) and not tracemalloc.is_tracing():
        tracemalloc.start(int(text))
    dumper = MemoryDumper(Path(where))

    def on_signal(_sig: int, _frame: FrameType | None) -> None:
        dumper.dump()

    signal.signal(SIGNAL, on_signal)
    return dumper
