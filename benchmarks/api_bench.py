"""``kvstore bench api``: single-client put/get against Redis and the loopback limit.

One run starts its own peers on free loopback ports (a kvstore node, a
redis-server, a raw-TCP peer process) and measures, per value size (64 KiB,
1 MiB, 4 MiB, 16 MiB) and for a batch get of 64 x 64 KiB:

* kvstore over each transport: ``tcp`` (the remote path), ``shm`` (same host),
  ``grpc`` (for information): ``put``, ``get`` (returns new bytes) and
  ``get_into`` (into a preallocated buffer); batches with ``get_batch`` and
  ``get_batch_into``;
* Redis through redis-py with hiredis: SET, GET; batches as pipelined GETs and MGET;
* raw TCP: the same bytes with ``sendmsg``/``recv_into`` on preallocated
  buffers, the most any Python data path over loopback could reach;
* memcpy: the same bytes copied into a preallocated buffer, the same-host limit.

Hygiene: every cell is warmed up, then all cells of a size run in rounds, in a
fresh random order each round, each round bounded by time and op count; a
cell's ops/s is the median over rounds, and a ratio is the median of the
per-round ratios (cells of a round ran seconds apart, so drift cancels). Puts
use fresh keys (a put of a stored key is a no-op) and the keys are removed after
each round, untimed. The garbage collector is off while timing.

Prints the table and the targets (pass/miss), writes ``api_bench.json`` and
``api_bench.png`` under ``--out-dir``.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import gc
import os
import platform
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks import peers
from benchmarks.api_cells import (
    BATCH,
    BATCH_COUNT,
    BATCH_ITEM,
    BenchError,
    Cell,
    Data,
    Settings,
    _key_count,
    kvstore_batch_cells,
    kvstore_cells,
    memcpy_batch_cells,
    memcpy_cells,
    raw_batch_cells,
    raw_cells,
    redis_batch_cells,
    redis_cells,
    run_round,
)
from benchmarks.stats import (
    CellStats,
    Panel,
    format_table,
    paired_median_ratio,
    plot_panels,
    progress,
    size_label,
    verdict,
    write_json,
)

SIZES: tuple[int, ...] = (64 << 10, 1 << 20, 4 << 20, 16 << 20)
KV_TRANSPORTS: tuple[str, ...] = ("tcp", "shm", "grpc")
KV_DRAM = "2GiB"

__all__ = ["BenchError", "main", "run_api_bench"]


FULL = Settings(rounds=5, cell_seconds=0.25, min_ops=3, max_ops=5000,
                max_round_bytes=768 << 20, warmup_ops=3)
QUICK = Settings(rounds=3, cell_seconds=0.05, min_ops=2, max_ops=1000,
                 max_round_bytes=256 << 20, warmup_ops=1)



# ---- the systems under test ----------------------------------------------------------------


@dataclass(slots=True)
class Systems:
    """Peers and one client per system; a system that could not start is in ``errors``."""

    kv: dict[str, Any] = field(default_factory=dict)  # transport -> kvstore Client
    redis: Any = None
    raw: peers.RawTcpClient | None = None
    errors: dict[str, str] = field(default_factory=dict)
    info: dict[str, Any] = field(default_factory=dict)

    def preload(self, d: Data) -> None:
        """Stores ``d``'s values under its keys in each store, and in the raw peer's slots."""
        if self.kv:
            c = next(iter(self.kv.values()))
            c.put_batch(d.keys, d.values)
        if self.redis is not None:
            p = self.redis.pipeline(transaction=False)
            for k, v in zip(d.keys, d.values, strict=True):
                p.set(k, v)
            p.execute()
        if self.raw is not None:
            # Slot i holds value i, and the peer's buffers are grown before timing.
            for i, v in enumerate(d.values):
                self.raw.put(memoryview(v), i)

    def unload(self, d: Data) -> None:
        if self.kv:
            c = next(iter(self.kv.values()))
            for k in d.keys:
                c.remove(k)
        if self.redis is not None:
            self.redis.delete(*d.keys)

    def cells(self, d: Data, *, batch: bool) -> list[Cell]:
        out: list[Cell] = []
        pid = self.info.get("kvstore", {}).get("pid")
        for t, c in self.kv.items():
            sysname = f"kvstore-{t}"
            out += (kvstore_batch_cells(c, sysname, d, pid) if batch
                    else kvstore_cells(c, sysname, d, pid))
        if self.redis is not None:
            pid = self.info["redis"]["pid"]
            out += (redis_batch_cells(self.redis, d, pid) if batch
                    else redis_cells(self.redis, d, pid))
        if self.raw is not None:
            pid = self.info["raw-tcp"]["pid"]
            out += raw_batch_cells(self.raw, d, pid) if batch else raw_cells(self.raw, d, pid)
        out += memcpy_batch_cells(d) if batch else memcpy_cells(d)
        return out


@contextlib.contextmanager
def start_systems(transports: Sequence[str], *, use_redis: bool = True,
                  use_raw: bool = True) -> Iterator[Systems]:
    """Starts the peers and connects; everything is stopped (by PID) on the way out."""
    sy = Systems()
    with contextlib.ExitStack() as stack:
        if transports:
            try:
                node = stack.enter_context(peers.start_kvstore(dram_bytes=KV_DRAM))
                sy.info["kvstore"] = {"pid": node.pid, "addr": node.addr, "dram": KV_DRAM}
                from kvstore.client import Client
            except Exception as exc:
                sy.errors["kvstore"] = f"{type(exc).__name__}: {exc}"
            else:
                for t in transports:  # one transport that cannot connect spares the others
                    try:
                        c = stack.enter_context(Client(node.addr, transport=t))
                        if c.transport != t:
                            raise RuntimeError(f"asked for transport {t}, got {c.transport}")
                        sy.kv[t] = c
                    except Exception as exc:
                        sy.errors[f"kvstore-{t}"] = f"{type(exc).__name__}: {exc}"
        if use_redis:
            try:
                import redis
                from redis.utils import HIREDIS_AVAILABLE

                rp = stack.enter_context(peers.start_redis())
                r = redis.Redis(host=rp.host, port=rp.port, socket_timeout=60)
                stack.callback(r.close)
                version = r.info("server").get("redis_version")
                sy.redis = r
                sy.info["redis"] = {"pid": rp.pid, "addr": rp.addr, "server": version,
                                    "redis_py": redis.__version__,
                                    "hiredis": bool(HIREDIS_AVAILABLE)}
                if not HIREDIS_AVAILABLE:
                    print("warning: hiredis is not installed: Redis figures use the pure-Python "
                          "parser", file=sys.stderr)
            except Exception as exc:
                sy.errors["redis"] = f"{type(exc).__name__}: {exc}"
                sy.redis = None
        if use_raw:
            try:
                pp = stack.enter_context(peers.start_raw_tcp_peer())
                sy.raw = stack.enter_context(peers.RawTcpClient(pp.host, pp.port))
                sy.info["raw-tcp"] = {"pid": pp.pid, "addr": pp.addr}
            except Exception as exc:
                sy.errors["raw-tcp"] = f"{type(exc).__name__}: {exc}"
                sy.raw = None
        yield sy


# ---- the run -------------------------------------------------------------------------------


def measure_group(cells: list[Cell], s: Settings, rng: random.Random, label: str) -> None:
    """Warms every cell up, then runs ``s.rounds`` rounds of all cells in a random order.

    A cell whose op fails (an error, or a wrong answer) is reported and left out of
    the remaining rounds, so one broken path does not cost the other figures.
    """
    bar = progress(len(cells) * (s.rounds + 1), label, unit="cell")
    for c in cells:
        _guarded(c, functools.partial(run_round, c, s, record=False, ops=s.warmup_ops))
        bar.update()
    for r in range(s.rounds):
        order = [c for c in cells if c.error is None]
        rng.shuffle(order)  # no cell always runs right after the same neighbour
        t0 = time.monotonic()
        for c in order:
            gc.collect()
            _guarded(c, functools.partial(run_round, c, s))
            bar.update()
        print(f"  {label}: round {r + 1}/{s.rounds} ({time.monotonic() - t0:.1f} s)",
              file=sys.stderr, flush=True)
    bar.close()


def _guarded(cell: Cell, fn: Callable[[], object]) -> None:
    try:
        fn()
    except Exception as exc:
        cell.error = f"{type(exc).__name__}: {exc}"
        cell.stats = CellStats(cell.nbytes)  # figures of a broken path are not reported
        print(f"warning: {cell.id} failed and is left out: {cell.error}", file=sys.stderr)


# Which baseline each kvstore op is held against: (redis op, raw op, memcpy op).
BASELINES: dict[str, tuple[str, str, str]] = {
    "put": ("put", "put", "copy"),
    "get": ("get", "get_into", "copy"),
    "get_into": ("get", "get_into", "copy"),
    "get_batch": ("pipeline_get", "get_batch_into", "copy"),
    "get_batch_into": ("pipeline_get", "get_batch_into", "copy"),
    "pipeline_get": ("", "get_batch_into", "copy"),
    "mget": ("", "get_batch_into", "copy"),
    "copy": ("", "", ""),
}


def _ratio(cells: dict[str, Cell], num: str, den: str) -> float | None:
    a, b = cells.get(num), cells.get(den)
    if a is None or b is None or a.error or b.error:
        return None
    return paired_median_ratio(a.stats.round_ops_per_s(), b.stats.round_ops_per_s())


def _cpu_ratio(cells: dict[str, Cell], num: str, den: str) -> float | None:
    """Median of per-round ratios of CPU per MiB (both ends) to the baseline's."""
    a, b = cells.get(num), cells.get(den)
    if a is None or b is None or a.error or b.error:
        return None
    ca, cb = a.stats.cpu_ms_per_mib, b.stats.cpu_ms_per_mib
    if not ca or len(ca) != len(cb):
        return None
    return paired_median_ratio(ca, cb)


