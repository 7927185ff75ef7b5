"""Helpers of the SGLang HiCache tests (test_sglang_*.py), importable without SGLang.

``HAVE_SGLANG`` tells whether SGLang is installed; ``REQUIRED`` is set by ``make
test-sglang`` (``KVSTORE_SGLANG_TESTS=1``): there a missing SGLang is an error. The
functions below import SGLang, so call them only when it is there.
"""

from __future__ import annotations

import importlib.util
import os
import sys

HAVE_SGLANG = importlib.util.find_spec("sglang") is not None
REQUIRED = os.environ.get("KVSTORE_SGLANG_TESTS") == "1"

PAGE = 16
LAYERS = 3
HEADS = 2
HEAD_DIM = 32


def import_torchvision_without_ops() -> None:
    """Makes ``import torchvision`` work next to CPU torch (SGLang imports it).

    PyPI has only CUDA builds of torchvision; next to the CPU torch its C ops cannot
    load, which torchvision tolerates except that its ``_meta_registrations`` registers
    fake kernels for ``torchvision::nms`` / ``qnms`` unconditionally and fails on the
    missing operators. Declaring those two schemas first lets the import finish; the ops
    stay unimplemented (nothing here calls them). A torchvision whose ops load is left
    alone."""
    import torch

    try:
        import torchvision
        return
    except RuntimeError as e:
        if "torchvision::nms" not in str(e):
            raise
    for name in [m for m in sys.modules if m == "torchvision" or m.startswith("torchvision.")]:
        del sys.modules[name]
    lib = torch.library.Library("torchvision", "FRAGMENT")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    import_torchvision_without_ops.lib = lib  # type: ignore[attr-defined]  # keep it alive
    import torchvision  # noqa: F401


def device_pool(*, dtype=None, size: int = 512):
    """A real ``MHATokenToKVPool`` on CPU (3 layers, 2 heads of 32, page 16)."""
    import torch
    from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool

    return MHATokenToKVPool(size, PAGE, dtype or torch.float16, HEADS, HEAD_DIM, LAYERS,
                            "cpu", False, start_layer=0, end_layer=LAYERS)


def host_pool(kv, layout: str, allocator: str):
    """SGLang's ``MHATokenToKVPoolHost`` over ``kv``, built as SGLang's pool assembler
    does (host/device ratio 2), unpinned (no CUDA here)."""
    from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost

    return MHATokenToKVPoolHost(
        kv.get_device_pool_infos()[0].buffer_info, 2.0, 0, PAGE, layout,
        pin_memory=False, device="cpu", allocator_type=allocator,
        device_capacity_tokens=kv.size if kv.host_capacity_tokens is None
        else kv.host_capacity_tokens,
        start_layer=kv.start_layer, end_layer=kv.end_layer,
        write_back_staging=kv.hicache_write_back_staging)


def storage_config(extra: dict, *, tp_rank: int = 0, tp_size: int = 1,
                   layout: str = "page_first", model: str = "tiny-test"):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig

    return HiCacheStorageConfig(
        tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1, attn_cp_rank=0,
        attn_cp_size=1, is_mla_model=False, enable_storage_metrics=False,
        is_page_first_layout=layout == "page_first", model_name=model, extra_config=extra)


def dynamic_extra(addr: str, **more) -> dict:
    """The extra config a user passes with ``--hicache-storage-backend dynamic``."""
    return {"backend_name": "kvstore", "module_path": "kvstore.integrations.sglang_hicache",
            "class_name": "KVStoreHiCacheStorage", "interface_v1": 1,
            "kvstore_addr": addr, **more}


def create_backend(extra: dict, host, **cfg):
    """The backend as SGLang's cache controller attaches it: the factory's ``dynamic``
    path, then ``register_mem_pool_host`` and ``on_host_pools_registered``."""
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    backend = StorageBackendFactory.create_backend(
        "dynamic", storage_config(extra, layout=host.layout, **cfg), host)
    backend.register_mem_pool_host(host)
    backend.on_host_pools_registered()
    return backend
