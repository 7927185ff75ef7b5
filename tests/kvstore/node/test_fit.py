"""Sized to fit: a node refuses tiers larger than its cgroup's limit or available memory."""

from __future__ import annotations

import secrets
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, free_port

from kvstore.core.errors import ResourceExhausted
from kvstore.core.keys import BlockKey
from kvstore.node import fit
from kvstore.node.semantics import Node, NodeSettings
from tiers.index_budget import index_bytes_per_block
from tiers.index_kind import ENV, native_available

GiB = 1 << 30
MiB = 1 << 20


def _serve(*args: str, cgroup: Path | None = None) -> subprocess.CompletedProcess[str]:
    def enter() -> None:
        if cgroup is not None:
            (cgroup / "cgroup.procs").write_text("0")  # this process, before exec

    return subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen",
                           f"127.0.0.1:{free_port()}", *args], capture_output=True, text=True,
                          cwd=REPO, timeout=120, preexec_fn=enter)


def _own_memory_cgroup() -> tuple[Path, bool] | None:
    """The directory of this process's memory cgroup and whether it is v2."""
    mounts = Path("/proc/self/mountinfo").read_text().splitlines()
    for line in Path("/proc/self/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        v2 = controllers == ""
        if v2 or "memory" in controllers.split(","):
            dirs = fit._cgroup_dirs(mounts, path, v2)
            if dirs and (not v2 or (dirs[0] / "memory.max").exists()
                         or (dirs[0] / "cgroup.controllers").exists()):
                return dirs[0], v2
    return None


@pytest.fixture
def limited_cgroup() -> Iterator[Path]:
    """A child of this process's memory cgroup limited to 2 GiB (skips where none can be
    made: no memory controller, or no permission to create cgroups here)."""
    own = _own_memory_cgroup()
    if own is None:
        pytest.skip("no memory cgroup controller is mounted here")
    parent, v2 = own
    child = parent / f"kvstore-fit-{secrets.token_hex(4)}"
    try:
        child.mkdir()
    except OSError as exc:
        pytest.skip(f"cannot create a cgroup under {parent}: {exc.strerror}")
    try:
        try:
            (child / ("memory.max" if v2 else "memory.limit_in_bytes")).write_text(str(2 * GiB))
        except OSError as exc:
            pytest.skip(f"cannot set a memory limit on {child}: {exc.strerror} (v2 needs the "
                        f"memory controller enabled in the parent's cgroup.subtree_control)")
        try:  # a process must be able to join it (v2: no processes in inner cgroups)
            subprocess.run([sys.executable, "-c", "pass"], check=True, timeout=60,
                           preexec_fn=lambda: (child / "cgroup.procs").write_text("0"))
        except (OSError, subprocess.SubprocessError) as exc:
            pytest.skip(f"cannot move a process into {child}: {exc}")
        yield child
    finally:
        child.rmdir()


def test_a_node_bigger_than_its_cgroup_refuses_to_start_naming_both(
        limited_cgroup: Path) -> None:
    out = _serve("--dram-bytes", "4GiB", cgroup=limited_cgroup)
    assert out.returncode == 1, out.stderr
    assert "need 4.0 GiB (4294967296 bytes)" in out.stderr
    assert "may use 2.0 GiB (2147483648 bytes), the memory limit of cgroup" in out.stderr
    assert limited_cgroup.name in out.stderr and "Traceback" not in out.stderr


def test_a_node_that_fits_its_cgroup_starts(limited_cgroup: Path) -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--listen",
                             f"127.0.0.1:{free_port()}", "--dram-bytes", "64MiB"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO, preexec_fn=lambda: (limited_cgroup / "cgroup.procs")
                            .write_text("0"))
    try:
        assert proc.stdout is not None
        lines = iter(proc.stdout.readline, "")
        assert any(line.startswith("kvstore: serving on") for line in lines)
        assert str(proc.pid) in (limited_cgroup / "cgroup.procs").read_text().split()
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_tiers_past_the_allowance_are_refused_even_without_prefaulting() -> None:
    allowed = fit.allowance()  # the cgroup's limit or MemAvailable, whichever is smaller
    assert allowed is not None and allowed.nbytes < 1 << 40
    out = _serve("--dram-bytes", "1TiB", "--no-prefault")
    assert out.returncode == 1
    assert "need 1.0 TiB (1099511627776 bytes)" in out.stderr
    assert allowed.source in out.stderr and "Traceback" not in out.stderr