def baseline_ids(cell: Cell) -> dict[str, str | None]:
    redis_op, raw_op, memcpy_op = BASELINES.get(cell.op, ("", "", ""))
    # Redis and raw rows also get "x raw"/"x memcpy", but not a ratio to themselves.
    return {
        "redis": (f"redis/{redis_op}/{cell.group}"
                  if redis_op and cell.system != "redis" else None),
        "raw": (f"raw-tcp/{raw_op}/{cell.group}"
                if raw_op and cell.system not in ("raw-tcp",) else None),
        "memcpy": (f"memcpy/{memcpy_op}/{cell.group}"
                   if memcpy_op and cell.system != "memcpy" else None),
    }


@dataclass(frozen=True, slots=True)
class Target:
    label: str
    num: str  # cell id
    den: str  # cell id
    need: float


def targets_for(sizes: Sequence[int], *, batch: bool = True) -> list[Target]:
    """The issue's targets, each a median paired ratio against a baseline cell."""
    out: list[Target] = []
    for size in sizes:
        g, sl = str(size), size_label(size)
        if size >= 1 << 20:
            for op in ("put", "get", "get_into"):
                raw_op = "put" if op == "put" else "get_into"
                out.append(Target(f"remote {op} {sl} vs raw TCP", f"kvstore-tcp/{op}/{g}",
                                  f"raw-tcp/{raw_op}/{g}", 0.8))
            for op in ("put", "get", "get_into"):
                redis_op = "put" if op == "put" else "get"
                out.append(Target(f"remote {op} {sl} vs Redis", f"kvstore-tcp/{op}/{g}",
                                  f"redis/{redis_op}/{g}", 1.5))
        if size == 64 << 10:
            for op in ("get", "get_into"):
                out.append(Target(f"remote {op} {sl} vs Redis GET", f"kvstore-tcp/{op}/{g}",
                                  f"redis/get/{g}", 1.0))
    label = f"{BATCH_COUNT} x {size_label(BATCH_ITEM)}"
    for op in ("get_batch", "get_batch_into") if batch else ():
        for rop, rname in (("pipeline_get", "pipelined GETs"), ("mget", "MGET")):
            out.append(Target(f"remote {op} {label} vs Redis {rname}",
                              f"kvstore-tcp/{op}/{BATCH}", f"redis/{rop}/{BATCH}", 1.0))
    if 4 << 20 in sizes:
        g = str(4 << 20)
        out.append(Target("same-host get_into 4 MiB vs memcpy", f"kvstore-shm/get_into/{g}",
                          f"memcpy/copy/{g}", 0.5))
    return out


