"""The soak's diagnosis of a node's heap (``python -m benchmarks.soak --tracemalloc``).

The judged node (the first spared one, node-1) runs with ``KVSTORE_TRACEMALLOC_DIR``
(``kvstore/node/memory_dump.py``: it traces its allocations, ``tracemalloc_frames``
frames each, or with 0 does not trace, which keeps its RssAnon true and the object
allocator's statistics available); ``Dumper``
sends it SIGUSR2 every ``tracemalloc_every_s`` and once more when the load has stopped
(that last time with the ``trim`` file, so the node then hands its free heap pages back
and reports its RssAnon after: memory the allocator held, not live objects), so it
writes a tracemalloc snapshot and its live objects counted by type. ``analyse`` compares
the first dump at or after ``tracemalloc_from_s`` (past the data's warm-up) with the last
one: the allocation sites (by traceback) whose traced bytes grew most, the object types
whose counts grew most, and, for every dump, the node restarts done by then, so growth that
follows the faults can be told from growth that follows the traffic.
Tracing costs the node time and memory (each traced block carries its traceback): its
RssAnon in such a run is not the one the memory verdict is meant for.
"""

from __future__ import annotations

import json
import os
import threading
import time
import tracemalloc
from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

from kvstore.node.memory_dump import ENV, FRAMES_ENV, SIGNAL, TRIM


class Fault(Protocol):
    """What ``analyse`` reads of a fault (``benchmarks.soak_load.Fault``, which imports
    this module)."""

    @property
    def t(self) -> float: ...
    @property
    def what(self) -> str: ...
    @property
    def skipped(self) -> str: ...
    @property
    def recovered_s(self) -> float | None: ...


class Soak(Protocol):
    """What ``Dumper`` reads of the run (``benchmarks.soak_load.Soak``)."""

    @property
    def lock(self) -> AbstractContextManager[Any]: ...
    @property
    def pids(self) -> dict[str, int | None]: ...
    @property
    def clock(self) -> Callable[[], float]: ...

DUMP_TIMEOUT_S = 60.0  # a dump of a traced heap takes seconds on a loaded machine


def node_env(directory: Path, frames: int) -> dict[str, str]:
    """The environment that makes a node dumpable (tracing ``frames`` per allocation; 0:
    dumps of its objects and allocators only)."""
    return {FRAMES_ENV: str(frames), ENV: str(directory)}


@dataclass(slots=True, kw_only=True)
class Dump:
    t: float  # when it was asked for (soak clock)
    pid: int
    stem: Path  # <stem>.json and <stem>.tracemalloc


class Dumper(threading.Thread):
    """Asks ``node`` for a dump every ``every_s`` until ``stop``, then once more."""

    def __init__(self, soak: Soak, node: str, directory: Path, every_s: float,
                 stop: threading.Event) -> None:
        super().__init__(name="soak-dumper", daemon=True)
        self.soak = soak
        self.node = node
        self.directory = directory
        self.every_s = every_s
        self.halt = stop
        self.dumps: list[Dump] = []
        self.counts: dict[int, int] = {}  # pid -> dumps asked of it
        self.failures: list[str] = []

    def run(self) -> None:
        while not self.halt.wait(self.every_s):
            self.dump()
        (self.directory / TRIM).touch()  # the last one: then the node trims its heap
        self.dump()

    def dump(self) -> None:
        with self.soak.lock:
            pid = self.soak.pids.get(self.node)
        if not pid:
            return
        n = self.counts.get(pid, 0)
        self.counts[pid] = n + 1
        stem = self.directory / f"{pid}-{n}"
        t = self.soak.clock()
        os.kill(pid, SIGNAL)
        deadline = time.monotonic() + DUMP_TIMEOUT_S
        while not stem.with_suffix(".json").exists():
            if time.monotonic() > deadline:
                self.failures.append(f"{self.node} (pid {pid}) wrote no dump {n} in "
                                     f"{DUMP_TIMEOUT_S:g} s")
                return
            time.sleep(0.2)
        self.dumps.append(Dump(t=round(t, 1), pid=pid, stem=stem))


def _restarts_by(faults: Sequence[Fault], t: float) -> tuple[int, int]:
    """Node restarts and etcd restarts finished by ``t``."""
    nodes = etcd = 0
    for f in faults:
        if f.skipped or f.recovered_s is None or f.t + f.recovered_s > t:
            continue
        if f.what.endswith("etcd"):
            etcd += 1
        else:
            nodes += 1
    return nodes, etcd


def _allocators(info: dict[str, Any]) -> dict[str, float | None]:
    """MiB: the object allocator's arenas and the bytes in use in them; glibc's heap
    (``arena``: from the system, ``uordblks``: in use, ``fordblks``: free in it)."""
    py, c = info.get("pymalloc", {}), info.get("malloc", {})

    def mib(d: dict[str, int], k: str, shift: int = 0) -> float | None:
        return round((d[k] << shift) / 2**20, 2) if k in d else None

    trimmed = info.get("rss_anon_after_trim_kib")
    return {"rss_anon_after_trim_mib": None if trimmed is None else round(trimmed / 1024, 2),
            "pymalloc_arenas_mib": mib(py, "# arenas allocated current", 20),
            "pymalloc_used_mib": mib(py, "# bytes in allocated blocks"),
            "malloc_heap_mib": mib(c, "arena"), "malloc_used_mib": mib(c, "uordblks"),
            "malloc_free_mib": mib(c, "fordblks"), "malloc_mmapped_mib": mib(c, "hblkhd")}


