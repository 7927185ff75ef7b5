"""Shared fixtures: real node processes on free loopback ports."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

from kvstore.core.ports import free_port  # re-exported: test modules import it from conftest
from kvstore.protocol.wire import Op
from kvstore.remote.channel_client import ChannelConnection

if TYPE_CHECKING:
    from kvstore.auth.security import TenantRegistry

REPO = Path(__file__).resolve().parent.parent


def lose_first_answer(monkeypatch: pytest.MonkeyPatch, op: Op) -> list[int]:
    """Loses this process's first answer to an ``op`` request (``Op.PUT`` or ``Op.RPUT``)
    on the transfer channel after the node sent it: the real exchange runs (the node has
    stored the put), then the stream resets (ConnectionResetError), as a connection that
    breaks just then. A pipelined put's answer (``put_reply``) too. Returns the item
    counts of the answers lost: one at most."""
    lost: list[int] = []
    call, put_reply = ChannelConnection._call, ChannelConnection.put_reply

    def lose(count: int) -> None:
        if not lost:
            lost.append(count)
            raise ConnectionResetError("the answer was lost")

    def call_then_lose(conn: ChannelConnection, asked: Op, count: int, meta: bytes,
                       values: Any = ()) -> tuple[int, bytes]:
        answer = call(conn, asked, count, meta, values)
        if asked is op:
            lose(count)
        return answer

    def reply_then_lose(conn: ChannelConnection, count: int, *, replicated: bool = False
                        ) -> tuple[list[bool], int, str]:
        answer = put_reply(conn, count, replicated=replicated)
        if (Op.RPUT if replicated else Op.PUT) is op:
            lose(count)
        return answer

    monkeypatch.setattr(ChannelConnection, "_call", call_then_lose)
    monkeypatch.setattr(ChannelConnection, "put_reply", reply_then_lose)
    return lost


class ManualClock:
    """A clock the test moves by hand (``now``), for a Node's retention deadlines."""

    def __init__(self) -> None:
        self.now = 5000.0

    def __call__(self) -> float:
        return self.now


class ServedNode:
    """A Node on a ``ManualClock`` behind a real NodeServer (gRPC and the channel) on
    loopback; ``close()`` stops both."""

    def __init__(self, *, dram_bytes: int, max_retained_fraction: float = 0.5,
                 auth: TenantRegistry | None = None) -> None:
        from kvstore.node.semantics import Node, NodeSettings
        from kvstore.server import NodeServer

        self.clock = ManualClock()
        self.node = Node(NodeSettings(dram_bytes=dram_bytes, prefault=False,
                                      max_retained_fraction=max_retained_fraction),
                         clock=self.clock)
        self.server = NodeServer(self.node, listen=f"127.0.0.1:{free_port()}", grpc_workers=4,
                                 auth=auth)
        self.server.start()
        self.addr = self.server.addresses.grpc

    def close(self) -> None:
        self.server.stop(grace=1.0)
        self.node.close()


def write_auth_file(path: Path, tokens: dict[str, str], *, cluster: str | None = None,
                    quotas: dict[str, str | int] | None = None) -> Path:
    """A ``--auth-file``: one tenant per ``tokens`` entry (name -> token, with its quota if
    ``quotas`` names it), plus a ``cluster``-role entry named "cluster" with that token."""
    entries = []
    for name, token in tokens.items():
        quota = (quotas or {}).get(name)
        entries.append(f'[[tenant]]\nname = "{name}"\ntoken = "{token}"\n'
                       + ("" if quota is None else f'quota_bytes = "{quota}"\n'))
    if cluster is not None:
        entries.append(f'[[tenant]]\nname = "cluster"\nrole = "cluster"\ntoken = "{cluster}"\n')
    path.write_text("\n".join(entries))
    return path