def run_api_bench(*, quick: bool = False, out_dir: str | os.PathLike[str] = "benchmarks/results",
                  sizes: Sequence[int] = SIZES, transports: Sequence[str] = KV_TRANSPORTS,
                  use_redis: bool = True, use_raw: bool = True, batch: bool = True,
                  settings: Settings | None = None, seed: int = 1) -> dict[str, Any]:
    """Runs the benchmark, prints the tables, writes api_bench.json/.png; returns the results."""
    s = settings or (QUICK if quick else FULL)
    rng = random.Random(seed)
    t_start = time.monotonic()
    groups: list[tuple[str, list[Cell]]] = []
    with start_systems(transports, use_redis=use_redis, use_raw=use_raw) as sy:
        for name, err in sy.errors.items():
            print(f"warning: {name} is left out: {err}", file=sys.stderr)
        was_enabled = gc.isenabled()
        gc.disable()  # a collection inside a timed op is noise, not the system's cost
        try:
            plan = [(size, False) for size in sizes] + ([(BATCH_ITEM, True)] if batch else [])
            for size, is_batch in plan:
                d = (Data.make(BATCH_ITEM, BATCH_COUNT, batch=True) if is_batch
                     else Data.make(size, _key_count(size)))
                sy.preload(d)
                try:
                    cells = sy.cells(d, batch=is_batch)
                    label = (f"batch {BATCH_COUNT} x {size_label(BATCH_ITEM)}" if is_batch
                             else size_label(size))
                    measure_group(cells, s, rng, label)
                    groups.append((BATCH if is_batch else str(size), cells))
                finally:
                    sy.unload(d)
                del d
        finally:
            if was_enabled:
                gc.enable()
        info, errors = dict(sy.info), dict(sy.errors)
    elapsed = time.monotonic() - t_start
    res = build_results(groups, sizes, s, quick=quick, info=info, errors=errors,
                        elapsed=elapsed)
    print(format_results(res))
    out = Path(out_dir)
    jpath = write_json(out / "api_bench.json", res)
    ppath = plot_results(res, out / "api_bench.png")
    print(f"\nwrote {jpath} and {ppath} ({elapsed:.0f} s)")
    return res


