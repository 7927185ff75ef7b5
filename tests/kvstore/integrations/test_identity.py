"""``kvstore.integrations.identity``: what the weights' fingerprint reads, what changes it
and what does not, where checkpoints are found, and the identities built on it.

Checkpoints are written here byte by byte (safetensors is a JSON header and raw bytes),
so every offset the fingerprint samples is known."""

from __future__ import annotations

import json
import logging
import os
import shutil
import struct
from pathlib import Path

import pytest

from kvstore.integrations import identity
from kvstore.integrations.identity import (
    TENSOR_WINDOW,
    NoWeights,
    find_checkpoint,
    fingerprint_checkpoint,
    identity_digest,
    process_value,
    weights_identity,
)


def write_safetensors(path: Path, tensors: dict[str, bytes], metadata: dict | None = None
                      ) -> dict[str, int]:
    """A safetensors file of uint8 tensors; the file offset of each tensor's data."""
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name, data in tensors.items():
        header[name] = {"dtype": "U8", "shape": [len(data)],
                        "data_offsets": [offset, offset + len(data)]}
        offset += len(data)
    raw = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        starts = {}
        for name, data in tensors.items():
            starts[name] = f.tell()
            f.write(data)
    return starts


def pattern(n: int, seed: int) -> bytes:
    return bytes((i * 31 + seed * 7) % 251 for i in range(n))


BIG = 10_000  # larger than three windows: sampled
SMALL = 700  # at most three windows: hashed whole


def checkpoint(root: Path, seed: int = 0, *, config: dict | None = None) -> dict[str, int]:
    """A two-file checkpoint with a config; the file offset of each tensor's data."""
    root.mkdir(parents=True, exist_ok=True)
    (root / "config.json").write_text(json.dumps(config or {"model_type": "llama"}))
    starts = write_safetensors(root / "model-00001-of-00002.safetensors",
                               {"a.weight": pattern(BIG, seed), "a.k_scale": pattern(4, seed)})
    starts.update(write_safetensors(root / "model-00002-of-00002.safetensors",
                                    {"b.weight": pattern(SMALL, seed + 1)}))
    (root / "tokenizer.json").write_text("{}")  # not weights: not read
    return starts


def poke(path: Path, offset: int) -> None:
    """Flips one byte of ``path`` in place (same size)."""
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0xFF]))


def digest(path: Path) -> str:
    return fingerprint_checkpoint(path).digest


FILE1 = "model-00001-of-00002.safetensors"
FILE2 = "model-00002-of-00002.safetensors"


def test_same_bytes_anywhere_same_fingerprint(tmp_path: Path) -> None:
    checkpoint(tmp_path / "a")
    shutil.copytree(tmp_path / "a", tmp_path / "elsewhere")
    fp = fingerprint_checkpoint(tmp_path / "a")
    assert fp == fingerprint_checkpoint(tmp_path / "elsewhere")
    assert len(fp.digest) == 32 and (fp.files, fp.tensors) == (3, 3)


def test_same_shapes_other_values_differ(tmp_path: Path) -> None:
    """The case that names alone miss: a fine-tune written over the old files keeps every
    header (names, dtypes, shapes, offsets) and size."""
    checkpoint(tmp_path / "a", seed=0)
    checkpoint(tmp_path / "b", seed=1)
    for f in (FILE1, FILE2):
        assert (tmp_path / "a" / f).stat().st_size == (tmp_path / "b" / f).stat().st_size
    assert digest(tmp_path / "a") != digest(tmp_path / "b")


