"""A cluster on this machine: a real etcd and N ``kvstore serve`` processes on loopback.

Used by ``kvstore cluster up/down``, the cluster tests and ``kvstore bench cluster``.
``DIR/cluster.json`` records what was started::

    {"etcd": "HOST:PORT", "etcd_pid": PID,
     "nodes": [{"id": "node-1", "addr": "127.0.0.1:PORT", "pid": PID}, ...]}

``down`` stops exactly those processes: each PID is checked first (a node must
still run in this cluster's directory, etcd must name it in its command line),
so a PID reused by an unrelated process after a crash is never signalled. Nodes
run with the cluster directory as their working directory: relative paths in
``node_args`` (``--ssd-path``) resolve there.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TypeVar

from replication.membership.etcd_server import EtcdServer

MANIFEST = "cluster.json"
_SERVING = re.compile(r"kvstore: serving on (\S+) ")
_JOINED = "kvstore: joined cluster"
_VIEW = re.compile(r"kvstore: cluster view: (\d+) members")
T = TypeVar("T")


class ClusterError(RuntimeError):
    """A local cluster could not be started or stopped."""


@dataclass(slots=True, kw_only=True)
class NodeRecord:
    id: str
    addr: str
    pid: int


@dataclass(slots=True, kw_only=True)
class LocalCluster:
    dir: Path
    etcd: str
    etcd_pid: int
    nodes: list[NodeRecord] = field(default_factory=list)
    node_args: list[str] = field(default_factory=list)  # extra ``serve`` flags for every node
    _procs: dict[int, subprocess.Popen[bytes]] = field(default_factory=dict, repr=False)
    _etcd: EtcdServer | None = field(default=None, repr=False)

    # ---- starting ------------------------------------------------------------------------

    @classmethod
    def up(cls, directory: str | Path, n: int, *, node_args: Sequence[str] = (),
           zones: Sequence[str] = (), timeout: float = 60.0) -> LocalCluster:
        """Starts etcd and ``n`` nodes (``node-1`` ...); all outlive this process."""
        if n < 1:
            raise ClusterError(f"a cluster needs at least one node, got -n {n}")
        d = Path(directory).resolve()
        if (d / MANIFEST).exists() and _any_alive(cls.load(d)):
            raise ClusterError(f"a cluster is already running from {d}; "
                               f"run `kvstore cluster down --dir {directory}` first")
        d.mkdir(parents=True, exist_ok=True)
        etcd = EtcdServer(d / "etcd")
        etcd.start(detach=True, timeout=timeout)
        assert etcd.pid is not None
        cluster = cls(dir=d, etcd=etcd.endpoint, etcd_pid=etcd.pid, node_args=list(node_args),
                      _etcd=etcd)
        try:
            for i in range(n):
                cluster.start_node(f"node-{i + 1}", zone=zones[i % len(zones)] if zones else "",
                                   wait=False)
            for rec in cluster.nodes:
                cluster._wait_joined(rec, timeout)
            cluster._wait_converged(timeout)
        except BaseException:
            cluster.down()
            raise
        return cluster

    def start_node(self, node_id: str, *, zone: str = "", extra: Sequence[str] = (),
                   wait: bool = True, timeout: float = 60.0,
                   env: Mapping[str, str] | None = None) -> NodeRecord:
        """Starts ``kvstore serve`` as ``node_id`` (``env``: variables added to this
        process's environment for it)."""
        log = self.dir / f"{node_id}.log"
        cmd = [sys.executable, "-m", "kvstore", "serve", "--listen", "127.0.0.1:0",
               "--etcd", self.etcd, "--node-id", node_id, "--zone", zone,
               *self.node_args, *extra]
        with open(log, "wb") as out:
            proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=self.dir,
                                    stdin=subprocess.DEVNULL, start_new_session=True,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})})
        self._procs[proc.pid] = proc
        rec = NodeRecord(id=node_id, addr="", pid=proc.pid)
        self.nodes.append(rec)
        if wait:
            self._wait_joined(rec, timeout)
        return rec

    def _wait_log(self, rec: NodeRecord, deadline: float, found: Callable[[str], T | None],
                  what: str) -> T:
        """Polls ``rec``'s log until ``found(text)`` is not None and returns it; a node
        that exits or is past ``deadline`` raises, its log's end attached."""
        log = self.dir / f"{rec.id}.log"
        while True:
            text = log.read_text(errors="replace") if log.exists() else ""
            if (result := found(text)) is not None:
                return result
            if not _alive(rec.pid, self._procs):
                raise ClusterError(f"{rec.id} exited before it {what}:\n{text[-2000:]}")
            if time.monotonic() > deadline:
                raise ClusterError(f"{rec.id} had not {what} by the deadline:\n"
                                   f"{text[-2000:]}")
            time.sleep(0.05)

    def _wait_joined(self, rec: NodeRecord, timeout: float) -> None:
        def addr(text: str) -> str | None:
            m = _SERVING.search(text)
            return m.group(1) if m and _JOINED in text else None

        rec.addr = self._wait_log(rec, time.monotonic() + timeout, addr, "joined")
        self.save()

    def _wait_converged(self, timeout: float) -> None:
        """Returns once every node's own membership view holds every node (the last
        ``kvstore: cluster view`` line each node printed).

        A node that joined first learns of the later ones through its etcd watch, some
        milliseconds after they register: a replicated put it masters before then sees
        too few nodes for its write quorum and fails."""
        want = len(self.nodes)

        def all_seen(text: str) -> bool | None:
            views = _VIEW.findall(text)
            return True if views and int(views[-1]) >= want else None

        deadline = time.monotonic() + timeout
        for rec in self.nodes:
            self._wait_log(rec, deadline, all_seen, f"seen all {want} nodes")

    # ---- the manifest --------------------------------------------------------------------

    def save(self) -> None:
        doc = {"etcd": self.etcd, "etcd_pid": self.etcd_pid,
               "nodes": [asdict(r) for r in self.nodes if r.addr]}
        tmp = self.dir / (MANIFEST + ".tmp")
        tmp.write_text(json.dumps(doc, indent=2) + "\n")
        tmp.replace(self.dir / MANIFEST)

    @classmethod
    def load(cls, directory: str | Path) -> LocalCluster:
        d = Path(directory).resolve()
        try:
            doc = json.loads((d / MANIFEST).read_text())
            return cls(dir=d, etcd=doc["etcd"], etcd_pid=int(doc["etcd_pid"]),
                       nodes=[NodeRecord(id=r["id"], addr=r["addr"], pid=int(r["pid"]))
                              for r in doc["nodes"]])
        except FileNotFoundError:
            raise ClusterError(f"no {MANIFEST} in {d}: nothing was started there") from None
        except (ValueError, KeyError, TypeError) as exc:
            raise ClusterError(f"{d / MANIFEST} is not a cluster manifest: {exc}") from None

    # ---- stopping ------------------------------------------------------------------------

    def node(self, node_id: str) -> NodeRecord:
        for r in self.nodes:
            if r.id == node_id:
                return r
        raise ClusterError(f"no node {node_id!r} in this cluster")

    def signal_node(self, node_id: str, sig: int, *, timeout: float = 10.0) -> None:
        """Sends ``sig``; for SIGSTOP, returns once the process is stopped (a signal is
        delivered when the process next runs, which on a loaded machine is later than
        ``kill`` returns, and a caller relies on the node being silent from here on)."""
        rec = self.node(node_id)
        if not self._ours(rec.pid):
            return
        os.kill(rec.pid, sig)
        if sig != signal.SIGSTOP:
            return
        deadline = time.monotonic() + timeout
        while _proc_state(rec.pid) not in ("T", None):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{node_id} (pid {rec.pid}) did not stop in {timeout} s")
            time.sleep(0.005)

    def kill_node(self, node_id: str, *, timeout: float = 20.0) -> None:
        """SIGKILL, as a crash: returns once the process is gone. The node stays in the
        manifest (and in etcd until its lease expires)."""
        rec = self.node(node_id)
        if not self._ours(rec.pid):
            return
        with contextlib.suppress(ProcessLookupError):
            os.kill(rec.pid, signal.SIGKILL)
        deadline = time.monotonic() + timeout
        while _alive(rec.pid, self._procs):
            if time.monotonic() > deadline:
                raise ClusterError(f"{node_id} (pid {rec.pid}) outlived SIGKILL")
            time.sleep(0.01)

    def stop_node(self, node_id: str, *, timeout: float = 20.0) -> None:
        rec = self.node(node_id)
        self._stop_pid(rec.pid, timeout)
        self.nodes.remove(rec)
        self.save()

    def down(self, *, timeout: float = 20.0) -> list[str]:
        """Stops every node (SIGTERM, then SIGKILL after ``timeout``), then etcd."""
        stopped = []
        for rec in list(self.nodes):
            if self._stop_pid(rec.pid, timeout):
                stopped.append(rec.id)
        if self._etcd is not None:
            self._etcd.stop(timeout=timeout)
            stopped.append("etcd")
        elif self._stop_pid(self.etcd_pid, timeout):
            stopped.append("etcd")
        with contextlib.suppress(FileNotFoundError):
            (self.dir / MANIFEST).unlink()
        return stopped

    def _ours(self, pid: int) -> bool:
        """True if ``pid`` is alive and was started for this cluster: a node runs in the
        cluster's directory, etcd names it in its command line."""
        if pid in self._procs:
            return self._procs[pid].poll() is None
        try:
            cwd = os.readlink(f"/proc/{pid}/cwd")
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ")
        except OSError:
            return False
        mine = cwd == str(self.dir) or str(self.dir).encode() in cmdline
        return mine and _alive(pid, {})

    def _stop_pid(self, pid: int, timeout: float) -> bool:
        if not self._ours(pid):
            return False
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)
        deadline = time.monotonic() + timeout
        while _alive(pid, self._procs):
            if time.monotonic() > deadline:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
                deadline = time.monotonic() + timeout
            time.sleep(0.05)
        return True


def _alive(pid: int, procs: dict[int, subprocess.Popen[bytes]]) -> bool:
    if pid in procs:
        return procs[pid].poll() is None
    return _proc_state(pid) not in (None, "Z")  # a zombie has exited


def _any_alive(cluster: LocalCluster) -> bool:
    return any(cluster._ours(p) for p in [cluster.etcd_pid, *(r.pid for r in cluster.nodes)])


def _proc_state(pid: int) -> str | None:
    """The state letter of ``pid`` in /proc (``T``: stopped), or None if it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return stat.rpartition(")")[2].split()[0]  # the name in parentheses may hold spaces