def build_results(groups: Sequence[tuple[str, list[Cell]]], sizes: Sequence[int],
                  s: Settings, *, quick: bool, info: dict[str, Any], errors: dict[str, str],
                  elapsed: float) -> dict[str, Any]:
    by_id = {c.id: c for _, cells in groups for c in cells}
    rows = []
    for group, cells in groups:
        for c in cells:
            bl = baseline_ids(c)
            rows.append({
                "id": c.id, "system": c.system, "op": c.op, "group": group,
                "nbytes": c.nbytes,
                "items": BATCH_COUNT if group == BATCH else 1,
                **c.stats.summary(),
                "error": c.error,
                "x_redis": _ratio(by_id, c.id, bl["redis"]) if bl["redis"] else None,
                "x_raw": _ratio(by_id, c.id, bl["raw"]) if bl["raw"] else None,
                "x_memcpy": _ratio(by_id, c.id, bl["memcpy"]) if bl["memcpy"] else None,
                "cpu_x_raw": _cpu_ratio(by_id, c.id, bl["raw"]) if bl["raw"] else None,
            })
    targets = []
    for t in targets_for(sizes, batch=any(g == BATCH for g, _ in groups)):
        r = _ratio(by_id, t.num, t.den)
        targets.append({"target": t.label, "cell": t.num, "baseline": t.den, "need": t.need,
                        "ratio": r, "verdict": verdict(r, t.need)})
    channel = []
    for t in channel_targets(sizes):
        r = (_ratio(by_id, t.num, t.den) if t.label.endswith("throughput")
             else _cpu_ratio(by_id, t.num, t.den))
        ok = verdict(r, t.need) if t.label.endswith("throughput") else (
            "n/a" if r is None else "pass" if r <= t.need else "miss")
        channel.append({"target": t.label, "cell": t.num, "baseline": t.den, "need": t.need,
                        "ratio": r, "verdict": ok})
    return {
        "benchmark": "api",
        "meta": {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
            "host": platform.node(), "python": platform.python_version(),
            "cpus": os.cpu_count(), "quick": quick, "elapsed_s": elapsed,
            "settings": {"rounds": s.rounds, "cell_seconds": s.cell_seconds,
                         "min_ops": s.min_ops, "max_ops": s.max_ops,
                         "max_round_bytes": s.max_round_bytes, "warmup_ops": s.warmup_ops},
            "sizes": list(sizes), "batch": {"count": BATCH_COUNT, "item": BATCH_ITEM},
            "peers": info, "left_out": errors,
            "method": "ops/s: median over rounds of ops / summed op latency; p50/p99: all "
                      "ops pooled; x_*: median of per-round ops/s ratios to the baseline; "
                      "cpu_ms_per_mib: CPU of both ends (this process and the server's) "
                      "per MiB moved, median over rounds; cpu_x_raw: median of per-round "
                      "ratios of it to the raw peer's",
        },
        "cells": rows,
        "targets": targets,
        "channel_targets": channel,
    }


