"""The raw O_DIRECT baselines of ``benchmarks.ssd_bench``: the same file, no tier.

Sequential: aligned ``pwrite``/``preadv`` over the tier's offsets at several queue
depths (a plain loop at QD1, threads above it, and io_uring through the tier's own
native helper with no checksum or index work). Random: 32 threads issuing ``preadv``
back to back, and io_uring at QD32.

Destination memory. A read baseline lands its blocks in as many distinct buffers as
the tier's read call fills (``dests``), block ``i`` in buffer ``i % dests``. On the
virtio disk measured here the destination's footprint alone moves raw sequential reads
by up to 1.9x: ``preadv`` of 1 MiB blocks into one reused buffer ran at 1.5-2.3 GB/s,
into 32 rotating buffers at 1.2-1.3 GB/s, and reading into two hot buffers then
copying out was slower still (1.1 GB/s). A reader that returns 32 blocks cannot put
them in one buffer, so the limit is measured with the same footprint as the tier;
the one-buffer loop is still run and reported, as a reference only.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from tiers.ssd.io import load_uring

GB = 1e9
RAW_QDS = (1, 4, 32)


def aligned(n: int, fill: bool) -> mmap.mmap:
    """A page-aligned buffer (the tier writes it in place under O_DIRECT)."""
    m = mmap.mmap(-1, n)
    if fill:
        m[:] = os.urandom(n)
    return m


def uring_lib() -> Any:
    """The native helper module, or None when it is not built."""
    module, _ = load_uring()
    return module


def run_workers(worker: Callable[[int], None], n: int) -> None:
    """``worker(0..n-1)`` on ``n`` threads (inline when ``n`` is 1); re-raises the first error."""
    if n == 1:
        worker(0)
        return
    with ThreadPoolExecutor(max_workers=n) as pool:
        for f in [pool.submit(worker, w) for w in range(n)]:
            f.result()


def _read_buffers(size: int, n: int, qd: int, dests: int) -> list[mmap.mmap]:
    return [aligned(size, fill=False) for _ in range(min(n, max(qd, dests)))]


def raw_uring(fd: int, size: int, offsets: Sequence[int], qd: int, *, write: bool,
              src: mmap.mmap | None = None, batch: int = 0, dests: int = 1) -> float:
    """GB/s of io_uring over ``offsets`` with ``qd`` in flight (no checksums): one run
    refilling as each op completes or, with ``batch``, runs of ``batch`` ops each
    waited for in full before the next starts (the queue drains in between).

    Reads land in ``max(qd, dests)`` buffers round robin; writes all send ``src``.
    Writes end with one fdatasync, as the tier's batches do.
    """
    module = uring_lib()
    ffi, lib, n = module.ffi, module.lib, len(offsets)
    reads = [] if write else _read_buffers(size, n, qd, dests)
    bufs = [src] if write else reads
    pins = [ffi.from_buffer(b) for b in bufs]
    iovs = ffi.new("struct iovec[]", n)
    for i in range(n):
        iovs[i].iov_base = pins[i % len(pins)]
        iovs[i].iov_len = size
    is_write = ffi.new("unsigned char[]", [write] * n)
    offs = ffi.new("int64_t[]", list(offsets))
    counts = ffi.new("int[]", [1] * n)
    results = ffi.new("int64_t[]", n)
    ringp = ffi.new("struct kv_ring **")
    if lib.kv_ring_open(qd, ringp) < 0:
        raise RuntimeError("io_uring_queue_init failed")
    try:
        step = batch or n
        rc = 0
        t0 = time.perf_counter()
        for k in range(0, n, step):
            m = min(step, n - k)
            rc = rc or lib.kv_ring_run(ringp[0], fd, m, is_write + k, offs + k, iovs + k,
                                       counts + k, results + k, qd)
        if write:
            os.fdatasync(fd)
        dt = time.perf_counter() - t0
    finally:
        lib.kv_ring_close(ringp[0])
    if rc < 0 or any(r != size for r in results):
        raise RuntimeError("raw io_uring transfer failed")
    del pins
    for b in reads:
        b.close()
    return n * size / dt / GB


def raw_threads(fd: int, size: int, offsets: Sequence[int], qd: int, *, write: bool,
                src: mmap.mmap | None, dests: int = 1) -> tuple[float, list[float]]:
    """GB/s of ``qd`` threads (a plain loop if 1) moving ``offsets`` back to back, and
    per-request latencies. Reads land in ``max(qd, dests)`` buffers, block ``i`` in
    buffer ``i % count``. Writes send ``src`` (required then; reads ignore it) and end
    with one fdatasync."""
    if write and src is None:
        raise ValueError("raw_threads: a write needs src")
    lat: list[float] = []
    lock = threading.Lock()
    bufs = [] if write else _read_buffers(size, len(offsets), qd, dests)

    def worker(w: int) -> None:
        mine: list[float] = []
        for i in range(w, len(offsets), qd):
            off = offsets[i]
            t0 = time.perf_counter()
            if write:
                assert src is not None  # checked above
                n = os.pwrite(fd, src, off)
            else:
                n = os.preadv(fd, [bufs[i % len(bufs)]], off)
            if n != size:
                raise RuntimeError("short raw transfer")
            mine.append(time.perf_counter() - t0)
        with lock:
            lat.extend(mine)

    t_start = time.perf_counter()
    run_workers(worker, qd)
    if write:
        os.fdatasync(fd)
    gbps = len(offsets) * size / (time.perf_counter() - t_start) / GB
    for b in bufs:
        b.close()
    return gbps, lat


def raw_sequential(path: Path, size: int, n: int, src: mmap.mmap,
                   qds: Sequence[int] = RAW_QDS, *, dests: int = 1) -> dict[str, Any]:
    """The raw O_DIRECT limit over the same offsets: every variant, and the best.

    Reads land in ``dests`` buffers (the tier's read call's blocks); the one-buffer QD1
    loop is reported as ``raw_read_one_buffer_gbps``, never as the limit.
    """
    offsets = [i * size for i in range(n)]
    variants: dict[str, dict[str, float]] = {"write": {}, "read": {}}
    lats: dict[str, list[float]] = {}
    fd = os.open(path, os.O_RDWR | os.O_DIRECT)
    try:
        for qd in qds:
            for kind in ("write", "read"):
                gbps, lat = raw_threads(fd, size, offsets, qd, write=kind == "write", src=src,
                                        dests=dests)
                variants[kind][f"threads_qd{qd}" if qd > 1 else "qd1"] = gbps
                if qd == min(qds):
                    lats[kind] = lat
            if qd > 1 and uring_lib() is not None:
                for kind in ("write", "read"):
                    variants[kind][f"uring_qd{qd}"] = raw_uring(
                        fd, size, offsets, qd, write=kind == "write", src=src, dests=dests)
        one_buffer, _ = raw_threads(fd, size, offsets, 1, write=False, src=src, dests=1)
    finally:
        os.close(fd)
    out: dict[str, Any] = {"raw_read_one_buffer_gbps": one_buffer}
    for kind in ("write", "read"):
        best = max(variants[kind], key=variants[kind].__getitem__)
        out[f"raw_{kind}_gbps"] = variants[kind][best]
        out[f"raw_{kind}_best"] = best
        out[f"raw_{kind}_variants_gbps"] = variants[kind]
        out[f"raw_{kind}_op_ms_p50"] = pct_ms(lats[kind], 0.5)
        out[f"raw_{kind}_op_ms_p99"] = pct_ms(lats[kind], 0.99)
    return out


def raw_random_threads(path: Path, size: int, offsets: Sequence[int],
                       qd: int) -> tuple[float, list[float]]:
    """GB/s of ``qd`` threads each issuing raw O_DIRECT preadv back to back (always
    ``qd`` in flight, one buffer each), and per-request latencies."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECT)
    try:
        return raw_threads(fd, size, offsets, qd, write=False, src=None, dests=qd)
    finally:
        os.close(fd)


def pct_ms(samples: Sequence[float], q: float) -> float:
    """The q-quantile (nearest rank) of samples, in milliseconds."""
    if not samples:
        return float("nan")
    s = sorted(samples)
    return 1e3 * s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]
