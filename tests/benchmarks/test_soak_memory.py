"""``benchmarks/soak_memory.py``'s comparison of a node's dumps, on dumps this process
writes (``kvstore/node/memory_dump.py``) between which it makes a known number of objects."""

from __future__ import annotations

import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from benchmarks.soak_load import Fault
from benchmarks.soak_memory import Dump, analyse, print_analysis
from kvstore.node.memory_dump import MemoryDumper


@pytest.fixture
def tracing() -> Iterator[None]:
    was = tracemalloc.is_tracing()
    if not was:
        tracemalloc.start(4)
    yield
    if not was:
        tracemalloc.stop()


class Grower:  # one per simulated peer restart
    __slots__ = ("payload",)

    def __init__(self) -> None:
        self.payload = bytearray(10_000)


PAYLOAD_LINE = f'  File "{__file__}", line {Grower.__init__.__code__.co_firstlineno + 1}'


def _dump(dumper: MemoryDumper, t: float) -> Dump:
    path = dumper.dump()
    return Dump(t=t, pid=int(path.stem.split("-")[0]), stem=path.with_suffix(""))


def test_growth_between_the_first_dump_after_from_and_the_last(tmp_path: Path,
                                                                tracing: None) -> None:
    dumper = MemoryDumper(tmp_path)
    kept: list[Grower] = []
    dumps = [_dump(dumper, 10.0)]  # before from_s: not the baseline
    kept += [Grower() for _ in range(2)]
    dumps.append(_dump(dumper, 60.0))  # the baseline
    kept += [Grower() for _ in range(6)]
    dumps.append(_dump(dumper, 120.0))
    faults = [Fault(t=20.0, what="SIGKILL node-2", recovered_s=5.0),  # by 25 s
              Fault(t=70.0, what="SIGKILL node-3", recovered_s=5.0),
              Fault(t=80.0, what="SIGKILL etcd", recovered_s=2.0),
              Fault(t=90.0, what="SIGKILL node-2", recovered_s=5.0),
              Fault(t=100.0, what="SIGKILL node-3", skipped="the run ended first"),
              Fault(t=118.0, what="SIGKILL node-2", recovered_s=5.0)]  # back at 123 s
    a = analyse(dumps, faults, from_s=30.0, top=50, frames=4)
    assert (a["from_t_s"], a["to_t_s"]) == (60.0, 120.0)
    assert [(r["t_s"], r["node_restarts"], r["etcd_restarts"]) for r in a["dumps"]] == [
        (10.0, 0, 0), (60.0, 1, 0), (120.0, 3, 1)]
    assert a["node_restarts_between"] == 2
    grower = next(g for g in a["gc_type_growth"] if g["type"] == "Grower")
    assert (grower["from"], grower["to"], grower["growth"]) == (2, 8, 6)
    assert grower["series"] == [0, 2, 8] and grower["per_node_restart"] == 3.0
    # The bytearrays' line: each is two blocks (the object and its buffer).
    here = [s for s in a["sites_by_line"] if s["where"] == [PAYLOAD_LINE]]
    assert [s["count_diff"] for s in here] == [12]
    assert here[0]["size_diff_kib"] >= 6 * 10_000 / 1024
    assert a["sites_by_traceback"] and a["traced_growth_kib"] > 50
    assert all(r["rss_anon_mib"] > 0 for r in a["dumps"])
    assert isinstance(a["rss_anon_growth_kib"], float)
    lines: list[str] = []
    print_analysis(a, lines.append)
    assert lines[0].startswith(f"tracemalloc: pid {a['pid']}, 60 s -> 120 s, 2 node restarts")
    assert any(line.lstrip().startswith("Grower") for line in lines)
    del kept


def test_no_dump() -> None:
    assert analyse([], [], from_s=0.0) == {"error": "no dump was written"}