CHANNEL_SIZES = (64 << 10, 1 << 20)


def channel_targets(sizes: Sequence[int]) -> list[Target]:
    """The transfer channel's own targets (issue 27): over TCP at 64 KiB and 1 MiB, put and
    get_into at >= 0.9x the raw peer's throughput ("throughput"), spending <= 1.5x its CPU
    per MiB, both ends counted ("CPU per MiB", a ratio that must stay at or below need)."""
    out: list[Target] = []
    for size in (s for s in sizes if s in CHANNEL_SIZES):
        g, sl = str(size), size_label(size)
        for op, raw_op in (("put", "put"), ("get_into", "get_into"), ("get", "get_into")):
            num, den = f"kvstore-tcp/{op}/{g}", f"raw-tcp/{raw_op}/{g}"
            out.append(Target(f"tcp {op} {sl} vs raw TCP throughput", num, den, 0.9))
            out.append(Target(f"tcp {op} {sl} vs raw TCP CPU per MiB", num, den, 1.5))
    return out


def _group_label(group: str) -> str:
    return (f"{BATCH_COUNT}x{size_label(BATCH_ITEM)}" if group == BATCH
            else size_label(int(group)))


def format_results(res: dict[str, Any]) -> str:
    rows = [[_group_label(r["group"]), r["system"], r["op"], r["ops_per_s"], r["gbps"],
             r["p50_ms"], r["p99_ms"], r["x_redis"], r["x_raw"], r["x_memcpy"],
             r.get("cpu_ms_per_mib"), r.get("cpu_x_raw")]
            for r in res["cells"]]
    main = format_table(["size", "system", "op", "ops/s", "GB/s", "p50 ms", "p99 ms",
                         "x redis", "x raw-tcp", "x memcpy", "CPU ms/MiB", "CPU x raw"], rows,
                        align="lllrrrrrrrrr")
    trows = [[t["target"], t["ratio"], f">= {t['need']}", t["verdict"]]
             for t in res["targets"]]
    tt = format_table(["target (median of paired per-round ratios)", "ratio", "need",
                       "verdict"], trows, align="lrrl")
    crows = [[t["target"], t["ratio"], ("<= " if "CPU" in t["target"] else ">= ")
              + f"{t['need']}", t["verdict"]] for t in res.get("channel_targets", [])]
    if crows:
        tt += "\n\n" + format_table(["transfer channel (issue 27)", "ratio", "need", "verdict"],
                                     crows, align="lrrl")
    m = res["meta"]
    head = (f"kvstore api bench: {m['settings']['rounds']} rounds x "
            f"{m['settings']['cell_seconds']} s per cell, python {m['python']}, "
            f"{m['cpus']} cpus{' (quick)' if m['quick'] else ''}")
    left = "".join(f"\nleft out: {k}: {v}" for k, v in m["left_out"].items())
    left += "".join(f"\nfailed: {r['id']}: {r['error']}" for r in res["cells"] if r["error"])
    return f"{head}{left}\n\n{main}\n\n{tt}"


