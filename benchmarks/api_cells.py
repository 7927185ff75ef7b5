"""The cells of ``kvstore bench api``: one system doing one operation on one size.

Each builder returns the cells for one system (kvstore over a transport, Redis,
the raw TCP peer, memcpy); ``api_bench`` runs them in interleaved rounds.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from benchmarks import peers
from benchmarks.stats import (
    CellStats,
)

BATCH_COUNT = 64
BATCH_ITEM = 64 << 10
BATCH = "batch"  # the group name of the batch cells


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    cell_seconds: float  # time bound of one cell in one round
    min_ops: int  # per round, even past the time bound (slow cells still get samples)
    max_ops: int  # per round, whichever bound comes first
    max_round_bytes: int  # bounds the data a put round leaves in a store before cleanup
    warmup_ops: int

    def op_limit(self, nbytes: int) -> int:
        return min(self.max_ops, max(self.min_ops, self.max_round_bytes // max(1, nbytes)))


# ~66 cells: the full run is ~2 minutes, --quick ~20 s on 2 cores.
def _noop(_n: int) -> None:
    return None


@dataclass(slots=True)
class Cell:
    """One system doing one operation on one size; ``run(i)`` is the i-th op of a round."""

    system: str
    op: str
    group: str  # str(size), or BATCH
    nbytes: int  # bytes moved by one op
    run: Callable[[int], None]
    begin: Callable[[int], None] = _noop  # untimed, before a round of at most n ops
    end: Callable[[int], None] = _noop  # untimed, after a round that did n ops
    stats: CellStats = field(init=False)
    error: str | None = None  # set when an op failed: the cell is dropped from later rounds
    peer_pid: int | None = None  # the server process: its CPU is counted with this one's

    def __post_init__(self) -> None:
        self.stats = CellStats(self.nbytes)

    @property
    def id(self) -> str:
        return f"{self.system}/{self.op}/{self.group}"


def run_round(cell: Cell, s: Settings, *, record: bool = True, ops: int | None = None
              ) -> list[float]:
    """Runs ops until the time bound (after ``min_ops``) or the op limit; per-op seconds."""
    limit = ops if ops is not None else s.op_limit(cell.nbytes)
    lat: list[float] = []
    cell.begin(limit)
    clock = time.perf_counter
    cpu0 = _cpu_s(cell.peer_pid)
    try:
        deadline = clock() + s.cell_seconds
        for i in range(limit):
            t0 = clock()
            cell.run(i)
            t1 = clock()
            lat.append(t1 - t0)
            if t1 >= deadline and i + 1 >= s.min_ops:
                break
    finally:
        cpu1 = _cpu_s(cell.peer_pid)
        cell.end(len(lat))
    if record:
        cell.stats.add_round(lat, cpu1 - cpu0)
    return lat


_TICK = os.sysconf("SC_CLK_TCK")


def _cpu_s(peer_pid: int | None) -> float:
    """CPU seconds of this process (every thread), plus the peer's (``/proc``, at clock-tick
    resolution: rounds of a quarter second or more keep that within a few percent)."""
    total = time.process_time()
    if peer_pid is not None:
        try:
            with open(f"/proc/{peer_pid}/stat", "rb") as f:
                fields = f.read().rsplit(b")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / _TICK  # utime, stime
        except (OSError, IndexError, ValueError):
            pass
    return total


class BenchError(RuntimeError):
    """A cell returned a wrong answer: the figures would be meaningless."""


# ---- data per size -------------------------------------------------------------------------


@dataclass(slots=True)
class Data:
    """Values to read (stored under ``keys`` in every store) and preallocated buffers."""

    size: int
    keys: list[bytes]
    values: list[bytes]  # distinct random values: no cell reads one hot buffer only
    dst: bytearray  # receive buffer for get_into / recv_into / memcpy
    dsts: list[bytearray]  # one per key, for the batch cells

    @classmethod
    def make(cls, size: int, count: int, *, batch: bool = False) -> Data:
        values = [os.urandom(size) for _ in range(count)]
        # Written-to buffers: untouched ones would take page faults in the first ops.
        dst = bytearray(values[0])
        dsts = [bytearray(v) for v in values] if batch else []
        return cls(size, [os.urandom(16) for _ in range(count)], values, dst, dsts)


def _key_count(size: int) -> int:
    # Enough distinct values that reads are not all from one cache-hot buffer, few
    # enough that a size costs at most ~64 MiB per store.
    return max(2, min(16, (64 << 20) // size))


def _fresh_keys(holder: list[bytes], n: int) -> None:
    holder[:] = [os.urandom(16) for _ in range(n)]


# ---- cells per system ----------------------------------------------------------------------


def kvstore_cells(client: Any, system: str, d: Data, pid: int | None = None) -> list[Cell]:
    size, keys, values, n = d.size, d.keys, d.values, len(d.keys)
    dst = d.dst
    fresh: list[bytes] = []

    def put(i: int) -> None:
        if not client.put(fresh[i], values[i % n]):
            raise BenchError(f"{system}: put of a fresh key reported an existing key")

    def put_end(count: int) -> None:
        for k in fresh[:count]:
            client.remove(k)

    def get(i: int) -> None:
        v = client.get(keys[i % n])
        if v is None or len(v) != size:
            raise BenchError(f"{system}: get returned {None if v is None else len(v)} bytes")

    def get_into(i: int) -> None:
        if client.get_into(keys[i % n], dst) != size:
            raise BenchError(f"{system}: get_into returned a wrong length")

    g = str(size)
    return [Cell(system, "put", g, size, put, lambda m: _fresh_keys(fresh, m), put_end,
                 peer_pid=pid),
            Cell(system, "get", g, size, get, peer_pid=pid),
            Cell(system, "get_into", g, size, get_into, peer_pid=pid)]


def kvstore_batch_cells(client: Any, system: str, d: Data, pid: int | None = None
                        ) -> list[Cell]:
    keys, dsts, total = d.keys, d.dsts, d.size * len(d.keys)

    def get_batch(_i: int) -> None:
        vs = client.get_batch(keys)
        if len(vs) != len(keys) or any(v is None for v in vs):
            raise BenchError(f"{system}: get_batch missed stored keys")

    def get_batch_into(_i: int) -> None:
        ns = client.get_batch_into(keys, dsts)
        if any(x != d.size for x in ns):
            raise BenchError(f"{system}: get_batch_into returned wrong lengths")

    return [Cell(system, "get_batch", BATCH, total, get_batch, peer_pid=pid),
            Cell(system, "get_batch_into", BATCH, total, get_batch_into, peer_pid=pid)]


def redis_cells(r: Any, d: Data, pid: int | None = None) -> list[Cell]:
    size, keys, values, n = d.size, d.keys, d.values, len(d.keys)
    fresh: list[bytes] = []

    def put(i: int) -> None:
        r.set(fresh[i], values[i % n])

    def put_end(count: int) -> None:
        for lo in range(0, count, 512):
            r.delete(*fresh[lo : min(count, lo + 512)])

    def get(i: int) -> None:
        v = r.get(keys[i % n])
        if v is None or len(v) != size:
            raise BenchError(f"redis: GET returned {None if v is None else len(v)} bytes")

    g = str(size)
    return [Cell("redis", "put", g, size, put, lambda m: _fresh_keys(fresh, m), put_end,
                 peer_pid=pid),
            Cell("redis", "get", g, size, get, peer_pid=pid)]


def redis_batch_cells(r: Any, d: Data, pid: int | None = None) -> list[Cell]:
    keys, total = d.keys, d.size * len(d.keys)

    def pipelined(_i: int) -> None:
        p = r.pipeline(transaction=False)
        for k in keys:
            p.get(k)
        if any(v is None for v in p.execute()):
            raise BenchError("redis: pipelined GET missed stored keys")

    def mget(_i: int) -> None:
        if any(v is None for v in r.mget(keys)):
            raise BenchError("redis: MGET missed stored keys")

    return [Cell("redis", "pipeline_get", BATCH, total, pipelined, peer_pid=pid),
            Cell("redis", "mget", BATCH, total, mget, peer_pid=pid)]


def raw_cells(cl: peers.RawTcpClient, d: Data, pid: int | None = None) -> list[Cell]:
    size, n = d.size, len(d.values)
    srcs = [memoryview(v) for v in d.values]
    dst = memoryview(d.dst)

    # Slots i % n: the peer touches as many distinct buffers as the stores do.
    def put(i: int) -> None:
        cl.put(srcs[i % n], i % n)

    def get(i: int) -> None:
        cl.get_into(dst, size, i % n)

    g = str(size)
    return [Cell("raw-tcp", "put", g, size, put, peer_pid=pid),
            Cell("raw-tcp", "get_into", g, size, get, peer_pid=pid)]


def raw_batch_cells(cl: peers.RawTcpClient, d: Data, pid: int | None = None) -> list[Cell]:
    views = [memoryview(b) for b in d.dsts]

    def get_many(_i: int) -> None:
        cl.get_many_into(views, d.size)

    # One request, one scattered reply: how a store answers a batch, at the limit.
    return [Cell("raw-tcp", "get_batch_into", BATCH, d.size * len(views), get_many,
                 peer_pid=pid)]


def memcpy_cells(d: Data) -> list[Cell]:
    srcs = [memoryview(v) for v in d.values]
    dst = memoryview(d.dst)
    n = len(srcs)

    def copy(i: int) -> None:
        dst[:] = srcs[i % n]  # memoryview slice assignment is one memcpy

    return [Cell("memcpy", "copy", str(d.size), d.size, copy)]


def memcpy_batch_cells(d: Data) -> list[Cell]:
    pairs = [(memoryview(b), memoryview(v)) for b, v in zip(d.dsts, d.values, strict=True)]

    def copy(_i: int) -> None:
        for dst, src in pairs:
            dst[:] = src

    return [Cell("memcpy", "copy", BATCH, d.size * len(pairs), copy)]
