"""Put first on ``PYTHONPATH`` of a peer vLLM server (``benchmarks.vllm_peers``) only.

One patch, for Mooncake Store on vLLM's CPU worker: ``mooncake.store``'s
``MooncakeDistributedStore.setup`` runs with the calling thread's CPU mask widened to
every CPU, then restores it. Why: vLLM's CPU worker pins its main thread to its OpenMP
cores (``VLLM_CPU_OMP_THREADS_BIND``), and a thread inherits the mask of the thread that
creates it. ``setup`` starts the transfer engine's threads (its TCP acceptor and I/O
threads among them); left pinned, they share one core with the worker's busy threads,
and on this 2-core machine another server's TCP writes into that server's segment sat
unaccepted for the transfer engine's whole 30 s progress timeout (the connections stayed
in the listen backlog; ``batch_put failed ... codes={-800}``), in 2 of 3 runs. kvstore's
own connector widens its I/O threads the same way (``kvstore.integrations.vllm.threads``),
so this gives the peer what kvstore gives itself. Nothing else is changed; vLLM's
installed files are not touched (the CPU worker already replaces ``torch.cuda.Event``
with a no-op, ``vllm/v1/worker/cpu/shm.py``, so the connector's ``wait_for_save`` needs
no shim). The patch is applied when ``mooncake.store`` is first imported (an import hook
removed after use), so a process that never imports it is unchanged.
Tests: ``tests/benchmarks/test_vllm_peers.py``.
"""

from __future__ import annotations

import contextlib
import importlib.abc
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator, Sequence
from types import ModuleType
from typing import Any

TARGET = "mooncake.store"


@contextlib.contextmanager
def all_cpus() -> Iterator[None]:
    """The calling thread may run on every CPU inside the block (the kernel keeps the
    ones its cgroup allows); its own mask is restored after."""
    get = getattr(os, "sched_getaffinity", None)
    put = getattr(os, "sched_setaffinity", None)
    if get is None or put is None:
        yield
        return
    before = get(0)
    try:
        put(0, range(os.cpu_count() or 1))
    except OSError:
        yield
        return
    try:
        yield
    finally:
        put(0, before)


def patch(module: ModuleType) -> None:
    cls = module.MooncakeDistributedStore
    setup = cls.setup

    def unpinned_setup(self: Any, *args: Any, **kwargs: Any) -> Any:
        with all_cpus():
            return setup(self, *args, **kwargs)

    cls.setup = unpinned_setup


class _Loader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self.inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self.inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self.inner.exec_module(module)
        patch(module)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname: str, path: Sequence[str] | None,
                  target: ModuleType | None = None) -> importlib.machinery.ModuleSpec | None:
        if fullname != TARGET:
            return None
        sys.meta_path.remove(self)  # once: the real finders locate it
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _Loader(spec.loader)
        return spec


def install() -> None:
    """The hook, unless ``mooncake.store`` is imported already (then it is patched now)."""
    if TARGET in sys.modules:
        patch(sys.modules[TARGET])
    else:
        sys.meta_path.insert(0, _Finder())


if __name__ == "sitecustomize":  # run by ``site`` at start-up; a test imports it by path
    install()
