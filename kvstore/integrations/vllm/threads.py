"""The connector worker's loader and saver threads, free of the engine's CPU pinning.

vLLM's CPU worker pins its OpenMP threads to cores (``VLLM_CPU_OMP_THREADS_BIND``), the
worker's main thread among them, and a thread inherits the CPU mask of the thread that
creates it: a loader or saver thread started from the main thread would run only on the
cores the model's compute keeps busy, a save or load progressing only when the compute
yields (``benchmarks.connector_cost`` measured it). Each thread here first widens its own
mask to every CPU the machine has (the kernel keeps only those its cgroup allows), so the
store's transfers run on whatever core is free, beside the compute. No vLLM import.
"""

from __future__ import annotations

import logging
import os
from concurrent.futures import ThreadPoolExecutor

__all__ = ["io_executor", "unpin_this_thread"]

logger = logging.getLogger("vllm.kvstore_connector")


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
