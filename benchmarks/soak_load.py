"""The soak run's moving parts (``benchmarks/soak.py`` runs them and reports).

* ``Soak``: etcd and three ``kvstore serve`` processes on 127.0.0.1 (``LocalCluster``) with
  an auth file (two tenants with quotas, the cluster role), and the pid of every process
  over time (a restart is a new pid);
* ``Worker``: one traffic class, one thread, a seeded mix of operations at a fixed rate,
  booked in its ``Ledger`` (``benchmarks/soak_check.py``);
* ``Chaos``: one fault at a time, seeded: SIGKILL a node (only once every acknowledged
  block has two copies again) or etcd, wait, start it again;
* ``Sampler``: every process's RSS from ``/proc/PID/status``, and each node's eviction
  counter and DRAM use from its stats.

Client traffic goes to 127.0.0.1 only, at the configured rate.
"""

from __future__ import annotations

import random
import secrets
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.soak_check import Ledger, Sample, State, stale_regions
from benchmarks.soak_memory import node_env
from kvstore.client import Client
from kvstore.core.errors import KVStoreError
from replication.local_cluster import LocalCluster
from replication.membership import EtcdMembership
from replication.membership.etcd_server import EtcdServer

NODES = ("node-1", "node-2", "node-3")
CLASSES = ("tenant-a", "tenant-b", "cluster")
LEASE_TTL = 3
REPLICAS = 2
MIB = 1 << 20
FILL_FIRST = 0.8  # of a class's budget: put before the mixed load starts
WINDOW_S = 10.0  # ops/s are counted per window of this many seconds
# The operation mix of a step (a full class removes instead of putting).
MIX = (("put", 0.30), ("put_retain", 0.10), ("get", 0.35), ("get_batch", 0.10),
       ("remove", 0.15))


@dataclass(slots=True, kw_only=True)
class SoakConfig:
    minutes: float
    seed: int = 0
    rate: float = 60.0  # operations per second, all classes together
    dram_bytes: int = 128 * MIB
    fill: float = 0.5  # of a node's DRAM: what all classes together may hold
    value_min: int = 1024
    value_max: int = 32 * 1024
    sample_s: float = 2.0
    fault_gap_s: tuple[float, float] = (20.0, 60.0)
    node_down_s: tuple[float, float] = (1.0, 8.0)
    etcd_down_s: tuple[float, float] = (1.0, 5.0)
    etcd_fault_share: float = 0.25
    warmup_s: float = 60.0
    judge_min_s: float = 120.0  # a process's judged samples must span this long to count
    spare: tuple[str, ...] = ("node-1",)  # never killed: a process that lives the whole run
    max_slope: float = 1.0  # MiB per minute
    settle_timeout_s: float = 120.0
    faults: bool = True
    tracemalloc: bool = False  # trace the first spared node and dump it (soak_memory.py)
    tracemalloc_every_s: float = 60.0
    tracemalloc_frames: int = 16  # 0: dumps without tracing (true RssAnon, allocator stats)
    tracemalloc_from_s: float = 180.0  # the dump compared with the last: the first after