def _sites(before: tracemalloc.Snapshot, after: tracemalloc.Snapshot, key: str, top: int,
           frames: int) -> list[dict[str, Any]]:
    out = []
    for d in after.compare_to(before, key)[:top]:
        out.append({"size_diff_kib": round(d.size_diff / 1024, 1), "count_diff": d.count_diff,
                    "size_kib": round(d.size / 1024, 1), "count": d.count,
                    "where": [line for line in d.traceback.format(limit=frames)
                              if line.startswith("  File")]})
    return out


def analyse(dumps: Sequence[Dump], faults: Sequence[Fault], *, from_s: float,
            top: int = 15, frames: int = 6) -> dict[str, Any]:
    """The growth between the first dump at or after ``from_s`` (of the last process
    dumped) and that process's last dump; every dump's figures."""
    if not dumps:
        return {"error": "no dump was written"}
    pid = dumps[-1].pid
    mine = [d for d in dumps if d.pid == pid]
    first = next((d for d in mine if d.t >= from_s), mine[0])
    last = mine[-1]
    rows = []
    gc_counts: list[dict[str, int]] = []
    for d in mine:
        info = json.loads(d.stem.with_suffix(".json").read_text())
        gc_counts.append(info["gc_objects"])
        nodes, etcd = _restarts_by(faults, d.t)
        rows.append({"t_s": d.t, "node_restarts": nodes, "etcd_restarts": etcd,
                     # the node's own reading, before any trim
                     "rss_anon_mib": (None if info.get("rss_anon_kib") is None
                                      else round(info["rss_anon_kib"] / 1024, 2)),
                     "traced_mib": round(info["traced_bytes"] / 2**20, 2),
                     **_allocators(info),
                     "gc_objects": sum(info["gc_objects"].values())})
    i, j = mine.index(first), mine.index(last)
    growth = {k: gc_counts[j].get(k, 0) - gc_counts[i].get(k, 0)
              for k in set(gc_counts[i]) | set(gc_counts[j])}
    types = sorted((k for k in growth if growth[k]), key=lambda k: -abs(growth[k]))[:top]
    n_restarts = rows[j]["node_restarts"] - rows[i]["node_restarts"]
    out: dict[str, Any] = {
        "pid": pid, "from_t_s": first.t, "to_t_s": last.t,
        "node_restarts_between": n_restarts,
        "traced_growth_kib": round((rows[j]["traced_mib"] - rows[i]["traced_mib"]) * 1024, 1),
        "rss_anon_growth_kib": (None if None in (rows[i]["rss_anon_mib"], rows[j]["rss_anon_mib"])
                                else round((rows[j]["rss_anon_mib"] - rows[i]["rss_anon_mib"])
                                           * 1024, 1)),
        "dumps": rows,
        "gc_type_growth": [{"type": k, "from": gc_counts[i].get(k, 0),
                            "to": gc_counts[j].get(k, 0), "growth": growth[k],
                            "per_node_restart": (round(growth[k] / n_restarts, 2)
                                                 if n_restarts else None),
                            "series": [c.get(k, 0) for c in gc_counts]}
                           for k in types],
    }
    if first is not last and first.stem.with_suffix(".tracemalloc").exists():
        before = tracemalloc.Snapshot.load(str(first.stem.with_suffix(".tracemalloc")))
        after = tracemalloc.Snapshot.load(str(last.stem.with_suffix(".tracemalloc")))
        out["sites_by_traceback"] = _sites(before, after, "traceback", top, frames)
        out["sites_by_line"] = _sites(before, after, "lineno", top, 1)
    return out


def print_analysis(a: dict[str, Any], out: Callable[[str], None] = print) -> None:
    if "error" in a:
        out(f"tracemalloc: {a['error']}")
        return
    out(f"tracemalloc: pid {a['pid']}, {a['from_t_s']:g} s -> {a['to_t_s']:g} s, "
        f"{a['node_restarts_between']} node restarts between; traced memory grew "
        f"{a['traced_growth_kib']:g} KiB, RssAnon {a['rss_anon_growth_kib']} KiB")
    for r in a["dumps"]:
        out(f"  t {r['t_s']:7.1f} s: node restarts {r['node_restarts']:3d}, etcd "
            f"{r['etcd_restarts']:2d}; RssAnon {r['rss_anon_mib']} MiB; traced "
            f"{r['traced_mib']:7.2f} MiB; gc objects {r['gc_objects']}; pymalloc arenas "
            f"{r.get('pymalloc_arenas_mib')} MiB, used {r.get('pymalloc_used_mib')}; malloc "
            f"heap {r.get('malloc_heap_mib')} MiB, used {r.get('malloc_used_mib')}, free "
            f"{r.get('malloc_free_mib')}, mmapped {r.get('malloc_mmapped_mib')}"
            + (f"; RssAnon after malloc_trim {r['rss_anon_after_trim_mib']} MiB"
               if r.get("rss_anon_after_trim_mib") is not None else ""))
    out("object types whose count changed most (from -> to; per node restart):")
    for g in a["gc_type_growth"]:
        out(f"  {g['type']:40s} {g['from']:8d} -> {g['to']:8d} ({g['growth']:+d}; "
            f"{g['per_node_restart']})")
    for key in ("sites_by_line", "sites_by_traceback"):
        out(f"allocation sites that grew most ({key[9:]}):")
        for s in a.get(key, []):
            out(f"  {s['size_diff_kib']:+9.1f} KiB {s['count_diff']:+7d} blocks "
                f"(now {s['size_kib']:.1f} KiB in {s['count']})")
            for line in s["where"]:
                out(f"      {line.strip()}")
