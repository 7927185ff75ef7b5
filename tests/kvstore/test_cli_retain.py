"""``kvstore retain`` as a subprocess against a real node: lines, JSON, exit codes, release,
and a bad ``--seconds`` as an error line without a traceback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, start_node

from kvstore import Client


def kvstore(*args: str) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          cwd=REPO, timeout=60)
    assert b"Traceback" not in proc.stderr + proc.stdout, proc.stderr.decode()
    return proc


def test_retain_lines_json_release_and_exit_codes(tmp_path: Path) -> None:
    node = start_node(tmp_path, dram="4MiB")
    try:
        k1, k2 = os.urandom(16), os.urandom(16)
        with Client(node.addr, transport="grpc") as c:
            assert c.put_batch([k1, k2], [b"x" * 4096] * 2) == [True, True]
        stray = os.urandom(16).hex()
        run = kvstore("retain", "--addr", node.addr, "--seconds", "60", k1.hex(), stray)
        assert run.returncode == 1  # not every key was retained
        assert run.stdout.decode() == f"retained {k1.hex()}\nmissing {stray}\n"
        run = kvstore("retain", "--addr", node.addr, "--seconds", "0", "--json", k1.hex(),
                      k2.hex())
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == [{"key": k1.hex(), "outcome": "released"},
                                          {"key": k2.hex(), "outcome": "released"}]
        bad = kvstore("retain", "--addr", node.addr, "--seconds", "-5", k1.hex())
        assert bad.returncode == 1
        (line,) = bad.stderr.decode().splitlines()
        assert line.startswith("kvstore retain: error: retain_s must be finite and >= 0")
    finally:
        assert node.stop() == 0, node.output()
