"""``kvstore prefetch``, ``serve --max-prefetch-bytes`` and the prefetched line of
``kvstore stat``, as subprocesses against a real node (DRAM over SSD, as in
tests/kvstore/node/test_prefetch_node.py: a put into a full DRAM demotes its 5 oldest)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, start_node

from kvstore import Client

BLOCK = 256 << 10


def kvstore(*args: str) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([sys.executable, "-m", "kvstore", *args], capture_output=True,
                          cwd=REPO, timeout=60)
    assert b"Traceback" not in proc.stderr + proc.stdout, proc.stderr.decode()
    return proc


def test_prefetch_lines_json_exit_codes_and_stat(tmp_path: Path) -> None:
    node = start_node(tmp_path, "--ssd-path", str(tmp_path / "kv.img"), "--ssd-bytes", "64MiB",
                      "--ssd-io", "python", "--high-watermark", "1.0", "--low-watermark", "0.75",
                      "--max-prefetch-bytes", "512KiB", dram="4MiB")
    try:
        keys = [os.urandom(16) for _ in range(17)]
        with Client(node.addr, transport="tcp") as c:
            for k in keys:
                assert c.put(k, os.urandom(BLOCK))
        k1, k2, k3 = (k.hex() for k in keys[:3])
        stray = os.urandom(16).hex()
        run = kvstore("prefetch", "--addr", node.addr, "--wait", k1, k2, k3, stray)
        assert run.returncode == 1  # not every key came up
        assert run.stdout.decode() == (f"promoted {k1}\npromoted {k2}\nbusy {k3}\n"
                                       f"missing {stray}\n")
        run = kvstore("prefetch", "--addr", node.addr, "--json", k1, k2)
        assert run.returncode == 0, run.stderr
        assert json.loads(run.stdout) == [{"key": k1, "outcome": "present"},
                                          {"key": k2, "outcome": "present"}]
        stat = kvstore("stat", "--addr", node.addr).stdout.decode().splitlines()
        assert ("prefetched: 2 present, 2 promoted, 1 missing, 0 no_room, 1 busy, 0 undone; "
                "0 B in flight") in stat
        assert not any("prefetch_blocks" in line for line in stat)  # not again in "node:"
        bad = kvstore("prefetch", "--addr", node.addr, "--tier", "hbm", k1)
        assert bad.returncode == 1
        (line,) = bad.stderr.decode().splitlines()
        assert line.startswith(f"kvstore prefetch: error: {node.addr}: no memory tier named "
                               f"'hbm' here to prefetch to; this node has 'dram' (request id ")
    finally:
        assert node.stop() == 0, node.output()


def test_a_bad_max_prefetch_bytes_is_a_usage_error() -> None:
    proc = kvstore("serve", "--max-prefetch-bytes", "lots")
    assert proc.returncode == 2
    assert proc.stderr.decode().splitlines()[-1].startswith(
        "kvstore serve: error: argument --max-prefetch-bytes: ")
