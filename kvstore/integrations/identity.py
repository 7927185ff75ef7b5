"""What decides a model's KV bytes, named so that engines that would compute other bytes
never share a key: the weights' fingerprint and the identity strings built on it.

The vLLM connector, the SGLang HiCache backend and the LMCache plugin all name their
stored values after the model. A name (a path, a hub id, a revision) is not the weights:
a checkpoint overwritten in place by a fine-tune keeps its path, and an engine on the new
weights would load the old weights' KV and answer differently. So each integration puts
``weights_identity(...)`` in its default key derivation (and the vLLM connector in every
value's header too), and this module is the one place that says how the weights are
recognised. It imports no engine.

The fingerprint (``fingerprint_checkpoint``), computed once at start-up, hashes (SHA-256,
128 bits kept) the top level of the checkpoint directory, files in name order:

* each ``*.safetensors`` file: its name, its size, its header as stored (the 8-byte length
  and the JSON: every tensor's name, dtype, shape and byte offsets, and the file's
  metadata), and a fixed sample of every tensor's bytes: ``TENSOR_WINDOW`` (256) bytes at
  the tensor's start, middle and end (the whole tensor when it is at most 768 bytes, so
  small tensors such as KV-cache scales are hashed whole);
* each other weight file (``*.bin``, ``*.pt``, ``*.pth``, ``*.gguf``): its name, its size
  and ``OPAQUE_WINDOWS`` (16) windows of 4 KiB spread evenly from its first to its last
  byte (these formats have no header to read offsets from);
* the whole of the small files that change what the weights compute: ``config.json``,
  ``params.json``, ``quantize_config.json``, ``quant_config.json``,
  ``hf_quant_config.json``, ``preprocessor_config.json``.

A path that is a single file (a GGUF) is hashed as one such weight file. A directory with
no weight file at its top level has no fingerprint (``NoWeights``).

Cost: the reads are a few hundred bytes per tensor plus the headers, not the weights:
on a 100 GB checkpoint of ~1,000 tensors that is ~3,000 reads of 256 bytes, each reading
at most one 4 KiB page, so ~12 MB from disk; measured figures in docs/engines/vllm.md
("Identity").

What it misses, by construction: an edit confined to bytes outside the sampled windows of
tensors whose headers stay the same (a few rows changed in the middle of a matrix, say);
weights outside the directory's top level (subfolders, or a loader that fetches them from
elsewhere); changes that are not in the weights at all (kernels of another engine version).
A fine-tune changes almost every byte of each tensor it trains, so the first window of
such a tensor already differs. Where the fingerprint is not enough, name the weights
yourself (``weights_id``): that string then stands for them.

Where no checkpoint is found to fingerprint and no ``weights_id`` is given, the identity
is a random value drawn once per process (``WeightsIdentity.kind == "process"``), with a
warning: what that process stores is then found by that process only. It never
reads another's KV as its own, which is the point, and an operator who wants sharing
gives the path or a ``weights_id``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import secrets
import struct
import threading
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

__all__ = ["CONFIG_FILES", "NoWeights", "WeightsFingerprint", "WeightsIdentity",
           "find_checkpoint", "fingerprint_checkpoint", "identity_digest", "process_value",
           "weights_identity"]

log = logging.getLogger(__name__)

TENSOR_WINDOW = 256
"""Bytes read at each of a tensor's start, middle and end."""
OPAQUE_WINDOWS = 16
OPAQUE_WINDOW = 4096
CONFIG_FILES = ("config.json", "params.json", "quantize_config.json", "quant_config.json",
                "hf_quant_config.json", "preprocessor_config.json")
OPAQUE_SUFFIXES = (".bin", ".pt", ".pth", ".gguf")
MAX_SAFETENSORS_HEADER = 100 * 1024 * 1024  # the format's own limit
FINGERPRINT_VERSION = b"kvstore-weights-v1"


