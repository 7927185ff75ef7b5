"""Sizes and node configuration (defaults < TOML file < flags)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvstore.core.sizes import format_size, parse_size
from kvstore.node.config import NodeConfig, load_config


@pytest.mark.parametrize(("text", "n"), [
    ("4096", 4096), ("64KiB", 65536), ("1GiB", 1 << 30), ("1.5MiB", 3 << 19), ("2g", 2 << 30),
    ("1GB", 10**9), (" 512 MiB ", 512 << 20), ("0", 0), (123, 123), ("8b", 8)])
def test_parse_size(text: str | int, n: int) -> None:
    assert parse_size(text) == n


@pytest.mark.parametrize("bad", ["", "12XB", "-1", "1.3B", "GiB", "1e3", True, -5])
def test_parse_size_rejects(bad: str | int) -> None:
    with pytest.raises(ValueError):
        parse_size(bad)


def test_format_size() -> None:
    assert format_size(1 << 30) == "1.0 GiB"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(10) == "10 B"


def test_defaults() -> None:
    cfg = load_config()
    assert cfg == NodeConfig()
    assert cfg.listen == "127.0.0.1:7600" and cfg.dram_bytes == 1 << 30


def test_file_then_flags(tmp_path: Path) -> None:
    f = tmp_path / "node.toml"
    f.write_text('listen = "127.0.0.1:9000"\ndram-bytes = "256MiB"\npolicy = "prefix"\n'
                 "high_watermark = 0.9\nlow_watermark = 0.8\n")
    cfg = load_config(f, {"listen": "127.0.0.1:9001", "policy": None, "prefault": False})
    assert (cfg.listen, cfg.dram_bytes, cfg.policy, cfg.prefault) == (
        "127.0.0.1:9001", 256 << 20, "prefix", False)
    assert (cfg.high_watermark, cfg.low_watermark) == (0.9, 0.8)
    assert cfg.block_bytes == 64 << 10  # the index budget's block size, by default
    assert load_config(f, {"block_bytes": parse_size("4KiB")}).block_bytes == 4096


@pytest.mark.parametrize(("body", "message"), [
    ("dram_bytes = \"lots\"", "not a size"),
    ("colour = 3", "unknown config key 'colour'"),
    ("policy = \"fifo\"", "policy must be one of"),
    ("grpc_workers = \"8\"", "must be an integer"),
    ("low_watermark = 0.99", "low_watermark <= high_watermark"),
    ("block_bytes = 0", "block_bytes must be positive"),
    ("block-bytes = \"big\"", "not a size"),
    ("listen = ", "not valid TOML"),
])
def test_bad_files_name_the_problem(tmp_path: Path, body: str, message: str) -> None:
    f = tmp_path / "bad.toml"
    f.write_text(body + "\n")
    with pytest.raises(ValueError, match=message):
        load_config(f)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="cannot read config"):
        load_config(tmp_path / "nope.toml")
