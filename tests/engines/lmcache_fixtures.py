"""Helpers of the LMCache tests (test_lmcache_*.py), importable without LMCache.

``HAVE_LMCACHE`` tells whether LMCache is installed; with ``KVSTORE_LMCACHE_TESTS=1`` (set by
``make test-lmcache``) a missing LMCache is an error. The functions below import LMCache
(or torch), so call them only when it is there.

The engine the tests drive is LMCache's standalone ``LMCacheEngine``. There is no GPU: its
GPU connector is ``cpu_gpu_connector``, a small CPU one that copies token slices between a
``[2, LAYERS, tokens, HIDDEN]`` CPU tensor and LMCache's chunks (LMCache's own
``MockGPUConnector`` copies nothing, which would not test the bytes).
"""

from __future__ import annotations

import importlib.util
import os
import sys
import time

HAVE_LMCACHE = importlib.util.find_spec("lmcache") is not None
REQUIRED = os.environ.get("KVSTORE_LMCACHE_TESTS") == "1"

if REQUIRED and not HAVE_LMCACHE:
    raise ImportError(
        f"KVSTORE_LMCACHE_TESTS=1 but LMCache is not importable from {sys.executable}: "
        "build the engine environment with scripts/setup-lmcache-env.sh "
        "(make test-lmcache does)")

CHUNK = 16
LAYERS = 2
HEADS = 2
HEAD_DIM = 8
HIDDEN = HEADS * HEAD_DIM


def wait_for(pred, timeout: float = 20.0, what: str = "condition"):
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def cpu_gpu_connector():
    """A GPUConnectorInterface over a CPU tensor ``kvcaches`` [2, LAYERS, tokens, HIDDEN]
    passed to ``store`` / ``retrieve``: token ``start:end`` of it <-> one chunk."""
    import torch
    from lmcache.v1.gpu_connector import GPUConnectorInterface

    class CPUConnector(GPUConnectorInterface):
        def from_gpu(self, memory_obj, start, end, **kwargs):
            t = memory_obj.tensor
            t.copy_(kwargs["kvcaches"][:, :, start:end].reshape(t.shape))

        def to_gpu(self, memory_obj, start, end, **kwargs):
            t = memory_obj.tensor
            dst = kwargs["kvcaches"][:, :, start:end]
            dst.copy_(t.reshape(dst.shape))

        def batched_from_gpu(self, memory_objs, starts, ends, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.from_gpu(m, s, e, **kwargs)

        def batched_to_gpu(self, memory_objs=None, starts=None, ends=None, **kwargs):
            for m, s, e in zip(memory_objs, starts, ends, strict=True):
                self.to_gpu(m, s, e, **kwargs)

        def get_shape(self, num_tokens):
            return torch.Size([2, LAYERS, num_tokens, HIDDEN])

    return CPUConnector()


def metadata():
    import torch
    from lmcache.v1.metadata import LMCacheMetadata

    return LMCacheMetadata(model_name="kvstore-test-model", world_size=1, local_world_size=1,
                           worker_id=0, local_worker_id=0, kv_dtype=torch.float32,
                           kv_shape=(LAYERS, 2, CHUNK, HEADS, HEAD_DIM), chunk_size=CHUNK)


def node_hits(addr: str) -> int:
    from kvstore import Client

    with Client(addr) as c:
        return sum(int(t.get("hits", 0)) for t in c.stats()["tiers"].values())


def tokens_and_kv(n: int, seed: int):
    import torch

    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, 30000, (n,), generator=g)
    kv = torch.randn(2, LAYERS, n, HIDDEN, generator=g)
    return tokens, kv


def key_of(engine, tokens, i: int):
    """The CacheEngineKey of chunk ``i`` of ``tokens`` in ``engine``."""
    keys = [key for _, _, key in engine.token_database.process_tokens(tokens=tokens)]
    return keys[i]
