"""The paths users write down keep working after a move: engine configs' module paths, the
documented Python API, the console scripts and the ``python -m`` commands.

An engine's own module path (vLLM's ``kv_connector_module_path``, SGLang's and LMCache's
``module_path``) imports that engine, which the main environment does not have: here its
old path is checked to name the new module without running it; each engine's tests load
the old path in the real engine (``tests/engines``: vLLM through ``vllm_llm.py``, SGLang
through ``sglang_fixtures.py``, LMCache through its plugin setting, Mooncake by import).
"""

from __future__ import annotations

import ast
import importlib
import importlib.metadata
import importlib.util
import re
from pathlib import Path

import pytest
from conftest import REPO

# old path -> the module it is now (the shim files at the old paths)
ENGINE_PATHS = {
    "kvstore.integrations.vllm_connector": ("kvstore.integrations.vllm.connector",
                                            "KVStoreConnector"),
    "kvstore.integrations.sglang_hicache": ("kvstore.integrations.sglang.hicache",
                                            "KVStoreHiCacheStorage"),
    "kvstore.integrations.lmcache_connector": ("kvstore.integrations.lmcache.connector",
                                               "KVStoreRemoteConnector"),
}
IMPORTABLE_PATHS = {
    "kvstore.integrations.mooncake_compat": ("kvstore.integrations.mooncake.store",
                                             "MooncakeDistributedStore"),
    "kvstore.kv_event_subscriber": ("kvstore.remote.kv_event_subscriber",
                                    "KVEventSubscriber"),
}


def _shim_target(old: str) -> str:
    """The module a shim file hands on: ``from PARENT import LEAF`` then
    ``sys.modules[__name__] = LEAF``."""
    tree = ast.parse((REPO / (old.replace(".", "/") + ".py")).read_text())
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module != "sys"]
    assert len(imports) == 1 and len(imports[0].names) == 1, old
    assert any(isinstance(n, ast.Assign) and ast.unparse(n) ==
               f"sys.modules[__name__] = {imports[0].names[0].name}" for n in tree.body), old
    return f"{imports[0].module}.{imports[0].names[0].name}"


@pytest.mark.parametrize("old", sorted(ENGINE_PATHS | IMPORTABLE_PATHS))
def test_an_old_path_hands_on_the_new_module(old: str) -> None:
    new, cls = (ENGINE_PATHS | IMPORTABLE_PATHS)[old]
    assert _shim_target(old) == new
    spec = importlib.util.find_spec(new)
    assert spec is not None and spec.origin is not None
    assert re.search(rf"^class {cls}\b", Path(spec.origin).read_text(), re.M)


@pytest.mark.parametrize("old", sorted(IMPORTABLE_PATHS))
def test_an_old_path_is_the_same_module(old: str) -> None:
    new, cls = IMPORTABLE_PATHS[old]
    before = importlib.import_module(old)
    assert before is importlib.import_module(new)
    assert getattr(before, cls) is getattr(importlib.import_module(new), cls)
    assert before.__name__ == new


def test_the_package_face() -> None:
    from kvstore import (
        BlockKey,
        Client,
        InvalidArgument,
        KVStoreError,
        ResourceExhausted,
        Unavailable,
        block_keys,
        namespace_root_key,
    )
    from kvstore.client import Client as FacadeClient
    assert Client is FacadeClient
    assert issubclass(InvalidArgument, KVStoreError)
    assert issubclass(ResourceExhausted, KVStoreError)
    assert issubclass(Unavailable, KVStoreError)
    keys = block_keys(list(range(32)), block_tokens=16, namespace="m")
    assert len(keys) == 2 and all(isinstance(k, bytes) and len(k) == 16 for k in keys)
    assert BlockKey is not None and len(namespace_root_key("m")) == 16


@pytest.mark.parametrize("script, target", [("kvstore", "kvstore.cli:main"),
                                            ("conductor", "conductor.cli:main")])
def test_console_scripts(script: str, target: str) -> None:
    (entry,) = [e for e in importlib.metadata.entry_points(group="console_scripts")
                if e.name == script]
    assert entry.value == target
    assert callable(entry.load())


@pytest.mark.parametrize("module", [
    "kvstore", "kvstore.demo", "conductor", "conductor.demo_vllm", "workers",
    "cffi_build.uring_build", "cffi_build.channel_build", "cffi_build.block_index_build",
    "benchmarks.vllm_serving",
    "benchmarks.tls_bench",
    "benchmarks.conductor_bench", "benchmarks.placement_bench", "benchmarks.kv_events_bench",
    "benchmarks.retention_bench", "benchmarks.serving_ttft", "benchmarks.mooncake_sessions",
    "benchmarks.ssd_bench", "benchmarks.put_profile", "benchmarks.trace_replay",
    "benchmarks.soak", "benchmarks.index_scale", "benchmarks.cluster_scale",
    "benchmarks.ssd_restart"])
def test_python_dash_m_commands_exist(module: str) -> None:
    """``python -m MODULE`` as the docs, the Makefile and deploy/ write it."""
    spec = importlib.util.find_spec(module)
    assert spec is not None
    if spec.submodule_search_locations is not None:  # a package runs its __main__
        assert importlib.util.find_spec(f"{module}.__main__") is not None
