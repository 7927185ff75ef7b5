"""``kvstore/node/memory_dump.py``: off without its variable; with it, tracing starts and
SIGUSR2 writes numbered dumps (a tracemalloc snapshot and the live objects by type)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tracemalloc
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvstore.node.memory_dump import (
    ENV,
    FRAMES_ENV,
    SIGNAL,
    TRIM,
    MemoryDumper,
    install_from_env,
)


@pytest.fixture
def restored() -> Iterator[None]:
    """Whatever the test changes (the SIGUSR2 handler, tracing) is as before afterwards."""
    handler = signal.getsignal(SIGNAL)
    tracing = tracemalloc.is_tracing()
    yield
    signal.signal(SIGNAL, handler)
    if not tracing:
        tracemalloc.stop()


class Marker:  # a type no other code makes: its count is exact
    pass


def test_off_without_the_variable(restored: None) -> None:
    handler = signal.getsignal(SIGNAL)
    tracing = tracemalloc.is_tracing()
    assert install_from_env({}) is None
    assert install_from_env({ENV: ""}) is None
    assert signal.getsignal(SIGNAL) is handler
    assert tracemalloc.is_tracing() is tracing


def test_frames_must_be_a_positive_integer(tmp_path: Path, restored: None) -> None:
    for bad in ("-3", "many", "1.5"):
        with pytest.raises(ValueError, match=FRAMES_ENV):
            install_from_env({ENV: str(tmp_path), FRAMES_ENV: bad})


def test_sigusr2_writes_numbered_dumps(tmp_path: Path, restored: None) -> None:
    if tracemalloc.is_tracing():  # pytest run with PYTHONTRACEMALLOC: frames stay its
        tracemalloc.stop()
    dumper = install_from_env({ENV: str(tmp_path / "dumps"), FRAMES_ENV: "3"})
    assert isinstance(dumper, MemoryDumper)
    assert tracemalloc.is_tracing() and tracemalloc.get_traceback_limit() == 3
    markers = [Marker() for _ in range(7)]
    os.kill(os.getpid(), signal.SIGUSR2)  # handled in this (the main) thread
    markers += [Marker() for _ in range(5)]
    os.kill(os.getpid(), signal.SIGUSR2)
    pid = os.getpid()
    assert sorted(p.name for p in (tmp_path / "dumps").iterdir()) == [
        f"{pid}-0.json", f"{pid}-0.tracemalloc", f"{pid}-1.json", f"{pid}-1.tracemalloc"]
    first, second = (json.loads((tmp_path / "dumps" / f"{pid}-{n}.json").read_text())
                     for n in (0, 1))
    assert first["pid"] == pid and first["tracing"] is True
    assert first["gc_objects"]["Marker"] == 7 and second["gc_objects"]["Marker"] == 12
    assert first["traced_bytes"] > 0
    assert first["pymalloc"] == {}  # tracemalloc wraps the object allocator: no report
    assert first["malloc"] == {} or first["malloc"]["uordblks"] > 0  # glibc 2.33+
    before = tracemalloc.Snapshot.load(str(tmp_path / "dumps" / f"{pid}-0.tracemalloc"))
    after = tracemalloc.Snapshot.load(str(tmp_path / "dumps" / f"{pid}-1.tracemalloc"))
    assert before.traceback_limit == 3
    this_file = [d for d in after.compare_to(before, "filename")
                 if d.traceback[0].filename == __file__]
    assert this_file and this_file[0].count_diff >= 5  # the five Markers made between
    assert dumper.count == 2
    del markers


def test_zero_frames_dumps_without_tracing(tmp_path: Path, restored: None) -> None:
    if tracemalloc.is_tracing():
        tracemalloc.stop()
    dumper = install_from_env({ENV: str(tmp_path), FRAMES_ENV: "0"})
    assert dumper is not None and not tracemalloc.is_tracing()
    out = dumper.dump()
    info = json.loads(out.read_text())
    assert out.name == f"{os.getpid()}-0.json" and info["tracing"] is False
    assert info["traced_bytes"] == 0 and info["gc_objects"]["function"] > 0
    assert sorted(p.name for p in tmp_path.iterdir()) == [out.name]  # no snapshot
    pymalloc = info["pymalloc"]
    assert pymalloc["# arenas allocated current"] >= 1
    assert 0 < pymalloc["# bytes in allocated blocks"] <= (
        pymalloc["# arenas allocated current"] << 20)  # 1 MiB arenas (Python 3.10+)
    assert all(k.startswith("# ") for k in pymalloc)
    assert info["malloc"] == {} or info["malloc"]["uordblks"] > 0
    assert info["rss_anon_kib"] > 0 and "trimmed" not in info


def test_a_trim_file_trims_after_the_dump(tmp_path: Path, restored: None) -> None:
    dumper = install_from_env({ENV: str(tmp_path), FRAMES_ENV: "0"})
    assert dumper is not None
    (tmp_path / TRIM).touch()
    info = json.loads(dumper.dump().read_text())
    assert info["trimmed"] in (True, False)  # glibc here
    assert info["rss_anon_kib"] > 0 and info["rss_anon_after_trim_kib"] > 0


def test_kvstore_serve_refuses_bad_frames_without_a_traceback(tmp_path: Path) -> None:
    env = {**os.environ, ENV: str(tmp_path), FRAMES_ENV: "lots"}
    done = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen", "127.0.0.1:0"],
                          env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    assert done.stderr.startswith(f"kvstore serve: error: {FRAMES_ENV} must be a non-negative")
    assert "Traceback" not in done.stderr