class NoWeights(ValueError):
    """The path holds no weight file this module can fingerprint."""


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsFingerprint:
    digest: str
    """32 hex digits (128 bits of SHA-256)."""
    files: int
    tensors: int
    """Tensors read in safetensors files (opaque files count none)."""
    bytes_read: int


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightsIdentity:
    """What stands for the weights in a key: ``str()`` of it is ``KIND:VALUE``."""

    kind: Literal["fingerprint", "given", "process"]
    value: str

    def __str__(self) -> str:
        return f"{self.kind}:{self.value}"


class _Hasher:
    """SHA-256 over length-prefixed fields, so no two field sequences hash alike."""

    def __init__(self) -> None:
        self._h = hashlib.sha256(FINGERPRINT_VERSION)
        self.bytes_read = 0

    def field(self, data: bytes) -> None:
        self._h.update(struct.pack("<Q", len(data)))
        self._h.update(data)

    def read(self, fd: int, offset: int, size: int) -> None:
        data = os.pread(fd, size, offset)
        self.bytes_read += len(data)
        self.field(data)

    def digest(self) -> str:
        return self._h.hexdigest()[:32]


def _windows(start: int, length: int, window: int, count: int) -> list[tuple[int, int]]:
    """``count`` windows of ``window`` bytes spread over ``[start, start + length)``, the
    first at its start and the last at its end; the whole range when they would cover it."""
    if length <= window * count:
        return [(start, length)] if length else []
    step = (length - window) / (count - 1)
    return [(start + round(i * step), window) for i in range(count)]


def _safetensors(h: _Hasher, fd: int, size: int) -> int | None:
    """Hashes a safetensors file's header and tensor samples: how many tensors, or None
    when it does not parse as one (it is then hashed as an opaque file)."""
    if size < 8:
        return None
    (n,) = struct.unpack("<Q", os.pread(fd, 8, 0))
    if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
        return None
    raw = os.pread(fd, n, 8)
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError):
        return None
    if not isinstance(header, dict):
        return None
    spans: list[tuple[str, int, int]] = []
    for name, info in sorted(header.items()):
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (not isinstance(offsets, list) or len(offsets) != 2
                or not all(isinstance(o, int) for o in offsets)
                or not 0 <= offsets[0] <= offsets[1] <= size - 8 - n):
            return None
        spans.append((name, 8 + n + offsets[0], offsets[1] - offsets[0]))
    h.bytes_read += 8 + n
    h.field(b"safetensors")
    h.field(raw)
    for name, begin, length in spans:
        h.field(name.encode())
        for offset, count in _windows(begin, length, TENSOR_WINDOW, 3):
            h.read(fd, offset, count)
    return len(spans)


def _opaque(h: _Hasher, fd: int, size: int) -> None:
    h.field(b"opaque")
    for offset, count in _windows(0, size, OPAQUE_WINDOW, OPAQUE_WINDOWS):
        h.read(fd, offset, count)


def _weight_files(path: Path) -> tuple[list[Path], list[Path]]:
    """(weight files, config files) of a checkpoint, each in name order."""
    if path.is_file():
        return [path], []
    names = sorted(p for p in path.iterdir() if p.is_file())
    weights = [p for p in names if p.suffix in (".safetensors", *OPAQUE_SUFFIXES)]
    configs = [p for p in names if p.name in CONFIG_FILES]
    return weights, configs


def fingerprint_checkpoint(path: str | os.PathLike[str]) -> WeightsFingerprint:
    """The fingerprint of the checkpoint at ``path`` (a directory, or one weight file);
    NoWeights if it holds none (see the module docstring for what is hashed)."""
    root = Path(path)
    weights, configs = _weight_files(root)
    if not weights:
        raise NoWeights(f"{root}: no *.safetensors, *.bin, *.pt, *.pth or *.gguf file at "
                        f"its top level")
    h = _Hasher()
    tensors = 0
    for f in weights:
        with open(f, "rb") as fh:
            fd = fh.fileno()
            size = os.fstat(fd).st_size
            h.field(f.name.encode())
            h.field(str(size).encode())
            n = _safetensors(h, fd, size) if f.suffix == ".safetensors" else None
            if n is None:
                _opaque(h, fd, size)
            else:
                tensors += n
    for f in configs:
        data = f.read_bytes()
        h.bytes_read += len(data)
        h.field(f.name.encode())
        h.field(data)
    return WeightsFingerprint(digest=h.digest(), files=len(weights) + len(configs),
                              tensors=tensors, bytes_read=h.bytes_read)