@pytest.mark.parametrize(("name", "where"), [
    ("a.weight", 0),  # a large tensor's first window
    ("a.weight", BIG // 2),  # its middle window
    ("a.weight", BIG - 1),  # its last window
    ("b.weight", SMALL // 2),  # a small tensor, hashed whole
    ("a.k_scale", 3),  # a scale: hashed whole
])
def test_a_byte_in_a_sampled_window_changes_it(tmp_path: Path, name: str, where: int) -> None:
    starts = checkpoint(tmp_path)
    before = digest(tmp_path)
    poke(tmp_path / (FILE2 if name == "b.weight" else FILE1), starts[name] + where)
    assert digest(tmp_path) != before


def test_a_byte_between_the_windows_does_not(tmp_path: Path) -> None:
    """What the fingerprint misses, by construction (docs/engines/vllm.md, "Identity")."""
    starts = checkpoint(tmp_path)
    before = digest(tmp_path)
    poke(tmp_path / FILE1, starts["a.weight"] + TENSOR_WINDOW + 10)
    assert digest(tmp_path) == before


def test_headers_sizes_names_and_config_count(tmp_path: Path) -> None:
    checkpoint(tmp_path / "base")
    base = digest(tmp_path / "base")

    checkpoint(tmp_path / "config", config={"model_type": "llama", "rope_theta": 1e6})
    assert digest(tmp_path / "config") != base

    checkpoint(tmp_path / "meta")
    write_safetensors(tmp_path / "meta" / FILE2, {"b.weight": pattern(SMALL, 1)},
                      metadata={"format": "pt"})
    assert digest(tmp_path / "meta") != base

    checkpoint(tmp_path / "quant")
    (tmp_path / "quant" / "hf_quant_config.json").write_text('{"quant_algo": "FP8"}')
    assert digest(tmp_path / "quant") != base

    checkpoint(tmp_path / "renamed")
    (tmp_path / "renamed" / FILE2).rename(tmp_path / "renamed" / "model-x.safetensors")
    assert digest(tmp_path / "renamed") != base

    checkpoint(tmp_path / "tokenizer")  # files that are not weights or config: not read
    (tmp_path / "tokenizer" / "tokenizer.json").write_text('{"other": 1}')
    (tmp_path / "tokenizer" / "sub").mkdir()
    (tmp_path / "tokenizer" / "sub" / "x.safetensors").write_bytes(b"ignored")
    assert digest(tmp_path / "tokenizer") == base


def test_bytes_read_are_the_headers_windows_and_configs(tmp_path: Path) -> None:
    checkpoint(tmp_path)
    fp = fingerprint_checkpoint(tmp_path)
    headers = sum(8 + struct.unpack("<Q", (tmp_path / f).read_bytes()[:8])[0]
                  for f in (FILE1, FILE2))
    windows = 3 * TENSOR_WINDOW + 4 + SMALL
    config = (tmp_path / "config.json").stat().st_size
    assert fp.bytes_read == headers + windows + config


def test_opaque_files_and_single_files(tmp_path: Path) -> None:
    """A pickle (*.bin) or GGUF has no header: its size and 16 windows of 4 KiB."""
    ckpt = tmp_path / "bin"
    ckpt.mkdir()
    data = bytearray(pattern(200_000, 3))
    (ckpt / "pytorch_model.bin").write_bytes(data)
    fp = fingerprint_checkpoint(ckpt)
    assert fp.bytes_read == 16 * 4096 and fp.tensors == 0
    poke(ckpt / "pytorch_model.bin", 0)
    assert digest(ckpt) != fp.digest

    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(bytes(data))
    one = fingerprint_checkpoint(gguf)
    assert one.files == 1 and one.bytes_read == 16 * 4096
    poke(gguf, len(data) - 1)  # the last window ends at the last byte
    assert digest(gguf) != one.digest


def test_a_safetensors_file_that_does_not_parse_is_hashed_as_opaque(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 5) + b"nope!" + bytes(50))
    fp = fingerprint_checkpoint(tmp_path)
    assert fp.tensors == 0 and fp.bytes_read == 63
    assert fingerprint_checkpoint(tmp_path) == fp


def test_no_weights(tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(NoWeights):
        fingerprint_checkpoint(tmp_path)


def test_find_checkpoint_local_and_hub_cache(tmp_path: Path,
                                             monkeypatch: pytest.MonkeyPatch) -> None:
    local = tmp_path / "ckpt"
    checkpoint(local)
    assert find_checkpoint(str(local)) == local
    assert find_checkpoint(str(tmp_path / "missing")) is None
    assert find_checkpoint("") is None

    hub = tmp_path / "hub"
    repo = hub / "models--org--model"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("c0ffee\n")
    checkpoint(repo / "snapshots" / "c0ffee")
    checkpoint(repo / "snapshots" / "beef")
    monkeypatch.setenv("HF_HUB_CACHE", str(hub))
    assert find_checkpoint("org/model") == repo / "snapshots" / "c0ffee"
    assert find_checkpoint("org/model", "beef") == repo / "snapshots" / "beef"
    assert find_checkpoint("org/model", "v2") is None
    assert find_checkpoint("org/other") is None
    monkeypatch.delenv("HF_HUB_CACHE")
    assert find_checkpoint("org/model", cache_dirs=[hub]) == repo / "snapshots" / "c0ffee"


def test_weights_identity(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    checkpoint(tmp_path / "m", seed=0)
    first = weights_identity(str(tmp_path / "m"))
    assert first.kind == "fingerprint" and str(first) == f"fingerprint:{digest(tmp_path / 'm')}"
    # overwritten in place, same sizes: read afresh, another identity
    checkpoint(tmp_path / "m", seed=1)
    assert weights_identity(str(tmp_path / "m")) != first

    given = weights_identity(str(tmp_path / "m"), weights_id="llama-ft-2026-11")
    assert str(given) == "given:llama-ft-2026-11"

    name = f"nowhere/model-{os.getpid()}"
    with caplog.at_level(logging.WARNING, logger=identity.__name__):
        unknown = weights_identity(name)
        again = weights_identity(name)
    assert unknown == again and unknown.kind == "process" and unknown.value == process_value()
    assert caplog.text.count("cannot fingerprint the weights of") == 1  # warned once
    (tmp_path / "empty").mkdir()
    assert weights_identity(str(tmp_path / "empty")).kind == "process"


def test_identity_digest() -> None:
    a = identity_digest({"weights": "fingerprint:1", "dtype": "bfloat16"})
    assert a == identity_digest({"dtype": "bfloat16", "weights": "fingerprint:1"})
    assert a != identity_digest({"dtype": "float16", "weights": "fingerprint:1"})
    assert len(a) == 32
