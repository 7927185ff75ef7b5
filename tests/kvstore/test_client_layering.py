"""The client library's layering: importing it loads no node, server or tier code."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _modules_after(statement: str) -> list[str]:
    code = (f"import sys, json\n{statement}\n"
            "print(json.dumps(sorted(m for m in sys.modules "
            "if m.split('.')[0] in ('kvstore', 'tiers', 'replication'))))")
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", code], env=env, check=True,
                         capture_output=True, text=True, timeout=60)
    return json.loads(out.stdout)


def test_importing_the_node_client_loads_no_tier_node_or_server_module() -> None:
    loaded = _modules_after("import kvstore.remote.node_client")
    assert "kvstore.remote.node_client" in loaded
    assert [m for m in loaded if m == "tiers" or m.startswith("tiers.")] == []
    assert "kvstore.node.semantics" not in loaded
    assert "kvstore.server" not in loaded
    assert "kvstore.node.channel_server" not in loaded
    assert [m for m in loaded if m.startswith("replication")] == []


def test_importing_the_client_loads_no_tier_node_or_server_module() -> None:
    loaded = _modules_after("import kvstore.client")
    assert "kvstore.client" in loaded
    assert [m for m in loaded if m == "tiers" or m.startswith("tiers.")] == []
    assert "kvstore.node.semantics" not in loaded
    assert "kvstore.server" not in loaded
    assert "kvstore.node.channel_server" not in loaded


def test_the_cluster_client_loads_no_tier_node_or_server_module() -> None:
    loaded = _modules_after("import replication.cluster_client")
    assert "replication.cluster_client" in loaded
    assert [m for m in loaded if m == "tiers" or m.startswith("tiers.")] == []
    assert {"kvstore.node.semantics", "kvstore.server", "kvstore.node.channel_server",
            "replication.copies.replicator", "replication.copies.forwarder"}.isdisjoint(loaded)
