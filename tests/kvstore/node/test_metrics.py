"""Prometheus metrics of real node processes (``kvstore serve --metrics-listen``).

Counters are exact: a fresh node, a known sequence of calls, and the scraped
values must equal those counts, not approximate them.
"""

from __future__ import annotations

import fcntl
import json
import os
import re
import socket
import struct
import subprocess
import sys
import termios
import threading
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from conftest import REPO, NodeProcess, free_port, start_node, wait_until
from prometheus_client.parser import text_string_to_metric_families

from kvstore import Client
from kvstore.core.errors import ResourceExhausted
from kvstore.node.metrics import METRICS

if TYPE_CHECKING:
    from replication.membership.etcd_server import EtcdServer

pytest_plugins = ["etcd_fixtures"]

DASHBOARD = REPO / "deploy" / "grafana" / "kvstore-dashboard.json"
SUFFIXES = {"counter": ("",), "gauge": ("",), "info": ("",),
            "histogram": ("_bucket", "_sum", "_count")}


class MetricsNode:
    """A node process and its /metrics URL."""

    def __init__(self, node: NodeProcess, url: str) -> None:
        self.node = node
        self.url = url

    def scrape_text(self) -> str:
        with urllib.request.urlopen(self.url, timeout=10) as r:
            return r.read().decode()

    def scrape(self) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        """Every sample: (name, sorted labels) -> value."""
        out = {}
        for family in text_string_to_metric_families(self.scrape_text()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out


def start_metrics_node(tmp_path: Path, *extra: str, dram: str = "64MiB") -> MetricsNode:
    port = free_port()
    node = start_node(tmp_path, "--metrics-listen", f"127.0.0.1:{port}", *extra, dram=dram)
    assert f"kvstore: metrics on http://127.0.0.1:{port}/metrics" in node.output()
    return MetricsNode(node, f"http://127.0.0.1:{port}/metrics")


@pytest.fixture
def mnode(tmp_path: Path) -> Iterator[MetricsNode]:
    m = start_metrics_node(tmp_path)
    try:
        yield m
    finally:
        code = m.node.stop()
    assert code == 0, m.node.output()


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), 0.0)


def test_grpc_counters_and_latency_counts_are_exact(mnode: MetricsNode) -> None:
    puts, hits, misses, size = 7, 5, 3, 1000
    keys = [os.urandom(16) for _ in range(puts)]
    with Client(mnode.node.addr, transport="grpc") as c:
        for i, k in enumerate(keys):
            assert c.put(k, bytes([i]) * size)
        for k in keys[:hits]:
            assert c.get(k) is not None
        for _ in range(misses):
            assert c.get(os.urandom(16)) is None
    s = mnode.scrape()
    dram = {"tier": "dram"}
    assert value(s, "kvstore_tier_puts_total", **dram) == puts
    assert value(s, "kvstore_puts_total") == puts
    assert value(s, "kvstore_tier_blocks", **dram) == puts
    assert value(s, "kvstore_tier_bytes_in_total", **dram) == puts * size
    assert value(s, "kvstore_tier_hits_total", **dram) == hits
    assert value(s, "kvstore_tier_misses_total", **dram) == misses
    assert value(s, "kvstore_gets_total") == hits + misses
    assert value(s, "kvstore_tier_bytes_out_total", **dram) == hits * size
    assert value(s, "kvstore_tier_capacity_bytes", **dram) == 64 << 20
    assert value(s, "kvstore_tier_evictions_total", **dram) == 0
    # Latency histograms: one observation per call, per method (a put is a BatchPut).
    h = "kvstore_grpc_request_duration_seconds"
    assert value(s, f"{h}_count", method="BatchPut") == puts
    assert value(s, f"{h}_count", method="BatchGet") == hits + misses
    assert value(s, f"{h}_bucket", method="BatchGet", le="+Inf") == hits + misses
    assert value(s, f"{h}_sum", method="BatchGet") > 0
    assert value(s, "kvstore_grpc_requests_total", method="BatchPut", code="OK") == puts
    assert value(s, "kvstore_grpc_requests_total", method="BatchGet", code="OK") == hits + misses
    calls = {dict(k[1])["method"] for k in s if k[0] == f"{h}_count"}
    assert calls == {"BatchPut", "BatchGet"}  # nothing else was called
    assert value(s, "kvstore_node_in_flight_requests") == 0
    assert value(s, "kvstore_node_draining") == 0
    assert value(s, "kvstore_node_info", policy="lru", node_id="", zone="", hbm_device="",
                 ssd_io="") == 1
    # The scrape equals what the Stats RPC reports.
    with Client(mnode.node.addr, transport="grpc") as c:
        stats = c.stats()["tiers"]["dram"]
    assert (stats["hits"], stats["misses"], stats["puts"]) == (hits, misses, puts)