def _hub_caches(extra: Iterable[str | os.PathLike[str]]) -> list[Path]:
    roots = [Path(p) for p in extra if p]
    env = os.environ
    for var in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE"):
        if env.get(var):
            roots.append(Path(env[var]))
    if env.get("HF_HOME"):
        roots.append(Path(env["HF_HOME"]) / "hub")
    xdg = env.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    roots.append(Path(xdg) / "huggingface" / "hub")
    return roots


def find_checkpoint(model: str, revision: str | None = None, *,
                    cache_dirs: Sequence[str | os.PathLike[str]] = ()) -> Path | None:
    """The local files of ``model``: the path itself when it exists, else the snapshot
    of hub id ``model`` at ``revision`` (a branch, tag or commit; default ``main``) in a
    Hugging Face hub cache (``cache_dirs`` first, then ``HF_HUB_CACHE``, ``HF_HOME/hub``,
    ``~/.cache/huggingface/hub``); None when there is none."""
    if not model:
        return None
    local = Path(model).expanduser()
    if local.exists():
        return local
    if model.count("/") != 1 or model.startswith((".", "/", "~")):
        return None
    for root in _hub_caches(cache_dirs):
        repo = root / ("models--" + model.replace("/", "--"))
        ref = revision or "main"
        ref_file = repo / "refs" / ref
        commit = ref_file.read_text().strip() if ref_file.is_file() else ref
        snapshot = repo / "snapshots" / commit
        if snapshot.is_dir():
            return snapshot
    return None


_PROCESS_VALUE = secrets.token_hex(16)
_warned: set[str] = set()
_warned_lock = threading.Lock()


def weights_identity(model: str, *, revision: str | None = None,
                     weights_id: str | None = None,
                     cache_dirs: Sequence[str | os.PathLike[str]] = ()) -> WeightsIdentity:
    """What stands for ``model``'s weights: ``weights_id`` when given (the operator names
    them), else the fingerprint of its checkpoint (``find_checkpoint``), else this
    process's random value, with a warning. Each call reads the checkpoint afresh (no
    cache: a checkpoint rewritten in place within one clock tick would fool one keyed on
    file times); the integrations call it once at start-up."""
    if weights_id:
        return WeightsIdentity(kind="given", value=str(weights_id))
    found = find_checkpoint(model, revision, cache_dirs=cache_dirs)
    why = "no local checkpoint found"
    if found is not None:
        try:
            return WeightsIdentity(kind="fingerprint",
                                   value=fingerprint_checkpoint(found).digest)
        except (NoWeights, OSError) as exc:
            why = str(exc)
    with _warned_lock:
        first = model not in _warned
        _warned.add(model)
    if first:
        log.warning("kvstore: cannot fingerprint the weights of %r (%s): the KV this "
                    "process stores is named after this process and found by it only; "
                    "give the checkpoint's path or a weights id to share it", model, why)
    return WeightsIdentity(kind="process", value=_PROCESS_VALUE)


def process_value() -> str:
    """This process's random value (the identity of what cannot be named otherwise)."""
    return _PROCESS_VALUE


def identity_digest(parts: Mapping[str, object]) -> str:
    """32 hex digits standing for ``parts`` (name -> value, in any order): a compact
    segment for keys that must stay short."""
    text = "\x00".join(f"{k}={parts[k]}" for k in sorted(parts))
    return hashlib.sha256(text.encode()).hexdigest()[:32]