def test_limits_are_read_from_v1_and_v2_files(tmp_path: Path) -> None:
    # A fake /proc and cgroup tree: the smallest limit on the way up wins.
    (tmp_path / "cg" / "a" / "b").mkdir(parents=True)
    (tmp_path / "cg" / "memory.max").write_text("max\n")
    (tmp_path / "cg" / "a" / "memory.max").write_text(f"{3 * GiB}\n")
    (tmp_path / "cg" / "a" / "b" / "memory.max").write_text(f"{5 * GiB}\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("0::/a/b\n")
    (proc / "mountinfo").write_text(
        f"30 1 0:26 / {tmp_path / 'cg'} rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n")
    assert fit.cgroup_memory_limit(str(proc)) == (3 * GiB, "/a/b")
    v1 = tmp_path / "v1"
    (v1 / "k8s" / "pod").mkdir(parents=True)
    (v1 / "k8s" / "pod" / "memory.limit_in_bytes").write_text(f"{GiB}\n")
    (v1 / "k8s" / "memory.limit_in_bytes").write_text("9223372036854771712\n")
    (proc / "cgroup").write_text("4:memory:/k8s/pod\n1:cpu:/k8s/pod\n")
    (proc / "mountinfo").write_text(
        f"40 1 0:30 / {v1} rw - cgroup cgroup rw,memory\n"
        f"41 1 0:31 / /nonexistent rw - cgroup cgroup rw,cpu\n")
    assert fit.cgroup_memory_limit(str(proc)) == (GiB, "/k8s/pod")
    (proc / "cgroup").write_text("4:memory:/\n")
    assert fit.cgroup_memory_limit(str(proc)) is None


def _pinned_allowance(monkeypatch: pytest.MonkeyPatch) -> fit.Allowance:
    """This process's allowance, read once and held for the test: ``check_fits`` reads it
    again, and MemAvailable moves with every other process on the machine."""
    allowed = fit.allowance()
    assert allowed is not None
    monkeypatch.setattr(fit, "allowance", lambda: allowed)
    return allowed


def test_check_fits_counts_an_hbm_tier_on_the_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = _pinned_allowance(monkeypatch)
    fit.check_fits(allowed.nbytes // 4, 1 << 50, "cuda:0")  # on a device: not host memory
    with pytest.raises(ResourceExhausted, match="DRAM and HBM on the CPU"):
        fit.check_fits(allowed.nbytes // 4, allowed.nbytes, "cpu")


def test_the_index_budget_counts_every_tier_at_full_occupancy() -> None:
    budget = fit.index_budget({"hbm": 0, "dram": 64 * GiB, "ssd": 1024 * GiB}, 64 << 10,
                              kind="python")
    assert budget.blocks == {"dram": 1 << 20, "ssd": 1 << 24}
    assert budget.total_blocks == 17 << 20
    assert budget.bytes_per_block == index_bytes_per_block(17 << 20, kind="python")
    assert budget.nbytes == (17 << 20) * budget.bytes_per_block
    assert "17,825,792 blocks of 64.0 KiB at full occupancy (dram 1,048,576, ssd " \
        "16,777,216;" in budget.describe()


def test_check_fits_refuses_an_index_that_does_not_fit_beside_the_tiers(
        monkeypatch: pytest.MonkeyPatch) -> None:
    allowed = _pinned_allowance(monkeypatch)
    small = fit.index_budget({"dram": allowed.nbytes // 4}, 64 << 10, kind="python")
    fit.check_fits(allowed.nbytes // 4, index=small)
    big = fit.index_budget({"dram": allowed.nbytes // 4, "ssd": 1 << 50}, 4096, kind="native")
    with pytest.raises(ResourceExhausted) as err:
        fit.check_fits(allowed.nbytes // 4, index=big)
    text = str(err.value)
    assert f"({big.nbytes} bytes) for {big.total_blocks:,} blocks of 4.0 KiB" in text
    assert f"({allowed.nbytes} bytes), {allowed.source}" in text


def test_a_node_whose_index_does_not_fit_refuses_to_start_naming_both(
        tmp_path: Path) -> None:
    out = _serve("--dram-bytes", "64MiB", "--ssd-path", str(tmp_path / "ssd"),
                 "--ssd-bytes", "1TiB", "--block-bytes", "4KiB")
    assert out.returncode == 1, out.stderr
    assert "the tier index needs" in out.stderr
    assert "268,451,840 blocks of 4.0 KiB at full occupancy (dram 16,384, ssd " \
        "268,435,456;" in out.stderr
    assert "this node may use" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "ssd").exists()  # refused before the SSD tier was opened


def test_a_node_reports_its_index_budget_at_start_up() -> None:
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--listen",
                             f"127.0.0.1:{free_port()}", "--dram-bytes", "64MiB",
                             "--no-prefault"],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            cwd=REPO)
    try:
        assert proc.stdout is not None
        seen = []
        for line in iter(proc.stdout.readline, ""):
            seen.append(line)
            if line.startswith("kvstore: serving on"):
                break
        report = [line for line in seen if "tier index: at most" in line]
        assert len(report) == 1, seen
        assert "for 1,024 blocks of 64.0 KiB at full occupancy (dram 1,024;" in report[0]
    finally:
        proc.terminate()
        assert proc.wait(timeout=30) == 0


def test_a_bad_block_size_is_a_cli_error() -> None:
    out = _serve("--block-bytes", "0")
    assert out.returncode == 1
    assert "kvstore serve: error: block_bytes must be positive" in out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.skipif(not native_available(), reason="native index not built")
@pytest.mark.parametrize(("block_bytes", "env", "kind"), [
    (64, None, "native"),        # 64 MiB of 64-byte blocks: 1,048,576 planned
    (128, None, "python"),       # 524,288 planned
    (64, "0", "python"),         # the environment wins
    (128, "1", "native"),
])
def test_a_node_planned_for_a_million_blocks_runs_the_native_index(
        monkeypatch: pytest.MonkeyPatch, block_bytes: int, env: str | None, kind: str) -> None:
    if env is None:
        monkeypatch.delenv(ENV, raising=False)
    else:
        monkeypatch.setenv(ENV, env)
    node = Node(NodeSettings(dram_bytes=64 * MiB, block_bytes=block_bytes, prefault=False))
    try:
        info = node.stats()["node"]
        assert info["tier_index"] == kind
        assert str(info["index_budget"]).endswith(f"bytes per block, {kind} index)")
        key = BlockKey(bytes(range(16)))
        assert node.put(key, memoryview(b"v" * 100))
        assert node.get(key) == b"v" * 100
    finally:
        node.close()