def test_channel_ops_are_timed_per_op(mnode: MetricsNode) -> None:
    puts, gets = 4, 6
    keys = [os.urandom(16) for _ in range(puts)]
    with Client(mnode.node.addr, transport="tcp") as c:
        for k in keys:
            assert c.put(k, b"v" * 100)
        for i in range(gets):
            c.get(keys[i % puts])
        assert c.exists(keys) == [True] * puts
    h = "kvstore_channel_request_duration_seconds_count"
    # A channel op is observed just after its reply is sent: wait for the last one.
    wait_until(lambda: value(mnode.scrape(), h, op="EXISTS") == 1, what="the EXISTS op")
    s = mnode.scrape()
    assert value(s, h, op="PUT") == puts
    assert value(s, h, op="GET") == gets
    assert value(s, "kvstore_channel_requests_total", op="GET", code="OK") == gets
    assert value(s, "kvstore_tier_hits_total", tier="dram") == gets
    # gRPC carried only the negotiation.
    grpc_calls = {dict(k[1])["method"]: v for k, v in s.items()
                  if k[0] == "kvstore_grpc_request_duration_seconds_count"}
    assert grpc_calls == {"OpenChannel": 1}


def test_channel_errors_are_counted_by_code(tmp_path: Path) -> None:
    m = start_metrics_node(tmp_path, dram="4MiB")
    try:
        with Client(m.node.addr, transport="tcp") as c:
            assert c.put(os.urandom(16), b"p" * (3 << 20), pin=True)
            with pytest.raises(ResourceExhausted):  # the rest does not fit, the pin stays
                c.put(os.urandom(16), b"x" * (2 << 20))
        wait_until(lambda: value(m.scrape(), "kvstore_channel_requests_total", op="PUT",
                                 code="RESOURCE_EXHAUSTED") == 1, what="the failed PUT")
    finally:
        assert m.node.stop() == 0, m.node.output()


def test_exported_families_are_exactly_the_declared_ones(mnode: MetricsNode) -> None:
    """The reference in docs/metrics.md is generated from METRICS: the exporter must match it."""
    with Client(mnode.node.addr, transport="tcp") as c:
        c.put(os.urandom(16), b"v")
    wait_until(lambda: "kvstore_channel_request_duration_seconds_count" in mnode.scrape_text(),
               what="a channel observation")
    families = {f.name: f for f in text_string_to_metric_families(mnode.scrape_text())
                if f.name.startswith("kvstore_")}
    # Families are named without a counter's _total (the samples carry it).
    declared = {m.name.removesuffix("_total") if m.type == "counter" else m.name: m
                for m in METRICS}
    assert set(families) == set(declared)
    for name, f in families.items():
        spec = declared[name]
        # The text format (0.0.4) has no info type: an info metric is a gauge of 1.
        assert f.type == ("gauge" if spec.type == "info" else spec.type), name
        assert f.documentation == spec.help, name
        for s in f.samples:
            assert set(s.labels) - {"le"} == set(spec.labels), (name, s.labels)


def test_grafana_dashboard_queries_only_exported_metrics(mnode: MetricsNode) -> None:
    dash = json.loads(DASHBOARD.read_text())
    assert dash["title"] and dash["uid"] and isinstance(dash["schemaVersion"], int)
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    exprs = []
    for p in dash["panels"]:
        assert {"type", "title", "gridPos"} <= set(p)
        assert {"h", "w", "x", "y"} <= set(p["gridPos"])
        assert p["gridPos"]["x"] + p["gridPos"]["w"] <= 24
        if p["type"] != "row":
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["refId"] and t["expr"]
                exprs.append(t["expr"])
    for var in dash["templating"]["list"]:
        if var["type"] == "query":
            exprs.append(var["definition"])
    text = mnode.scrape_text()
    families = {f.name: f.type for f in text_string_to_metric_families(text)}
    exported = {name + (suffix or ("_total" if kind == "counter" else ""))
                for name, kind in families.items() for suffix in SUFFIXES.get(kind, ("",))}
    queried = {n for e in exprs for n in re.findall(r"\b(?:kvstore|process)_[a-z0-9_]+", e)}
    assert queried, "no metric queried"
    assert queried - exported == set()
    assert len(queried) >= 25  # the dashboard covers the exporter, not a token panel