@dataclass(slots=True, kw_only=True)
class ClassStats:
    ops: dict[str, int] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)  # "op: ErrorType" -> count
    error_messages: dict[str, str] = field(default_factory=dict)  # the first of each kind
    live_misses: list[str] = field(default_factory=list)  # keys an acked read missed (hex)
    wrong_reads: list[str] = field(default_factory=list)
    windows: dict[int, int] = field(default_factory=dict)  # window index -> ops

    def count(self, op: str, t: float) -> None:
        self.ops[op] = self.ops.get(op, 0) + 1
        w = int(t // WINDOW_S)
        self.windows[w] = self.windows.get(w, 0) + 1

    def error(self, op: str, exc: BaseException) -> None:
        k = f"{op}: {type(exc).__name__}"
        self.errors[k] = self.errors.get(k, 0) + 1
        self.error_messages.setdefault(k, str(exc)[:300])


class Clock:
    def __init__(self) -> None:
        self.t0 = time.monotonic()

    def __call__(self) -> float:
        return time.monotonic() - self.t0


# ---- the cluster --------------------------------------------------------------------------


class Soak:
    """The cluster, its clients, and the processes' pids over time."""

    def __init__(self, cfg: SoakConfig, directory: Path) -> None:
        self.cfg = cfg
        self.dir = directory
        self.clock = Clock()
        self.tokens = {c: secrets.token_hex(16) for c in CLASSES}
        budget = int(cfg.dram_bytes * cfg.fill / len(CLASSES))
        self.class_budget = budget
        auth = directory / "tenants.toml"
        directory.mkdir(parents=True, exist_ok=True)
        # Quota: twice a tenant's budget, so it holds however its copies are charged.
        auth.write_text("".join(
            f'[[tenant]]\nname = "{c}"\ntoken = "{self.tokens[c]}"\n'
            + (f"quota_bytes = {2 * budget}\n" if c != "cluster" else 'role = "cluster"\n')
            + "\n" for c in CLASSES))
        (directory / "peer.token").write_text(self.tokens["cluster"] + "\n")
        self.node_args = ["--dram-bytes", str(cfg.dram_bytes), "--lease-ttl", str(LEASE_TTL),
                          "--replicas", str(REPLICAS), "--repair-interval", "5",
                          "--auth-file", str(auth), "--peer-token-file",
                          str(directory / "peer.token")]
        self.etcd = EtcdServer(directory / "etcd")
        self.lock = threading.Lock()  # guards pids, started
        self.pids: dict[str, int | None] = {}
        self.started: dict[int, float] = {}  # pid -> when it started (clock)
        self.cluster: LocalCluster | None = None
        # The node traced and dumped (--tracemalloc), and where its dumps go.
        self.traced = (cfg.spare or NODES)[0] if cfg.tracemalloc else None
        self.dumps = directory / "tracemalloc"

    def up(self) -> None:
        self.etcd.start()
        assert self.etcd.pid is not None
        self.cluster = LocalCluster(dir=self.dir, etcd=self.etcd.endpoint,
                                    etcd_pid=self.etcd.pid, node_args=self.node_args)
        for nid in NODES:
            self._start(nid)
        with self.lock:
            self.pids["etcd"] = self.etcd.pid
            self.started[self.etcd.pid] = self.clock()

    def _start(self, nid: str) -> None:
        assert self.cluster is not None
        env = (node_env(self.dumps, self.cfg.tracemalloc_frames) if nid == self.traced
               else None)
        rec = self.cluster.start_node(nid, wait=True, timeout=120.0, env=env)
        with self.lock:
            self.pids[nid] = rec.pid
            self.started[rec.pid] = self.clock()

    def addrs(self) -> dict[str, str]:
        assert self.cluster is not None
        return {r.id: r.addr for r in self.cluster.nodes}

    def kill_node(self, nid: str) -> None:
        assert self.cluster is not None
        with self.lock:
            self.pids[nid] = None
        self.cluster.kill_node(nid)
        self.cluster.nodes.remove(self.cluster.node(nid))

    def restart_node(self, nid: str) -> None:
        """Starts ``nid`` again once etcd has dropped its old registration (a node id a
        live lease holds is refused)."""
        with EtcdMembership(self.etcd.endpoint) as m:
            if not m.wait_for(lambda v: nid not in {x.node_id for x in v}, 60.0):
                raise RuntimeError(f"etcd kept {nid}'s registration past 60 s")
        self._start(nid)

    def kill_etcd(self) -> None:
        with self.lock:
            self.pids["etcd"] = None
        self.etcd.kill()

    def restart_etcd(self) -> None:
        assert self.cluster is not None
        self.etcd.start()
        assert self.etcd.pid is not None
        self.cluster.etcd_pid = self.etcd.pid
        with self.lock:
            self.pids["etcd"] = self.etcd.pid
            self.started[self.etcd.pid] = self.clock()

    def down(self) -> None:
        if self.cluster is not None:
            self.cluster.down(timeout=10)
        self.etcd.stop()

    def client(self, cls: str, **options: Any) -> Any:
        """A cluster client of class ``cls`` (``replicas=2, write_quorum=2``)."""
        kw: dict[str, Any] = {"replicas": REPLICAS, "write_quorum": REPLICAS,
                              "node_timeout": 2.0, "timeout": 10.0, **options}
        return Client(etcd=self.etcd.endpoint, token=self.tokens[cls], **kw)

    def copies(self, cls: str, ledger: Ledger, ids: list[int]) -> list[int]:
        """How many nodes hold each block (exists on every node, as ``cls``)."""
        counts = [0] * len(ids)
        keys = [ledger.key(i) for i in ids]
        for addr in self.addrs().values():
            with Client(addr, transport="grpc", timeout=10.0, token=self.tokens[cls]) as c:
                for lo in range(0, len(keys), 4096):
                    for j, e in enumerate(c.exists(keys[lo:lo + 4096])):
                        counts[lo + j] += e
        return counts


# ---- load ---------------------------------------------------------------------------------


class Worker(threading.Thread):
    """One traffic class: a seeded mix of operations at ``rate`` per second."""

    def __init__(self, soak: Soak, cls: str, rate: float, stop: threading.Event) -> None:
        super().__init__(name=f"soak-{cls}", daemon=True)
        self.soak = soak
        self.cls = cls
        self.rate = rate
        self.halt = stop
        self.rng = random.Random(f"{soak.cfg.seed}/load/{cls}")
        self.ledger = Ledger(cls=cls, tag=CLASSES.index(cls) + 1, seed=soak.cfg.seed)
        self.stats = ClassStats()
        self.idle = threading.Event()  # set between steps: the ledger may be read
        self.idle.set()
        self.ledger_lock = threading.Lock()  # held by a step, and by readers of the ledger
        self.failure: BaseException | None = None

    def run(self) -> None:
        try:
            with self.soak.client(self.cls) as client:
                self.fill(client)
                step = 1.0 / self.rate
                next_t = self.soak.clock()
                while not self.halt.is_set():
                    now = self.soak.clock()
                    if now < next_t:
                        self.halt.wait(next_t - now)
                        continue
                    next_t = max(next_t + step, now - 1.0)  # at most 1 s of backlog
                    with self.ledger_lock:
                        self.step(client)
        except BaseException as exc:  # reported, never silent
            self.failure = exc

    def fill(self, client: Any) -> None:
        """Puts batches of new blocks until the class holds ``FILL_FIRST`` of its budget:
        the run then starts near the size it keeps (puts and removes balance at the budget),
        so growth of the data set does not pass for growth of memory."""
        cfg, led, rng = self.soak.cfg, self.ledger, self.rng
        while (led.held_bytes < FILL_FIRST * self.soak.class_budget
               and not self.halt.is_set()):
            with self.ledger_lock:
                ids = [led.new(rng.randint(cfg.value_min, cfg.value_max)) for _ in range(16)]
                try:
                    client.put_batch([led.key(i) for i in ids], [led.value(i) for i in ids])
                except Exception as exc:
                    for i in ids:
                        led.refused(i)
                    self.stats.error("fill", exc)
                else:
                    for i in ids:
                        led.acked(i)
            self.stats.count("fill", self.soak.clock())

    def _op(self) -> str:
        cfg = self.soak.cfg
        if self.ledger.held_bytes + cfg.value_max > self.soak.class_budget:
            return "remove"
        x = self.rng.random()
        for op, w in MIX:
            if x < w:
                return op
            x -= w
        return MIX[-1][0]

    def step(self, client: Any) -> None:
        cfg, led, st, rng = self.soak.cfg, self.ledger, self.stats, self.rng
        op = self._op()
        if op in ("put", "put_retain"):
            i = led.new(rng.randint(cfg.value_min, cfg.value_max))
            retain = rng.uniform(5.0, 60.0) if op == "put_retain" else None
            try:
                client.put(led.key(i), led.value(i), retain_s=retain)
            except Exception as exc:
                led.refused(i)
                st.error(op, exc)
            else:
                led.acked(i)
        elif op == "remove":
            held = led.pick_held(rng)
            if held is None:
                return
            try:
                client.remove(led.key(held))
            except Exception as exc:
                led.refused(held)
                st.error(op, exc)
            else:
                led.removed(held)
        else:
            n = 1 if op == "get" else rng.randint(2, 8)
            ids = [j for _ in range(n) if (j := led.pick_live(rng)) is not None]
            if not ids:
                return
            try:
                got = client.get_batch([led.key(i) for i in ids])
            except Exception as exc:
                st.error(op, exc)
            else:
                for i, v in zip(ids, got, strict=True):
                    if v is None:
                        st.live_misses.append(led.key(i).hex())
                    elif v != led.value(i):
                        st.wrong_reads.append(led.key(i).hex())
        st.count(op, self.soak.clock())

    def live_snapshot(self) -> list[int]:
        with self.ledger_lock:
            return self.ledger.live_ids()


# ---- faults -------------------------------------------------------------------------------


@dataclass(slots=True, kw_only=True)
class Fault:
    t: float
    what: str
    down_s: float = 0.0
    recovered_s: float | None = None  # from the kill to serving again
    settle_s: float | None = None  # the wait for two copies before a node kill
    skipped: str = ""


class Chaos(threading.Thread):
    """One fault at a time, seeded; whatever it kills it starts again before it stops."""

    def __init__(self, soak: Soak, workers: Sequence[Worker], stop: threading.Event) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.soak = soak
        self.workers = workers
        self.halt = stop
        self.rng = random.Random(f"{soak.cfg.seed}/chaos")
        self.faults: list[Fault] = []
        self.failure: BaseException | None = None

    def run(self) -> None:
        cfg = self.soak.cfg
        if not cfg.faults:
            return
        try:
            while not self.halt.wait(self.rng.uniform(*cfg.fault_gap_s)):
                if self.rng.random() < cfg.etcd_fault_share:
                    self._etcd_fault(self.rng.uniform(*cfg.etcd_down_s))
                else:
                    victims = [n for n in NODES if n not in cfg.spare]
                    if victims:
                        self._node_fault(self.rng.choice(victims),
                                         self.rng.uniform(*cfg.node_down_s))
        except BaseException as exc:
            self.failure = exc

    def _node_fault(self, nid: str, down_s: float) -> None:
        soak = self.soak
        t = soak.clock()
        fault = Fault(t=round(t, 1), what=f"SIGKILL {nid}", down_s=round(down_s, 1))
        self.faults.append(fault)
        settled = wait_two_copies(soak, self.workers, soak.cfg.settle_timeout_s,
                                  abort=self.halt)
        fault.settle_s = None if settled is None else round(settled, 1)
        if settled is None:
            fault.skipped = ("the run ended first" if self.halt.is_set() else
                             "blocks with fewer than two copies past the settle timeout")
            return
        fault.t = round(soak.clock(), 1)
        soak.kill_node(nid)
        time.sleep(down_s)  # a crash: not cut short by the end of the run
        soak.restart_node(nid)
        fault.recovered_s = round(soak.clock() - fault.t, 1)

    def _etcd_fault(self, down_s: float) -> None:
        soak = self.soak
        fault = Fault(t=round(soak.clock(), 1), what="SIGKILL etcd", down_s=round(down_s, 1))
        self.faults.append(fault)
        soak.kill_etcd()
        time.sleep(down_s)
        soak.restart_etcd()
        with EtcdMembership(soak.etcd.endpoint) as m:  # every node registered again
            m.wait_for(lambda v: {x.node_id for x in v} >= set(NODES), 60.0)
        fault.recovered_s = round(soak.clock() - fault.t, 1)


def wait_two_copies(soak: Soak, workers: Sequence[Worker], timeout: float, *,
                    abort: threading.Event | None = None) -> float | None:
    """Seconds until every acknowledged block of every class is on at least two nodes,
    or None after ``timeout`` (or once ``abort`` is set)."""
    t0 = time.monotonic()
    while abort is None or not abort.is_set():
        short = 0
        for w in workers:
            ids = w.live_snapshot()
            counts = soak.copies(w.cls, w.ledger, ids)
            # A block removed since the snapshot reads as short: only LIVE ones count.
            with w.ledger_lock:
                short += sum(c < REPLICAS and w.ledger.state[i] is State.LIVE
                             for i, c in zip(ids, counts, strict=True))
        if not short:
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return None
        time.sleep(1.0)
    return None


# ---- sampling -----------------------------------------------------------------------------


STATUS_FIELDS = ("VmRSS", "RssAnon", "RssShmem")
"""What ``/proc/PID/status`` tells of a process's memory, in kB: all resident pages; the
private ones (the heap: where leaked objects live); shared memory (a node's own DRAM region,
prefaulted, and the pages it touched of its peers' regions, mapped for same-host copies)."""


def memory_mib(pid: int) -> dict[str, float] | None:
    """``STATUS_FIELDS`` of ``pid`` in MiB, or None once it is gone."""
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                name = line.split(":", 1)[0]
                if name in STATUS_FIELDS:
                    out[name] = round(int(line.split()[1]) / 1024, 2)
    except OSError:
        return None
    return out if len(out) == len(STATUS_FIELDS) else None


def shm_regions(pid: int) -> set[int]:
    """The inodes of the kvstore DRAM regions (memfds) ``pid`` maps. Python's mmap keeps
    a duplicate of the descriptor it mapped, so every mapping shows among the process's
    descriptors."""
    out: set[int] = set()
    try:
        fds = list(Path(f"/proc/{pid}/fd").iterdir())
    except OSError:
        return out
    for fd in fds:
        try:
            if "memfd:kvstore-dram" in str(fd.readlink()):  # not staging areas
                out.add(fd.stat().st_ino)
        except OSError:
            continue
    return out


class Sampler(threading.Thread):
    """Every ``sample_s``: each process's memory (``STATUS_FIELDS``), the shared-memory
    regions each node maps, and each node's eviction counter and DRAM use."""

    def __init__(self, soak: Soak, stop: threading.Event) -> None:
        super().__init__(name="soak-sampler", daemon=True)
        self.soak = soak
        self.halt = stop
        self.ticks: list[float] = []
        names = (*NODES, "etcd")
        # Per field and process: samples (t, pid, MiB), and one value or None per tick.
        self.samples: dict[str, dict[str, list[Sample]]] = {
            f: {n: [] for n in names} for f in STATUS_FIELDS}
        self.series: dict[str, dict[str, list[float | None]]] = {
            f: {n: [] for n in names} for f in STATUS_FIELDS}
        self.used: dict[str, list[float | None]] = {n: [] for n in NODES}
        self.regions: dict[str, list[int | None]] = {n: [] for n in NODES}  # mapped, each
        self.stale: list[int] = []  # regions of dead nodes that live nodes map, per tick
        self.evictions: dict[tuple[str, int], int] = {}  # (node, pid) -> last counter seen

    def run(self) -> None:
        with self.soak.client("cluster", timeout=5.0) as stats_client:
            while True:
                self.tick(stats_client)
                if self.halt.wait(self.soak.cfg.sample_s):
                    return

    def tick(self, stats_client: Any) -> None:
        t = round(self.soak.clock(), 2)
        with self.soak.lock:
            pids = dict(self.soak.pids)
        self.ticks.append(t)
        for name in (*NODES, "etcd"):
            pid = pids.get(name)
            mem = memory_mib(pid) if pid else None
            for f in STATUS_FIELDS:
                self.series[f][name].append(None if mem is None else mem[f])
                if pid and mem is not None:
                    self.samples[f][name].append((t, pid, mem[f]))
        # A live node maps its own region at least; none read: it just died.
        mapped = {pid: r for nid in NODES if (pid := pids.get(nid)) and (r := shm_regions(pid))}
        for nid in NODES:
            pid = pids.get(nid)
            self.regions[nid].append(len(mapped[pid]) if pid in mapped else None)
        self.stale.append(stale_regions(mapped))
        try:
            stats = stats_client.stats()
        except KVStoreError:
            stats = {}
        for nid in NODES:
            st = stats.get(nid, {})
            tiers = st.get("tiers", {}) if isinstance(st, dict) else {}
            pid = pids.get(nid)
            if tiers and pid:
                self.evictions[(nid, pid)] = sum(int(x.get("evictions", 0))
                                                 for x in tiers.values())
            used = sum(int(x.get("used", 0)) for x in tiers.values()) if tiers else None
            self.used[nid].append(None if used is None else round(used / MIB, 2))
