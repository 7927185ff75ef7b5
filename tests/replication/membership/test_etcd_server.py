"""EtcdServer: a real etcd on loopback that starts, answers, restarts with its data, and stops."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import aetcd
import pytest

from kvstore.core.ports import free_port
from replication.membership.etcd_server import EtcdServer, EtcdServerError

pytest_plugins = ["etcd_fixtures"]


def put(server: EtcdServer, key: bytes, value: bytes) -> None:
    async def run() -> None:
        async with aetcd.Client("127.0.0.1", server.client_port, timeout=5) as client:
            await client.put(key, value)

    asyncio.run(run())


def get(server: EtcdServer, key: bytes) -> bytes | None:
    async def run() -> bytes | None:
        async with aetcd.Client("127.0.0.1", server.client_port, timeout=5) as client:
            found = await client.get(key)
            return None if found is None else found.value

    return asyncio.run(run())


def alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


def test_fixture_server_answers_on_loopback(etcd: EtcdServer) -> None:
    host, port = etcd.endpoint.split(":")
    assert host == "127.0.0.1"
    assert int(port) == etcd.client_port > 0
    assert etcd.peer_port > 0 and etcd.peer_port != etcd.client_port
    assert etcd.running and etcd.pid is not None and alive(etcd.pid)
    put(etcd, b"k", b"v")
    assert get(etcd, b"k") == b"v"
    assert etcd.log_path.parent == etcd.data_dir.parent
    assert f"--listen-client-urls=http://{etcd.endpoint}" in etcd.log_path.read_text()
    assert "serving client traffic" in etcd.log_tail()


def test_stop_is_by_pid_and_idempotent(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    assert server.stop() is None
    assert server.pid is None and not server.running
    server.start()
    pid = server.pid
    assert pid is not None
    assert server.stop() == -signal.SIGTERM  # etcd shuts down, then dies of the signal
    assert "closed etcd server" in server.log_tail()  # ... after a clean shutdown
    assert not alive(pid)
    assert server.pid is None
    assert server.stop() is None


def test_restart_keeps_ports_and_data(tmp_path: Path) -> None:
    with EtcdServer(tmp_path / "etcd") as server:
        endpoint, peer_port, old_pid = server.endpoint, server.peer_port, server.pid
        put(server, b"kept", b"across restarts")
        server.restart()
        assert server.endpoint == endpoint and server.peer_port == peer_port
        assert server.pid != old_pid
        assert get(server, b"kept") == b"across restarts"

        server.kill()  # a crash loses nothing acknowledged either
        assert server.pid is None
        server.start()
        assert server.endpoint == endpoint
        assert get(server, b"kept") == b"across restarts"
    assert not server.running


def test_explicit_ports_are_used(tmp_path: Path) -> None:
    ports = [free_port(), free_port()]  # two probes of their own could get the same port
    with EtcdServer(tmp_path / "etcd", client_port=ports[0], peer_port=ports[1],
                    name="custom") as server:
        assert server.endpoint == f"127.0.0.1:{ports[0]}"
        assert server.peer_port == ports[1]
        assert "--name=custom" in server.log_path.read_text()


def test_port_in_use_is_refused(etcd: EtcdServer, tmp_path: Path) -> None:
    # Not "healthy": the other etcd on that port would answer /health for this one.
    clash = EtcdServer(tmp_path / "clash", client_port=etcd.client_port)
    with pytest.raises(EtcdServerError, match=rf"port\(s\) \[{etcd.client_port}\] in use"):
        clash.start(timeout=20)
    assert clash.pid is None
    assert get(etcd, b"absent") is None  # the first server is unharmed


def test_start_failure_quotes_the_log(tmp_path: Path) -> None:
    (tmp_path / "not-a-dir").write_text("a file where the data directory should be")
    server = EtcdServer(tmp_path / "not-a-dir")
    with pytest.raises(EtcdServerError, match="exited with code 1") as failure:
        server.start(timeout=20)
    assert "not a directory" in str(failure.value)
    assert str(server.log_path) in str(failure.value)
    assert server.pid is None


def test_missing_binary_is_a_clear_error(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd", binary="etcd-not-installed-here")
    with pytest.raises(EtcdServerError, match=r"etcd not found.*install-system-deps\.sh"):
        server.start()
    with pytest.raises(EtcdServerError, match="start it first"):
        _ = server.endpoint


def test_detached_server_runs_in_its_own_session(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    server.start(detach=True)
    try:
        pid = server.pid
        assert pid is not None
        assert os.getsid(pid) == pid != os.getsid(0)
        put(server, b"k", b"v")
    finally:
        server.stop()
    assert not alive(pid)


def test_stop_falls_back_to_sigkill(tmp_path: Path) -> None:
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    pid = server.pid
    assert pid is not None
    os.kill(pid, signal.SIGSTOP)  # a stopped process cannot act on SIGTERM
    assert server.stop(timeout=0.5) == -signal.SIGKILL
    assert not alive(pid)
