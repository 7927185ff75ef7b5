"""The connector worker's loader and saver threads, free of the engine's CPU pinning.

vLLM's CPU worker pins its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``), the
worker's main thread among them, and a thread inherits the CPU mask of the thread that
creates it: a loader or saver thread started from the main thread would run only on the
cores the model's compute keeps busy, a save or load progressing only when the compute
yields (``benchmarks.connector_cost`` measured it). Each thread here first widens its own
mask to every CPU the machine has (the kernel keeps only those its cgroup allows), so the
store's transfers run on whatever core is free, beside the compute.

``shorten_gil_switch`` lowers the process's GIL switch interval: while a request waits for
its load, vLLM's engine loop keeps stepping with nothing to compute, holding the GIL in
Python for the interpreter's whole switch interval (5 ms by default) each time; a loader
that gives the GIL up (every store call and every torch copy does) waits that long to get
it back, several times per load. With a spinning Python thread beside it, a 15 MiB load
took 83 ms at 5 ms and 8.5 ms at 0.5 ms (``benchmarks.connector_loads``). The
interval only matters when a thread waits for the GIL, so an engine without loads or
saves in flight is not slowed. No vLLM import.
"""

from __future__ import annotations

import logging
import os
import sys
from concurrent.futures import ThreadPoolExecutor

__all__ = ["GIL_SWITCH_MS", "io_executor", "shorten_gil_switch", "unpin_this_thread"]

logger = logging.getLogger("vllm.kvstore_connector")

GIL_SWITCH_MS = 0.5
"""The worker process's GIL switch interval with the connector (its config key
``gil_switch_interval_ms``; see ``shorten_gil_switch``)."""


def unpin_this_thread() -> None:
    """Lets the calling thread run on every CPU (where the OS supports thread affinity;
    a refusal is logged and the inherited mask kept)."""
    setaffinity = getattr(os, "sched_setaffinity", None)
    if setaffinity is None:
        return
    try:
        setaffinity(0, range(os.cpu_count() or 1))
    except OSError as exc:
        logger.warning("kvstore connector thread keeps its CPU mask: %s", exc)


def io_executor(name: str) -> ThreadPoolExecutor:
    """One thread, named ``name``, that runs on every CPU whoever starts it."""
    return ThreadPoolExecutor(1, thread_name_prefix=name, initializer=unpin_this_thread)


def shorten_gil_switch(interval_s: float) -> float:
    """Sets the GIL switch interval to ``interval_s`` if that is shorter than the current
    one (0 or less: leaves it); returns the interval in force."""
    if 0 < interval_s < sys.getswitchinterval():
        sys.setswitchinterval(interval_s)
    return sys.getswitchinterval()
