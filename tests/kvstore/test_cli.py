"""The ``kvstore`` command line, run as a subprocess against a real node.

Every failure is one line on stderr (``kvstore <cmd>: error: ...``) and exit 1,
or an argparse usage error and exit 2; never a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from conftest import REPO, NodeProcess, free_port

from kvstore import Client


def kvstore(*args: str, stdin: bytes | None = None, timeout: float = 60.0
            ) -> subprocess.CompletedProcess[bytes]:
    proc = subprocess.run([sys.executable, "-m", "kvstore", *args], input=stdin,
                          capture_output=True, cwd=REPO, timeout=timeout)
    assert b"Traceback" not in proc.stderr, proc.stderr.decode()
    assert b"Traceback" not in proc.stdout, proc.stdout.decode()
    return proc


def one_error_line(proc: subprocess.CompletedProcess[bytes], command: str) -> str:
    """The single ``kvstore <command>: error: ...`` line of a failed run."""
    err = proc.stderr.decode()
    lines = err.splitlines()
    assert len(lines) == 1, err
    assert lines[0].startswith(f"kvstore {command}: error: "), err
    return lines[0]


def hexkey() -> str:
    return os.urandom(16).hex()


@pytest.fixture
def value_file(tmp_path: Path) -> tuple[Path, bytes]:
    data = os.urandom(300_000) + b"\n\x00\r\n"  # binary: must survive stdout untouched
    path = tmp_path / "value.bin"
    path.write_bytes(data)
    return path, data


# ---- put / get / rm / stat -------------------------------------------------------------------

def test_put_then_get_to_stdout_and_to_a_file(node: NodeProcess, tmp_path: Path,
                                              value_file: tuple[Path, bytes]) -> None:
    path, data = value_file
    key = hexkey()
    put = kvstore("put", "--addr", node.addr, key, str(path))
    assert put.returncode == 0, put.stderr
    assert put.stdout.decode() == f"stored {key} ({len(data)} bytes)\n"
    assert put.stderr == b""
    again = kvstore("put", "--addr", node.addr, key, str(path))
    assert again.returncode == 0
    assert again.stdout.decode() == f"exists {key} ({len(data)} bytes)\n"

    got = kvstore("get", "--addr", node.addr, key)
    assert got.returncode == 0, got.stderr
    assert got.stdout == data
    assert got.stderr == b""

    out = tmp_path / "out.bin"
    got = kvstore("get", "--addr", node.addr, key, "-o", str(out))
    assert got.returncode == 0, got.stderr
    assert got.stdout == b""
    assert out.read_bytes() == data

    for transport in ("grpc", "tcp", "shm"):
        got = kvstore("get", "--addr", node.addr, "--transport", transport, key)
        assert (got.returncode, got.stdout) == (0, data), transport
    with Client(node.addr) as c:
        assert c.get(bytes.fromhex(key)) == data


def test_put_from_stdin(node: NodeProcess) -> None:
    key = hexkey()
    put = kvstore("put", "--addr", node.addr, key, "-", stdin=b"from stdin")
    assert put.returncode == 0, put.stderr
    assert kvstore("get", "--addr", node.addr, key).stdout == b"from stdin"


def test_rm_present_and_absent_keys(node: NodeProcess) -> None:
    k1, k2, absent = hexkey(), hexkey(), hexkey()
    with Client(node.addr) as c:
        assert c.put(bytes.fromhex(k1), b"one") and c.put(bytes.fromhex(k2), b"two")
    rm = kvstore("rm", "--addr", node.addr, k1)
    assert (rm.returncode, rm.stdout.decode()) == (0, f"removed {k1}\n")
    rm = kvstore("rm", "--addr", node.addr, k1)
    assert (rm.returncode, rm.stdout.decode()) == (1, f"absent {k1}\n")
    rm = kvstore("rm", "--addr", node.addr, k2, absent)
    assert rm.returncode == 1
    assert rm.stdout.decode() == f"removed {k2}\nabsent {absent}\n"
    with Client(node.addr) as c:
        assert c.exists([bytes.fromhex(k1), bytes.fromhex(k2)]) == [False, False]


def test_get_of_an_absent_key(node: NodeProcess, tmp_path: Path) -> None:
    key = hexkey()
    got = kvstore("get", "--addr", node.addr, key)
    assert got.returncode == 1
    assert got.stdout == b""
    assert one_error_line(got, "get") == f"kvstore get: error: key {key} not found"
    out = tmp_path / "never.bin"
    got = kvstore("get", "--addr", node.addr, key, "-o", str(out))
    assert got.returncode == 1
    one_error_line(got, "get")
    assert not out.exists()


def test_stat_table(node: NodeProcess) -> None:
    with Client(node.addr) as c:
        assert c.put(os.urandom(16), b"x" * 1000)
    stat = kvstore("stat", "--addr", node.addr)
    assert stat.returncode == 0, stat.stderr
    lines = stat.stdout.decode().splitlines()
    header = lines[0].split()
    for col in ("tier", "capacity", "used", "blocks", "hits", "misses", "evictions"):
        assert col in header, header
    dram = next(line for line in lines[1:] if line.split()[0] == "dram")
    cells = dict(zip(header, dram.replace(" MiB", "MiB").replace(" KiB", "KiB")
                     .replace(" B", "B").split(), strict=True))
    assert cells["capacity"] == "64.0MiB"
    assert cells["used"] == "1.0KiB"  # 1000 bytes in a 64-byte-aligned extent
    assert (cells["blocks"], cells["hits"], cells["misses"]) == ("1", "0", "0")
    assert lines[-1].startswith("node: ") and "policy=" in lines[-1]


def test_stat_json(node: NodeProcess) -> None:
    key = hexkey()
    with Client(node.addr) as c:
        assert c.put(bytes.fromhex(key), b"y" * 64)
        assert c.get(bytes.fromhex(key)) == b"y" * 64
    stat = kvstore("stat", "--addr", node.addr, "--json")
    assert stat.returncode == 0, stat.stderr
    stats = json.loads(stat.stdout)
    dram = stats["tiers"]["dram"]
    assert dram["capacity"] == 64 << 20
    assert (dram["blocks"], dram["used"], dram["hits"]) == (1, 64, 1)
    assert stats["node"]["policy"] == "lru"


# ---- failures --------------------------------------------------------------------------------

def test_bad_hex_keys(node: NodeProcess, value_file: tuple[Path, bytes]) -> None:
    path, _ = value_file
    for bad in ("zz" * 16, "ab" * 15, "ab" * 17, "abc"):
        for args in (("get", "--addr", node.addr, bad), ("rm", "--addr", node.addr, bad),
                     ("put", "--addr", node.addr, bad, str(path))):
            proc = kvstore(*args)
            assert proc.returncode == 1, (args, proc.stderr)
            assert "key" in one_error_line(proc, args[0])
    proc = kvstore("put", "--addr", node.addr, hexkey(), str(path), "--parent", "00")
    assert proc.returncode == 1
    one_error_line(proc, "put")


def test_put_of_a_missing_file(node: NodeProcess, tmp_path: Path) -> None:
    missing = tmp_path / "no-such-file.bin"
    proc = kvstore("put", "--addr", node.addr, hexkey(), str(missing))
    assert proc.returncode == 1
    line = one_error_line(proc, "put")
    assert "No such file" in line and str(missing) in line


def test_put_of_an_empty_file(node: NodeProcess, tmp_path: Path) -> None:
    empty = tmp_path / "empty.bin"
    empty.write_bytes(b"")
    proc = kvstore("put", "--addr", node.addr, hexkey(), str(empty))
    assert proc.returncode == 1
    assert "empty" in one_error_line(proc, "put")


def test_unreachable_address() -> None:
    addr = f"127.0.0.1:{free_port()}"  # nobody listens here
    key = hexkey()
    for args in (("get", key), ("rm", key), ("stat",), ("stat", "--json")):
        proc = kvstore(args[0], "--addr", addr, "--timeout", "2", *args[1:], timeout=30)
        assert proc.returncode == 1, (args, proc.stderr)
        assert proc.stdout == b""
        assert addr in one_error_line(proc, args[0])


def test_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (("serve", "--dram-bytes", "12XB"), ("serve", "--policy", "fifo"),
                 ("get",), ("frobnicate",), ("stat", "--timeout", "soon")):
        proc = kvstore(*args)
        assert proc.returncode == 2, (args, proc.stderr)
        assert b"usage:" in proc.stderr
    proc = kvstore("serve", "--dram-bytes", "12XB")
    assert b"12XB" in proc.stderr


# ---- serve --config ------------------------------------------------------------------------

@contextmanager
def serve(tmp_path: Path, *args: str) -> Iterator[subprocess.Popen[bytes]]:
    log = tmp_path / f"serve-{time.monotonic_ns()}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--no-prefault",
                                 *args], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        deadline = time.monotonic() + 30
        while b"kvstore: serving on" not in log.read_bytes():
            assert proc.poll() is None, log.read_text()
            assert time.monotonic() < deadline, log.read_text()
            time.sleep(0.02)
        yield proc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == 0, log.read_text()
        assert "Traceback" not in log.read_text()


def test_config_file_with_a_flag_overriding_it(tmp_path: Path) -> None:
    config_port, flag_port = free_port(), free_port()
    config = tmp_path / "node.toml"
    config.write_text(f'listen = "127.0.0.1:{config_port}"\n'
                      'dram_bytes = "24MiB"\n'
                      'policy = "lfu"\n'
                      'drain-timeout = 2.5\n')
    addr = f"127.0.0.1:{flag_port}"
    with serve(tmp_path, "--config", str(config), "--listen", addr):
        stat = kvstore("stat", "--addr", addr, "--json")
        assert stat.returncode == 0, stat.stderr
        stats = json.loads(stat.stdout)
        assert stats["tiers"]["dram"]["capacity"] == 24 << 20
        # Start-up's objects are frozen out of the collector once the node serves.
        assert stats["node"]["gc_frozen_objects"] > 1000
        assert stats["node"]["policy"] == "lfu"
        nobody = kvstore("stat", "--addr", f"127.0.0.1:{config_port}", "--timeout", "2")
        assert nobody.returncode == 1  # the flag won: nothing on the config's address
        one_error_line(nobody, "stat")


def test_config_flag_overrides_a_config_size(tmp_path: Path) -> None:
    config = tmp_path / "node.toml"
    config.write_text('dram_bytes = "24MiB"\npolicy = "prefix"\n')
    addr = f"127.0.0.1:{free_port()}"
    with serve(tmp_path, "--config", str(config), "--listen", addr, "--dram-bytes", "12MiB"):
        stats = json.loads(kvstore("stat", "--addr", addr, "--json").stdout)
        assert stats["tiers"]["dram"]["capacity"] == 12 << 20
        assert stats["node"]["policy"] == "prefix"


@pytest.mark.parametrize(("text", "named"), [
    ('dram_bytes = "16MiB"\ncache_size = 5\n', "cache_size"),
    ('dram_bytes = "16MiB"\n[tiers]\nssd = 1\n', "tiers"),
])
def test_unknown_config_key(tmp_path: Path, text: str, named: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    proc = kvstore("serve", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    line = one_error_line(proc, "serve")
    assert f"'{named}'" in line


@pytest.mark.parametrize(("text", "words"), [
    ('dram_bytes = "12XB"\n', "12XB"),
    ('policy = "fifo"\n', "policy"),
    ('grpc_workers = "many"\n', "grpc_workers"),
    ("dram_bytes = \n", "TOML"),
])
def test_bad_config_values(tmp_path: Path, text: str, words: str) -> None:
    config = tmp_path / "bad.toml"
    config.write_text(text)
    proc = kvstore("serve", "--config", str(config), "--listen", f"127.0.0.1:{free_port()}")
    assert proc.returncode == 1
    assert words in one_error_line(proc, "serve")


def test_missing_config_file(tmp_path: Path) -> None:
    proc = kvstore("serve", "--config", str(tmp_path / "nope.toml"))
    assert proc.returncode == 1
    assert "nope.toml" in one_error_line(proc, "serve")


def test_kv_events_keygen_writes_a_pair_once(tmp_path: Path) -> None:
    from kvstore.auth.curve import load_keypair, load_public_key

    proc = kvstore("kv-events", "keygen", str(tmp_path / "keys"), "--name", "router")
    assert proc.returncode == 0, proc.stderr.decode()
    public, secret = tmp_path / "keys" / "router.key", tmp_path / "keys" / "router.key_secret"
    assert str(public) in proc.stdout.decode() and str(secret) in proc.stdout.decode()
    assert load_keypair(secret).public == load_public_key(public)
    before = secret.read_bytes()
    again = kvstore("kv-events", "keygen", str(tmp_path / "keys"), "--name", "router")
    assert again.returncode == 1
    assert one_error_line(again, "kv-events") == (
        f"kvstore kv-events: error: {public} exists: not overwriting a key")
    assert secret.read_bytes() == before
    assert kvstore("kv-events").returncode == 2  # an action is required