def plot_results(res: dict[str, Any], path: Path) -> Path:
    cells = {r["id"]: r for r in res["cells"]}
    sizes = [int(x) for x in res["meta"]["sizes"]]

    def series(ids: dict[str, str]) -> dict[str, list[float | None]]:
        out: dict[str, list[float | None]] = {}
        for name, pattern in ids.items():
            ys = [cells.get(pattern.format(g=s), {}).get("gbps") for s in sizes]
            if any(y is not None for y in ys):
                out[name] = ys
        return out

    xs = [s >> 10 for s in sizes]
    xt = [size_label(s) for s in sizes]
    put = series({**{f"kvstore-{t}": f"kvstore-{t}/put/{{g}}" for t in KV_TRANSPORTS},
                  "redis SET": "redis/put/{g}", "raw TCP": "raw-tcp/put/{g}",
                  "memcpy": "memcpy/copy/{g}"})
    get = series({**{f"kvstore-{t} {op}": f"kvstore-{t}/{op}/{{g}}" for t in KV_TRANSPORTS
                     for op in ("get", "get_into")},
                  "redis GET": "redis/get/{g}", "raw TCP recv_into": "raw-tcp/get_into/{g}",
                  "memcpy": "memcpy/copy/{g}"})
    panels = [
        Panel("put, single client", xs, put, xlabel="value size", ylabel="GB/s (median)",
              logx=True, logy=True, xticklabels=xt),
        Panel("get, single client", xs, get, xlabel="value size", ylabel="GB/s (median)",
              logx=True, logy=True, xticklabels=xt),
    ]
    batch = [r for r in res["cells"] if r["group"] == BATCH and r["gbps"] is not None]
    if batch:
        panels.append(Panel(f"batch get {BATCH_COUNT} x {size_label(BATCH_ITEM)}",
                            list(range(len(batch))), {"GB/s": [r["gbps"] for r in batch]},
                            kind="bars", ylabel="GB/s (median)", logy=True, horizontal=True,
                            xticklabels=[f"{r['system']} {r['op']}" for r in batch],
                            height=max(4.2, 0.3 * len(batch))))
    tg = [t for t in res["targets"] if t["ratio"] is not None]
    if tg:
        panels.append(Panel("targets: ratio / needed (>= 1 passes)", list(range(len(tg))),
                            {"ratio / need": [t["ratio"] / t["need"] for t in tg]},
                            kind="bars", xticklabels=[_short(t["target"]) for t in tg],
                            ylabel="ratio / needed", hlines={"needed": 1.0}, horizontal=True,
                            height=max(4.2, 0.22 * len(tg))))
    return plot_panels(path, panels, title="kvstore api bench (loopback, single client)")


def _short(label: str) -> str:
    return label.replace("remote ", "").replace("pipelined GETs", "pipeline")


def _parse_sizes(text: str) -> tuple[int, ...]:
    from kvstore.core.sizes import parse_size  # no network stack: only size parsing

    try:
        sizes = tuple(parse_size(t) for t in text.split(",") if t.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    if not sizes or any(x <= 0 for x in sizes):
        raise argparse.ArgumentTypeError("sizes must be positive")
    return sizes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="kvstore bench api", description=__doc__.split("\n")[0])
    p.add_argument("--quick", action="store_true", help="fewer, shorter rounds (~20 s)")
    p.add_argument("--out-dir", default="benchmarks/results",
                   help="where api_bench.json and api_bench.png go")
    p.add_argument("--sizes", type=_parse_sizes, default=SIZES,
                   help="comma-separated value sizes (default 64KiB,1MiB,4MiB,16MiB)")
    p.add_argument("--transports", default=",".join(KV_TRANSPORTS),
                   help="kvstore transports to measure, comma-separated ('' for none)")
    p.add_argument("--no-redis", action="store_true", help="leave Redis out")
    p.add_argument("--no-raw", action="store_true", help="leave the raw TCP peer out")
    p.add_argument("--no-batch", action="store_true", help="leave the batch get out")
    p.add_argument("--rounds", type=int, help="rounds per cell (default 5, quick 3)")
    p.add_argument("--cell-seconds", type=float,
                   help="time bound of a cell in one round (default 0.25, quick 0.05)")
    args = p.parse_args(argv)
    settings = QUICK if args.quick else FULL
    if args.rounds is not None:
        if args.rounds < 1:
            p.error("--rounds must be >= 1")
        settings = dataclasses.replace(settings, rounds=args.rounds)
    if args.cell_seconds is not None:
        settings = dataclasses.replace(settings, cell_seconds=max(0.0, args.cell_seconds))
    if threading.current_thread() is threading.main_thread():
        # SIGTERM unwinds like Ctrl-C, so the peers are still stopped on the way out.
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    transports = tuple(t for t in args.transports.split(",") if t)
    bad = [t for t in transports if t not in KV_TRANSPORTS]
    if bad:
        p.error(f"unknown transport(s) {bad}; choose from {KV_TRANSPORTS}")
    res = run_api_bench(quick=args.quick, out_dir=args.out_dir, sizes=args.sizes,
                        transports=transports, use_redis=not args.no_redis,
                        use_raw=not args.no_raw, batch=not args.no_batch,
                        settings=settings)
    # A benchmark is not a test: missed targets are reported, not an error. A peer
    # that could not start, or a failed cell, is: its figures are missing.
    failed = res["meta"]["left_out"] or any(r["error"] for r in res["cells"])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
