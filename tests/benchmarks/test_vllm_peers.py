"""benchmarks.vllm_peers without vLLM: the peers' environment and the CPU shim
(``benchmarks/vllm_peers_site/sitecustomize.py``). The servers themselves:
tests/engines/test_vllm_peers.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from contextlib import ExitStack
from pathlib import Path

import pytest

from benchmarks import vllm_peers
from conductor.front.vllm_procs import REPO

needs_two_cpus = pytest.mark.skipif(
    not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="the shim widens a CPU mask: needs thread affinity and two CPUs")


def test_peer_env_puts_the_tree_then_the_shim_then_the_overlay_first() -> None:
    env = vllm_peers.peer_env(Path("/o"), MOONCAKE_CONFIG_PATH="/c.json")
    assert env == {"PYTHONPATH": os.pathsep.join([str(REPO), str(vllm_peers.SHIM), "/o"]),
                   "MOONCAKE_CONFIG_PATH": "/c.json"}
    assert (vllm_peers.SHIM / "sitecustomize.py").is_file()


def test_the_kv_transfer_config_names_vllms_own_connector() -> None:
    cfg = json.loads(vllm_peers.MOONCAKE_KV_TRANSFER)
    assert cfg["kv_connector"] == "MooncakeStoreConnector"
    assert "kv_connector_module_path" not in cfg  # vLLM's registry, not kvstore's code
    assert cfg["kv_role"] == "kv_both"


def fake_mooncake(root: Path) -> Path:
    """A ``mooncake.store`` whose ``setup`` reports the CPU mask it ran with."""
    pkg = root / "mooncake"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "store.py").write_text(textwrap.dedent("""
        import os

        class MooncakeDistributedStore:
            def setup(self, *args):
                return sorted(os.sched_getaffinity(0)), args
        """))
    return root


@needs_two_cpus
@pytest.mark.parametrize("imported_first", [False, True])
def test_setup_runs_on_every_cpu_and_the_callers_mask_comes_back(
        tmp_path: Path, imported_first: bool) -> None:
    """As vLLM's CPU worker does: the main thread pinned to one core, then the store set
    up. The shim run by ``site`` at start-up (first on PYTHONPATH: the import hook), or
    imported after ``mooncake.store`` was (patched at once)."""
    shim = str(vllm_peers.SHIM)
    late = f"import mooncake.store, sys; sys.path.insert(0, {shim!r}); import sitecustomize"
    code = "\n".join([
        "import json, os",
        late if imported_first else "",
        "os.sched_setaffinity(0, {0})",
        "from mooncake.store import MooncakeDistributedStore",
        "during, args = MooncakeDistributedStore().setup('h', 1)",
        "print(json.dumps([during, sorted(os.sched_getaffinity(0)), args]))"])
    path = [str(fake_mooncake(tmp_path))] if imported_first else [shim, str(tmp_path)]
    if not imported_first:
        fake_mooncake(tmp_path)
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE,
                         text=True, env={**os.environ, "PYTHONPATH": os.pathsep.join(path)}
                         ).stdout
    during, after, args = json.loads(out)
    assert during == sorted(os.sched_getaffinity(0)) and len(during) >= 2
    assert after == [0]
    assert args == ["h", 1]


def test_without_the_shim_setup_keeps_the_pinned_mask(tmp_path: Path) -> None:
    """The fake store is a faithful probe: unpatched, it sees the caller's pin."""
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no thread affinity here")
    code = ("import json, os; os.sched_setaffinity(0, {0}); "
            "from mooncake.store import MooncakeDistributedStore as S; "
            "print(json.dumps(S().setup()[0]))")
    out = subprocess.run([sys.executable, "-c", code], check=True, stdout=subprocess.PIPE,
                         text=True, env={**os.environ,
                                         "PYTHONPATH": str(fake_mooncake(tmp_path))}).stdout
    assert json.loads(out) == [0]


def test_lmcache_is_reported_unavailable_before_anything_starts(tmp_path: Path) -> None:
    """Its servers would start and recompute everything (LMCache's degraded mode), so the
    benchmark must hear why instead of measuring a peer that never loads."""
    with ExitStack() as stack, pytest.raises(vllm_peers.PeerUnavailable) as e:
        vllm_peers.start_peer_backend("rr-lmcache", tmp_path, stack)
    assert str(e.value) == vllm_peers.UNAVAILABLE["lmcache"]
    assert "No supported cpu connector found" in str(e.value)
    assert list(tmp_path.iterdir()) == []


def test_offloading_is_reported_unavailable_with_vllms_reason(tmp_path: Path) -> None:
    with ExitStack() as stack, pytest.raises(vllm_peers.PeerUnavailable) as e:
        vllm_peers.start_peer_backend("rr-offloading", tmp_path, stack)
    assert vllm_peers.OFFLOADING_REFUSAL in str(e.value)
    assert list(tmp_path.iterdir()) == []
    cfg = json.loads(vllm_peers.OFFLOADING_KV_TRANSFER)
    assert cfg["kv_connector"] == "OffloadingConnector"


def test_an_unknown_peer_is_refused() -> None:
    with ExitStack() as stack, pytest.raises(ValueError, match="rr-nothing"):
        vllm_peers.start_peer_backend("rr-nothing", Path("/nowhere"), stack)
