"""A real cluster: etcd plus node processes, under faults (kill -9, SIGSTOP, etcd restart)."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO, wait_until

from kvstore.client import Client
from kvstore.core.errors import KVStoreError
from replication.cluster_client import ClusterClient
from replication.local_cluster import LocalCluster
from replication.membership import EtcdMembership

TTL = 2
NODE_ARGS = ["--dram-bytes", "64MiB", "--no-prefault", "--lease-ttl", str(TTL),
             "--replicas", "2", "--repair-interval", "5"]


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[LocalCluster]:
    c = LocalCluster.up(tmp_path / "cluster", 3, node_args=NODE_ARGS)
    try:
        yield c
    finally:
        for rec in c.nodes:  # a test may leave a node stopped
            c.signal_node(rec.id, signal.SIGCONT)
        c.down(timeout=10)


def _value(i: int) -> bytes:
    return random.Random(i).randbytes(8192 + i % 4096)


def _key(i: int) -> bytes:
    return (i + 1).to_bytes(16, "big")


def _copies(cluster: LocalCluster, keys: list[bytes], skip: set[str]) -> list[int]:
    counts = [0] * len(keys)
    for rec in cluster.nodes:
        if rec.id in skip:
            continue
        with Client(rec.addr, transport="grpc", timeout=5) as c:
            for i, e in enumerate(c.exists(keys)):
                counts[i] += e
    return counts


def _members(cluster: LocalCluster) -> set[str]:
    with EtcdMembership(cluster.etcd) as m:
        return {x.node_id for x in m.members()}


def test_cluster_cli_up_status_down(tmp_path: Path) -> None:
    d = tmp_path / "cl"
    run = [sys.executable, "-m", "kvstore", "cluster"]
    up = subprocess.run([*run, "up", "-n", "3", "--dir", str(d), "--dram-bytes", "32MiB"],
                        capture_output=True, text=True, cwd=REPO, timeout=120)
    assert up.returncode == 0, up.stderr
    doc = json.loads((d / "cluster.json").read_text())
    assert [n["id"] for n in doc["nodes"]] == ["node-1", "node-2", "node-3"]
    assert all(n["addr"] in up.stdout and n["addr"].startswith("127.0.0.1:") for n in doc["nodes"])
    assert doc["etcd"] in up.stdout
    pids = [n["pid"] for n in doc["nodes"]] + [doc["etcd_pid"]]
    try:
        st = subprocess.run([*run, "status", "--etcd", doc["etcd"], "--json"],
                            capture_output=True, text=True, cwd=REPO, timeout=60)
        assert st.returncode == 0, st.stderr
        rows = json.loads(st.stdout)["nodes"]
        assert [(r["node"], r["health"], r["capacity"]) for r in rows] == [
            (f"node-{i}", "ok", 32 << 20) for i in (1, 2, 3)]
        table = subprocess.run([*run, "status", "--etcd", doc["etcd"]], capture_output=True,
                               text=True, cwd=REPO, timeout=60)
        assert table.returncode == 0 and "node-3" in table.stdout and "32.0 MiB" in table.stdout
        again = subprocess.run([*run, "up", "-n", "1", "--dir", str(d)], capture_output=True,
                               text=True, cwd=REPO, timeout=60)
        assert again.returncode == 1 and "already running" in again.stderr
        assert "Traceback" not in again.stderr
    finally:
        down = subprocess.run([*run, "down", "--dir", str(d)], capture_output=True, text=True,
                              cwd=REPO, timeout=120)
    assert down.returncode == 0, down.stderr
    assert down.stdout.strip() == "stopped node-1, node-2, node-3, etcd"
    for pid in pids:
        wait_until(lambda pid=pid: not Path(f"/proc/{pid}").exists()
                   or "Z" in Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2][:3],
                   timeout=10, what=f"pid {pid} gone")
    bad = subprocess.run([*run, "status", "--etcd", "127.0.0.1:1"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert bad.returncode == 1 and "Traceback" not in bad.stderr and bad.stderr.strip()


def test_up_returns_once_every_node_sees_every_node(cluster: LocalCluster) -> None:
    """A node that joined first learns of later ones through its watch; ``up`` waits for
    that, or the first replicated put it masters finds too few nodes for its quorum."""
    for rec in cluster.nodes:
        with Client(rec.addr, transport="grpc", timeout=5) as c:
            assert c.stats()["node"]["cluster_members"] == 3, rec.id


def test_sigterm_leaves_at_once_and_a_new_node_joins(cluster: LocalCluster) -> None:
    assert _members(cluster) == {"node-1", "node-2", "node-3"}
    with EtcdMembership(cluster.etcd) as watch:
        cluster.start_node("node-4", extra=["--lease-ttl", "60"])
        assert watch.wait_for(lambda v: len(v) == 4, 10)
        t0 = time.monotonic()
        cluster.stop_node("node-4")
        assert watch.wait_for(lambda v: "node-4" not in {m.node_id for m in v}, 10)
        assert time.monotonic() - t0 < 30  # revoked, not expired (the lease was 60 s)


# New keys one load thread puts at most: with the 300 first and two threads, 3,300 blocks of
# 8-12 KiB, two copies each, fit the two survivors' 64 MiB whole (a block evicted would read
# as lost). A fast machine put 7,000 in the seconds the test runs, and the nodes evicted.
MAX_PUTS = 1_500


def _load(client: ClusterClient, acked: dict[int, bytes], stop: threading.Event,
          errors: list[str], read_failures: list[str], start: int) -> None:
    """Puts up to ``MAX_PUTS`` new keys and reads back acknowledged ones until ``stop``."""
    i = start
    rng = random.Random(start)
    while not stop.is_set():
        if i < start + MAX_PUTS:
            try:
                client.put(_key(i), _value(i))
                acked[i] = _value(i)
            except KVStoreError as exc:
                errors.append(str(exc))
            i += 1
        if acked:
            j = rng.choice(list(acked))
            try:
                got = client.get(_key(j))
            except KVStoreError as exc:
                read_failures.append(f"{j}: {exc}")
                continue
            if got != acked[j]:
                read_failures.append(f"{j}: {'miss' if got is None else 'wrong bytes'}")


def test_kill_9_under_load_loses_no_acknowledged_block(cluster: LocalCluster) -> None:
    acked: dict[int, bytes] = {}
    errors: list[str] = []
    read_failures: list[str] = []
    stop = threading.Event()
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, node_timeout=2.0) as client:
        client.put_batch([_key(i) for i in range(300)], [_value(i) for i in range(300)])
        acked.update({i: _value(i) for i in range(300)})
        threads = [threading.Thread(target=_load, args=(client, acked, stop, errors,
                                                        read_failures, 10_000 * (t + 1)))
                   for t in range(2)]
        for t in threads:
            t.start()
        time.sleep(0.5)
        victim = cluster.node("node-2")
        os.kill(victim.pid, signal.SIGKILL)
        killed = time.monotonic()
        time.sleep(TTL + 1.0)
        stop.set()
        for t in threads:
            t.join()
        assert not read_failures, read_failures[:5]
        keys = sorted(acked)
        got = client.get_batch([_key(i) for i in keys])
        assert [g == acked[i] for g, i in zip(got, keys, strict=True)] == [True] * len(keys)
        # repair: every acknowledged block back to two copies on the survivors
        ks = [_key(i) for i in keys]
        deadline = killed + 60
        while (counts := _copies(cluster, ks, {"node-2"})) and min(counts) < 2:
            assert time.monotonic() < deadline, f"{counts.count(1)} blocks still single"
            time.sleep(0.2)
        repaired_in = time.monotonic() - killed
        for rec in cluster.nodes:  # the premise: the load fit, nothing was evicted
            if rec.id != "node-2":
                with Client(rec.addr, transport="grpc", timeout=5) as c:
                    assert c.stats()["tiers"]["dram"]["evictions"] == 0, rec.id
    print(f"\n{len(keys)} acknowledged blocks, {len(errors)} puts refused during the kill, "
          f"two copies of every block {repaired_in:.1f}s after kill -9 (lease TTL {TTL}s)")


def test_sigstop_past_the_ttl_drops_the_node_and_sigcont_brings_it_back(
        cluster: LocalCluster) -> None:
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2, node_timeout=1.0) as client:
        keys = [_key(i) for i in range(200)]
        client.put_batch(keys, [_value(i) for i in range(200)])
        cluster.signal_node("node-1", signal.SIGSTOP)
        wait_until(lambda: "node-1" not in {m.node_id for m in client.members()},
                   timeout=TTL + 15, what="node-1 dropped from membership")
        t0 = time.monotonic()
        assert client.get_batch(keys) == [_value(i) for i in range(200)]
        assert time.monotonic() - t0 < 1.0  # went elsewhere: no timeouts on the stopped node
        client.put(_key(500), _value(500))  # writes place over the live two
        cluster.signal_node("node-1", signal.SIGCONT)
        wait_until(lambda: "node-1" in {m.node_id for m in client.members()},
                   timeout=TTL + 15, what="node-1 re-registered")
        with Client(cluster.node("node-1").addr, timeout=5) as direct:
            held = [k for k, e in zip(keys, direct.exists(keys), strict=True) if e]
            assert held  # it kept its blocks, and serves them byte for byte
            assert direct.get_batch(held) == [_value(keys.index(k)) for k in held]
        assert client.get_batch([*keys, _key(500)]) == [_value(i) for i in range(200)] + [
            _value(500)]


def test_etcd_restart_under_load(cluster: LocalCluster) -> None:
    acked: dict[int, bytes] = {}
    errors: list[str] = []
    read_failures: list[str] = []
    stop = threading.Event()
    etcd = cluster._etcd
    assert etcd is not None
    with Client(etcd=cluster.etcd, replicas=2, write_quorum=2) as client:
        thread = threading.Thread(target=_load, args=(client, acked, stop, errors,
                                                      read_failures, 0))
        thread.start()
        time.sleep(0.3)
        etcd.restart()
        time.sleep(0.5)
        cluster.start_node("node-4")  # membership changes after the restart are seen
        wait_until(lambda: len(client.members()) == 4, timeout=20, what="client sees node-4")
        stop.set()
        thread.join()
        assert not errors and not read_failures, (errors[:3], read_failures[:3])
        assert _members(cluster) == {"node-1", "node-2", "node-3", "node-4"}
        for nid, st in client.stats().items():
            assert st["node"]["etcd_connected"] is True, nid
        keys = sorted(acked)
        assert len(keys) > 10
        assert client.get_batch([_key(i) for i in keys]) == [acked[i] for i in keys]


def test_cli_put_get_stat_through_the_cluster(cluster: LocalCluster, tmp_path: Path) -> None:
    src = tmp_path / "value.bin"
    src.write_bytes(_value(42))
    key = _key(42).hex()
    run = [sys.executable, "-m", "kvstore"]
    put = subprocess.run([*run, "put", "--etcd", cluster.etcd, key, str(src)],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert put.returncode == 0 and put.stdout.startswith(f"stored {key}"), put.stderr
    assert _copies(cluster, [_key(42)], set()) == [2]
    get = subprocess.run([*run, "get", "--etcd", cluster.etcd, key], capture_output=True,
                         cwd=REPO, timeout=60)
    assert get.returncode == 0 and get.stdout == _value(42)
    stat = subprocess.run([*run, "stat", "--etcd", cluster.etcd], capture_output=True,
                          text=True, cwd=REPO, timeout=60)
    assert stat.returncode == 0
    assert [ln for ln in stat.stdout.splitlines() if ln.startswith("== ")] == [
        "== node-1", "== node-2", "== node-3"]
    assert "repair_backlog=" in stat.stdout


def test_a_node_joining_empty_is_warmed_at_the_repair_rate(tmp_path: Path) -> None:
    rate, burst, block = 1 << 20, 256 << 10, 64 << 10  # burst = rate * 0.25 s
    args = [*NODE_ARGS, "--repair-bytes-per-s", str(rate)]
    c = LocalCluster.up(tmp_path / "warm", 3, node_args=args)
    try:
        keys = [_key(i) for i in range(160)]
        value = random.Random(3).randbytes(block)
        with Client(etcd=c.etcd, replicas=2, write_quorum=2) as client:
            client.put_batch(keys, [value] * len(keys))
            t0 = time.monotonic()
            rec = c.start_node("node-4")
            wait_until(lambda: len(client.members()) == 4, timeout=10, what="node-4 seen")
            owners = [client._current().placement.owners(k, 2) for k in keys]
            wanted = sum("node-4" in o for o in owners)
            assert wanted > 40
            samples = []
            with Client(rec.addr, transport="grpc") as new:
                while (held := sum(new.exists(keys))) < wanted:
                    t = time.monotonic() - t0
                    samples.append((t, held))
                    # three senders, each at most a burst + rate * t + one block of debt
                    assert held * block <= 3 * (burst + rate * t + block), samples
                    assert time.monotonic() - t0 < 60, samples
                    time.sleep(0.1)
                assert sum(new.exists(keys)) == wanted  # exactly the keys it now owns
        took = time.monotonic() - t0
        assert len(samples) >= 3  # it took several looks: gradual, not one flood
        print(f"\nnode-4 warmed with {wanted} blocks ({wanted * block >> 20} MiB) in "
              f"{took:.1f}s at a {rate >> 20} MiB/s per-node repair cap")
    finally:
        c.down(timeout=10)


def test_drain_hands_off_every_block_then_stops_the_node(tmp_path: Path) -> None:
    args = [*NODE_ARGS, "--replicas", "1"]  # the last flag wins: one copy per block
    cluster = LocalCluster.up(tmp_path / "one-copy", 3, node_args=args)
    try:
        keys = [_key(i) for i in range(400)]
        values = [_value(i) for i in range(400)]
        with Client(etcd=cluster.etcd, replicas=1) as client:
            client.put_batch(keys, values)
            victim = cluster.node("node-2")
            with Client(victim.addr, transport="grpc") as direct:
                held = sum(direct.exists(keys))  # only node-2 holds these
                assert direct.stats()["tiers"]["dram"]["blocks"] == held > 50
            out = subprocess.run([sys.executable, "-m", "kvstore", "drain", "--addr",
                                  victim.addr], capture_output=True, text=True, cwd=REPO,
                                 timeout=120)
            assert out.returncode == 0, out.stderr
            assert out.stdout.startswith(
                f"drained {victim.addr}: {held} blocks; {held} copies made"), out.stdout
            cluster._procs[victim.pid].wait(timeout=30)
            assert cluster._procs[victim.pid].returncode == 0
            assert "node-2" not in {m.node_id for m in client.members()}
            assert client.get_batch(keys) == values  # nothing lost, served by the two left
        assert _copies(cluster, keys, {"node-2"}) == [1] * 400
        bad = subprocess.run([sys.executable, "-m", "kvstore", "drain", "--addr",
                              "127.0.0.1:1", "--timeout", "3"], capture_output=True, text=True,
                             cwd=REPO, timeout=60)
        assert bad.returncode == 1 and "Traceback" not in bad.stderr
    finally:
        cluster.down(timeout=10)


def test_drain_of_a_single_node_is_refused(tmp_path: Path) -> None:
    from conftest import start_node

    n = start_node(tmp_path)
    try:
        out = subprocess.run([sys.executable, "-m", "kvstore", "drain", "--addr", n.addr],
                             capture_output=True, text=True, cwd=REPO, timeout=60)
        assert out.returncode == 1 and "not in a cluster" in out.stderr
        assert n.proc.poll() is None  # still serving
    finally:
        n.stop()