def wait_until(predicate: Callable[[], bool], timeout: float = 10.0, what: str = "condition"
               ) -> None:
    """Polls ``predicate`` (for effects in another process, where no barrier reaches)."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(0.02)


@dataclass(slots=True, kw_only=True)
class NodeProcess:
    """A ``kvstore serve`` process started for a test."""

    addr: str
    proc: subprocess.Popen
    log: Path
    args: list[str] = field(default_factory=list)

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        try:
            return self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            raise

    def output(self) -> str:
        return self.log.read_text()


def flip_byte(path: Path | str, pos: int) -> None:
    """Flips one byte of a file behind its owner's back, durably (a buffered write: the
    kernel writes the dirty page back before an O_DIRECT read of that range)."""
    fd = os.open(path, os.O_RDWR)
    try:
        (old,) = os.pread(fd, 1, pos)
        os.pwrite(fd, bytes([old ^ 0x40]), pos)
        os.fsync(fd)
    finally:
        os.close(fd)


def start_node(tmp_path: Path, *extra: str, dram: str = "64MiB", ready_timeout: float = 30.0,
               port: int | None = None, limit_as: int | None = None) -> NodeProcess:
    """``limit_as``: the node's address-space limit (RLIMIT_AS) in bytes, so an unbounded
    allocation fails inside the node (and the test) instead of taking the machine."""
    port = port or free_port()
    addr = f"127.0.0.1:{port}"
    log = tmp_path / f"node-{port}.log"
    args = [sys.executable, "-m", "kvstore", "serve", "--listen", addr, "--dram-bytes", dram,
            "--no-prefault", *extra]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    preexec = None
    if limit_as is not None:
        import resource

        env["MALLOC_ARENA_MAX"] = "2"  # arenas reserve 64 MiB of address space each

        def preexec() -> None:
            resource.setrlimit(resource.RLIMIT_AS, (limit_as, limit_as))

    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env=env, preexec_fn=preexec)
    node = NodeProcess(addr=addr, proc=proc, log=log, args=args)
    deadline = time.monotonic() + ready_timeout
    while "kvstore: serving on" not in node.output():
        if proc.poll() is not None:
            raise RuntimeError(f"node exited with {proc.returncode}:\n{node.output()}")
        if time.monotonic() > deadline:
            node.stop(signal.SIGKILL)
            raise RuntimeError(f"node not ready in {ready_timeout}s:\n{node.output()}")
        time.sleep(0.02)
    return node


def start_static_cluster(tmp_path: Path, n: int, *extra: str, dram: str = "64MiB"
                         ) -> list[NodeProcess]:
    """``n`` nodes that know each other from ``--members`` (a static cluster, no etcd)."""
    ports = [free_port() for _ in range(n)]
    members = ",".join(f"127.0.0.1:{p}" for p in ports)
    nodes: list[NodeProcess] = []
    try:
        for p in ports:
            nodes.append(start_node(tmp_path, "--members", members, *extra, dram=dram, port=p))
    except BaseException:
        for node in nodes:
            node.stop(signal.SIGKILL)
        raise
    return nodes


@pytest.fixture(scope="session")
def uring_status() -> tuple[bool, str | None]:
    """Whether the SSD tier's io_uring backend runs here; builds the native module if
    needed (once per session)."""
    from tiers.ssd.tier import uring_available

    ok, reason = uring_available()
    if not ok:
        build = subprocess.run([sys.executable, "-m", "cffi_build.uring_build"], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        ok, reason = uring_available()
        if not ok:
            reason = f"{reason}; build output: {build.stderr.strip()[-500:]}"
    return ok, reason


CHANNEL_PATHS = ["native", "python"]


@pytest.fixture(scope="session")
def native_channel_status() -> tuple[bool, str | None]:
    """Whether the transfer channel's native helper loads; builds it if needed (once)."""
    from kvstore.protocol import native_channel

    mod, why = native_channel.load()
    if mod is None:
        build = subprocess.run([sys.executable, "-m", "cffi_build.channel_build"], cwd=REPO,
                               capture_output=True, text=True, timeout=120)
        mod, why = native_channel.load(retry=True)
        if mod is None:
            why = f"{why}; build output: {build.stderr.strip()[-500:]}"
    return mod is not None, why


@pytest.fixture(scope="module", params=CHANNEL_PATHS)
def channel_path(request: pytest.FixtureRequest,
                 native_channel_status: tuple[bool, str | None]) -> Iterator[str]:
    """Runs a module's tests on both paths of the transfer channel: the native helper and
    the pure-Python fallback (``KVSTORE_NATIVE_CHANNEL``, which the node processes it
    starts inherit and clients read as they connect). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("channel_path")``, or names it before ``node``."""
    from kvstore.protocol import native_channel

    if request.param == "native" and not native_channel_status[0]:
        pytest.skip(f"native channel helper unavailable: {native_channel_status[1]}")
    before = os.environ.get(native_channel.ENV)
    os.environ[native_channel.ENV] = "1" if request.param == "native" else "0"
    try:
        yield request.param
    finally:
        if before is None:
            del os.environ[native_channel.ENV]
        else:
            os.environ[native_channel.ENV] = before


INDEX_KINDS = ["python", "native"]
INDEX_MODULES = ("tests/tiers/", "tests/kvstore/test_concurrency.py")
"""Where every test function runs on both tier indexes (``tier_index``); Hypothesis state
machines (unittest classes: no parameters) run on the one the environment names, and
``make test`` runs them once more with ``KVSTORE_NATIVE_INDEX=1``."""


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    path = Path(metafunc.definition.path).resolve().relative_to(REPO).as_posix()
    if not path.startswith(INDEX_MODULES) or path.startswith("tests/tiers/ssd/") \
            or path.endswith(("test_native_index.py", "test_native_manager.py")):
        return
    if "tier_index" not in metafunc.fixturenames:
        metafunc.fixturenames.append("tier_index")
    metafunc.parametrize("tier_index", INDEX_KINDS, indirect=True, scope="module")


@pytest.fixture(scope="module")
def tier_index(request: pytest.FixtureRequest) -> Iterator[str]:
    """Runs a test on the pure-Python tier index or the native one
    (``KVSTORE_NATIVE_INDEX``, which every TierManager made without naming its index reads,
    in this process and in the node processes it starts); native is skipped where its
    extension is not built."""
    from tiers.index_kind import ENV, native_available

    if request.param == "native" and not native_available():
        pytest.skip("the native tier index is not built (python -m cffi_build.block_index_build)")
    before = os.environ.get(ENV)
    os.environ[ENV] = "1" if request.param == "native" else "0"
    try:
        yield request.param
    finally:
        if before is None:
            del os.environ[ENV]
        else:
            os.environ[ENV] = before


@pytest.fixture
def node(tmp_path: Path) -> Iterator[NodeProcess]:
    """A fresh node (64 MiB DRAM, LRU) for one test; must exit 0 on SIGTERM."""
    n = start_node(tmp_path)
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


@pytest.fixture(scope="module")
def shared_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """One node for a whole module (256 MiB), for tests that only add distinct keys."""
    n = start_node(tmp_path_factory.mktemp("shared"), dram="256MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


TRANSPORTS = ["grpc", "tcp", "shm"]