def test_bad_metrics_listen_values_are_one_line_errors(tmp_path: Path) -> None:
    def serve(*flags: str) -> subprocess.CompletedProcess[bytes]:
        proc = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen",
                               f"127.0.0.1:{free_port()}", "--dram-bytes", "4MiB",
                               "--no-prefault", *flags], capture_output=True, cwd=REPO,
                              timeout=60)
        assert b"Traceback" not in proc.stderr + proc.stdout, proc.stderr.decode()
        return proc

    for bad in ("nonsense", "127.0.0.1:", ":9100", "127.0.0.1:99999"):
        proc = serve("--metrics-listen", bad)
        lines = proc.stderr.decode().splitlines()
        assert proc.returncode == 1, proc.stderr
        assert lines == [f"kvstore serve: error: metrics_listen must be HOST:PORT, got "
                         f"{bad!r}"]
    with socket.socket() as busy:  # a port someone else holds
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        proc = serve("--metrics-listen", f"127.0.0.1:{port}")
    lines = proc.stderr.decode().splitlines()
    assert proc.returncode == 1
    assert len(lines) == 1 and lines[0].startswith(
        f"kvstore serve: error: cannot serve metrics on 127.0.0.1:{port}: "), lines
    proc = serve("--log-format", "xml")
    assert proc.returncode == 2
    assert proc.stderr.decode().splitlines()[-1].startswith("kvstore serve: error: argument "
                                                            "--log-format")


def test_repair_metrics_and_status_watch(tmp_path: Path, etcd: EtcdServer) -> None:
    """A node joining makes the first one repair: the scrape shows the blocks and bytes it
    copied, and ``cluster status --watch`` waits (drawing its bar on a terminal) until the
    backlog is 0."""
    blocks, size = 6, 64 << 10
    flags = ("--etcd", etcd.endpoint, "--replicas", "2", "--lease-ttl", "5",
             "--repair-bytes-per-s", "64KiB")  # ~1 block/s: the backlog lasts a few seconds
    a = start_metrics_node(tmp_path, *flags, "--node-id", "a")
    b: NodeProcess | None = None
    try:
        with Client(a.node.addr, transport="grpc") as c:
            for _ in range(blocks):
                assert c.put(os.urandom(16), os.urandom(size))
        s = a.scrape()
        assert value(s, "kvstore_repaired_blocks_total") == 0
        assert value(s, "kvstore_etcd_connected") == 1
        b = start_node(tmp_path, *flags, "--node-id", "b")
        wait_until(lambda: value(a.scrape(), "kvstore_repair_backlog_blocks") > 0,
                   timeout=30, what="a repair pass with a backlog")
        primary, replica = os.openpty()  # the bar is drawn only on a terminal
        fcntl.ioctl(replica, termios.TIOCSWINSZ, struct.pack("HHHH", 24, 100, 0, 0))  # 100 cols
        watch = subprocess.Popen([sys.executable, "-m", "kvstore", "cluster", "status",
                                  "--etcd", etcd.endpoint, "--watch", "--interval", "0.2"],
                                 stdout=subprocess.PIPE, stderr=replica, cwd=REPO)
        os.close(replica)
        drawn = bytearray()

        def drain() -> None:
            while True:
                try:
                    chunk = os.read(primary, 4096)
                except OSError:  # EIO once the child closed the terminal
                    return
                if not chunk:
                    return
                drawn.extend(chunk)

        reader = threading.Thread(target=drain, daemon=True)
        reader.start()
        out, _ = watch.communicate(timeout=60)
        reader.join(timeout=5)
        os.close(primary)
        assert watch.returncode == 0, (out, drawn)
        text = drawn.decode(errors="replace")
        assert f"| {blocks}/{blocks} [" in text and "0 left" in text, text  # it reached 0
        assert "repair backlog:   0%|" in text, text  # ... from a backlog it saw
        assert b"Traceback" not in drawn
        s = a.scrape()
        assert value(s, "kvstore_repair_backlog_blocks") == 0
        assert value(s, "kvstore_repaired_blocks_total") == blocks
        assert value(s, "kvstore_repaired_bytes_total") == blocks * size
        assert value(s, "kvstore_cluster_members") == 2
        assert value(s, "kvstore_node_info", policy="lru", node_id="a", zone="",
                     hbm_device="", ssd_io="") == 1
        assert re.search(rf"^a\s+{re.escape(a.node.addr)}\s", out.decode(), re.M), out
        # Not a terminal: no bar, and with the backlog at 0 it returns at once.
        quiet = subprocess.run([sys.executable, "-m", "kvstore", "cluster", "status", "--etcd",
                                etcd.endpoint, "--watch"], capture_output=True, cwd=REPO,
                               timeout=60)
        assert quiet.returncode == 0 and quiet.stderr == b"", quiet.stderr
    finally:
        if b is not None:
            assert b.stop() == 0, b.output()
        assert a.node.stop() == 0, a.node.output()
