"""Sized to fit: a node refuses to start with tiers larger than the memory it may use.

Without this a node started with ``--dram-bytes 4GiB`` in a container limited to
2 GiB is OOM-killed while it prefaults its region (exit 137, no message), or later,
under load, without prefaulting. What it may use is the memory limit of the cgroup
it runs in (the smallest limit on the way up its hierarchy; cgroup v2 ``memory.max``
or v1 ``memory.limit_in_bytes``), and never more than the machine's available
memory (``MemAvailable``). Tiers held in host memory count: DRAM, and HBM when its
device is the CPU; the SSD tier is on disk and does not.

The tier index counts too: every block of every tier, the SSD's included, has a record
in host memory (``tiers.index_budget``). At full occupancy a tier of ``C`` bytes holds
``C // block_bytes`` blocks, so 64 GiB of DRAM and 1 TiB of SSD in 64 KiB blocks are
17.8 million records: ``index_budget`` says what they need, the node reports it at
start-up, and ``check_fits`` refuses a node whose tiers and index do not fit together.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from kvstore.core.errors import ResourceExhausted
from kvstore.core.sizes import format_size
from tiers.index_budget import blocks_at_full_occupancy, index_bytes_per_block

_NO_LIMIT = 1 << 60  # v1 reports "unlimited" as a page-rounded 2^63 - 1


@dataclass(frozen=True, slots=True, kw_only=True)
class Allowance:
    nbytes: int
    source: str  # says where the number comes from, for the message


def cgroup_memory_limit(proc: str = "/proc/self") -> tuple[int, str] | None:
    """The memory limit of the cgroup ``proc`` runs in and the cgroup's path, or None."""
    try:
        membership = Path(proc, "cgroup").read_text().splitlines()
        mounts = Path(proc, "mountinfo").read_text().splitlines()
    except OSError:
        return None
    best: tuple[int, str] | None = None
    for line in membership:
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if not v2 and "memory" not in controllers.split(","):
            continue
        for directory in _cgroup_dirs(mounts, path, v2):
            limit = _read_limit(directory, v2)
            if limit is not None and (best is None or limit < best[0]):
                best = (limit, path)
    return best


def _cgroup_dirs(mounts: list[str], path: str, v2: bool) -> list[Path]:
    """The directories of ``path`` and its ancestors under the matching cgroup mount."""
    for m in mounts:
        fields, _, rest = m.partition(" - ")
        parts, tail = fields.split(), rest.split()
        if not tail or len(parts) < 5:
            continue
        fstype, options = tail[0], tail[-1].split(",")
        if (fstype != "cgroup2") if v2 else (fstype != "cgroup" or "memory" not in options):
            continue
        root, point = parts[3], Path(parts[4])
        rel = os.path.relpath(path, root) if root != "/" else path.lstrip("/")
        if rel.startswith(".."):
            continue  # this mount does not show the process's cgroup
        here = point / rel if rel not in ("", ".") else point
        dirs = []
        while True:
            dirs.append(here)
            if here == point:
                return dirs
            here = here.parent
    return []


def _read_limit(directory: Path, v2: bool) -> int | None:
    name = "memory.max" if v2 else "memory.limit_in_bytes"
    try:
        text = (directory / name).read_text().strip()
    except OSError:
        return None
    if text == "max" or not text.isdigit() or int(text) >= _NO_LIMIT:
        return None
    return int(text)


def available_memory(meminfo: str = "/proc/meminfo") -> int | None:
    try:
        for line in Path(meminfo).read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


def allowance() -> Allowance | None:
    """What this process may use: its cgroup's limit, capped by available memory."""
    out: Allowance | None = None
    limit = cgroup_memory_limit()
    if limit is not None:
        out = Allowance(nbytes=limit[0], source=f"the memory limit of cgroup {limit[1]}")
    avail = available_memory()
    if avail is not None and (out is None or avail < out.nbytes):
        out = Allowance(nbytes=avail, source="the machine's available memory (MemAvailable)")
    return out


@dataclass(frozen=True, slots=True, kw_only=True)
class IndexBudget:
    """What the tier index needs when every tier is full of ``block_bytes`` blocks."""

    kind: str  # which index: "python" or "native" (tiers.index_budget)
    block_bytes: int
    blocks: dict[str, int]  # per tier name, in tier order
    bytes_per_block: int
    nbytes: int

    @property
    def total_blocks(self) -> int:
        return sum(self.blocks.values())

    def describe(self) -> str:
        per_tier = ", ".join(f"{name} {n:,}" for name, n in self.blocks.items())
        return (f"{format_size(self.nbytes)} ({self.nbytes} bytes) for {self.total_blocks:,} "
                f"blocks of {format_size(self.block_bytes)} at full occupancy ({per_tier}; "
                f"{self.bytes_per_block} bytes per block, {self.kind} index)")


def planned_blocks(tier_bytes: dict[str, int], block_bytes: int) -> dict[str, int]:
    """The blocks each tier of ``tier_bytes`` (name -> size; 0: absent) holds when full."""
    return {name: blocks_at_full_occupancy(n, block_bytes)
            for name, n in tier_bytes.items() if n}


def index_budget(tier_bytes: dict[str, int], block_bytes: int, *, kind: str) -> IndexBudget:
    """The index's metadata for tiers of ``tier_bytes`` (name -> size) when full."""
    blocks = planned_blocks(tier_bytes, block_bytes)
    total = sum(blocks.values())
    per_block = index_bytes_per_block(total, kind=kind)
    return IndexBudget(kind=kind, block_bytes=block_bytes, blocks=blocks,
                       bytes_per_block=per_block, nbytes=total * per_block)


def _hbm_on_host(hbm_device: str | None) -> bool:
    """Whether an HBM tier on ``hbm_device`` lives in host memory (no CUDA device)."""
    if hbm_device is not None:
        return hbm_device.startswith("cpu")
    import torch  # only for a node with an HBM tier

    return not torch.cuda.is_available()


def check_fits(dram_bytes: int, hbm_bytes: int = 0, hbm_device: str | None = None, *,
               index: IndexBudget | None = None) -> None:
    """ResourceExhausted, naming both numbers, if the tiers held in host memory, or they
    and the tier ``index``'s metadata at full occupancy, exceed what this process may use."""
    on_host = bool(hbm_bytes) and _hbm_on_host(hbm_device)
    tier_bytes = dram_bytes + (hbm_bytes if on_host else 0)
    what = "the node's tiers in host memory (DRAM" + (" and HBM on the CPU)" if on_host else ")")
    allowed = allowance()
    if allowed is None:
        return
    may_use = (f"this node may use {format_size(allowed.nbytes)} ({allowed.nbytes} bytes), "
               f"{allowed.source}")
    if tier_bytes > allowed.nbytes:
        raise ResourceExhausted(
            f"{what} need {format_size(tier_bytes)} ({tier_bytes} bytes) of memory but "
            f"{may_use}: give smaller tiers or more memory")
    if index is not None and tier_bytes + index.nbytes > allowed.nbytes:
        need = tier_bytes + index.nbytes
        raise ResourceExhausted(
            f"the tier index needs {index.describe()}, which with {what} "
            f"({format_size(tier_bytes)}) is {format_size(need)} ({need} bytes) of memory, "
            f"but {may_use}: give smaller tiers, larger --block-bytes (if blocks are "
            f"larger) or more memory")
