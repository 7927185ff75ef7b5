"""``kvstore put --retain S``, ``serve --max-retained-fraction F`` and the retained line of
``kvstore stat``, as a subprocess against a real node."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, start_node


def kvstore(*args: str) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          cwd=REPO, timeout=60)
    assert b"Traceback" not in proc.stderr + proc.stdout, proc.stderr.decode()
    return proc


def test_put_retain_and_stat(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--max-retained-fraction", "0.25", dram="8MiB")
    try:
        blob = tmp_path / "blob"
        blob.write_bytes(os.urandom(4096))
        k1, k2 = os.urandom(16).hex(), os.urandom(16).hex()
        put = kvstore("put", "--addr", node.addr, k1, str(blob), "--retain", "600")
        assert put.returncode == 0, put.stderr
        assert put.stdout.decode() == f"stored {k1} (4096 bytes, retain 600 s)\n"
        plain = kvstore("put", "--addr", node.addr, "--transport", "grpc", k2, str(blob))
        assert plain.stdout.decode() == f"stored {k2} (4096 bytes)\n"
        stat = kvstore("stat", "--addr", node.addr)
        lines = stat.stdout.decode().splitlines()
        assert "retained: 1 blocks, 4.0 KiB of 2.0 MiB allowed, 0 refused" in lines
        js = json.loads(kvstore("stat", "--addr", node.addr, "--json").stdout)["node"]
        assert (js["retained_blocks"], js["retained_bytes"], js["retained_cap_bytes"],
                js["retention_denied"]) == (1, 4096, 2 << 20, 0)
    finally:
        node.stop()


@pytest.mark.parametrize(("value", "reason"), [
    ("-1", "--retain must be finite and >= 0, got -1.0"),
    ("inf", "--retain must be finite and >= 0, got inf"),
    ("604801", "--retain 604801.0 is over the limit of 604800 s (7 days)"),
    ("soon", "could not convert string to float: 'soon'"),
])
def test_put_refuses_a_bad_retain_without_a_traceback(tmp_path: Path, value: str,
                                                      reason: str) -> None:
    blob = tmp_path / "blob"
    blob.write_bytes(b"x")
    proc = kvstore("put", "--addr", "127.0.0.1:1", os.urandom(16).hex(), str(blob),
                   "--retain", value)
    assert proc.returncode == 2
    assert proc.stderr.decode().splitlines()[-1] == (
        f"kvstore put: error: argument --retain: {reason}")


def test_serve_refuses_a_fraction_outside_0_1() -> None:
    proc = kvstore("serve", "--listen", "127.0.0.1:0", "--max-retained-fraction", "1.5")
    assert proc.returncode == 1
    assert proc.stderr.decode() == (
        "kvstore serve: error: max_retained_fraction must be in [0, 1], got 1.5\n")
