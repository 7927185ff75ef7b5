"""``kvstore bench clients``: many client processes reading values over TCP, against Redis.

What a new user tries first: N separate processes, each with its own ``Client(addr,
transport="tcp")`` (and its own ``redis.Redis``), each calling ``get(key)`` in a loop on
values of one size. The benchmark starts one ``kvstore serve`` node and one
``redis-server`` on loopback, stores the same values in both, starts the largest
number of client processes once, and then runs cells (system, size, clients) in a fresh
random order each round: the first ``clients`` workers read for ``cell_seconds`` from a
common start time, and the cell's figure is the aggregate GB/s over all of them.

Two ratios per size and client count, each the median of its per-round ratios (both
sides of a ratio are measured in the same round, so machine load moves them alike):

* ``x redis``: kvstore's aggregate over Redis's with the same number of clients;
* ``x 1 client``: kvstore's aggregate with N clients over its aggregate with one.

``--baseline-tree DIR`` adds a third system, ``kvstore-base``: a node *and* clients run
from another checkout (an older commit, with this file copied into its ``benchmarks/``),
measured in the same rounds; ``x base`` is kvstore's aggregate over it. A bisection
uses it: machine load cannot favour one commit over the other.
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

from benchmarks import peers
from benchmarks.stats import write_json

SIZES = (64 << 10, 1 << 20)
CLIENTS = (1, 16)
KEYS = 16  # distinct values per size: reads are not all of one cache-hot buffer


@dataclass(frozen=True, slots=True)
class Settings:
    rounds: int
    cell_seconds: float


FULL = Settings(rounds=5, cell_seconds=1.5)
QUICK = Settings(rounds=3, cell_seconds=0.8)


# ---- the client processes ------------------------------------------------------------------


def worker_main(index: int, addr: str, system: str) -> int:
    """A client process (``python clients_bench.py worker I ADDR SYSTEM``): one client of
    ``system`` (``kvstore`` over TCP, or ``redis``). Reads jobs from stdin, one a line:
    ``SIZE START SECONDS KEYHEX,...``; answers ``ok OPS ELAPSED`` or ``error TEXT``."""
    if system == "redis":
        import redis

        host, port = addr.rsplit(":", 1)
        client: Any = redis.Redis(host=host, port=int(port), socket_timeout=60)
    else:
        from kvstore.client import Client

        client = Client(addr, transport="tcp")
    get = client.get
    out = sys.stdout
    try:
        for line in sys.stdin:
            size_s, start_s, seconds_s, keys_s = line.split()
            size, start = int(size_s), float(start_s)
            ks = [bytes.fromhex(k) for k in keys_s.split(",")]
            n, i, ops = len(ks), index, 0
            while time.time() < start:
                time.sleep(min(0.01, max(0.0, start - time.time())))
            end = start + float(seconds_s)
            while True:
                v = get(ks[i % n])
                if v is None or len(v) != size:
                    out.write(f"error {system} get returned "
                              f"{None if v is None else len(v)} bytes\n")
                    break
                i += 1
                ops += 1
                if time.time() >= end:
                    out.write(f"ok {ops} {time.time() - start}\n")
                    break
            out.flush()
    finally:
        client.close()
    return 0


class Pool:
    """``n`` client processes of one system, each started once with ``pythonpath`` first."""

    def __init__(self, n: int, addr: str, system: str, pythonpath: Path,
                 server_pid: int) -> None:
        self.server_pid = server_pid
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(pythonpath), env.get("PYTHONPATH")) if p)
        self.procs: list[subprocess.Popen[str]] = []
        for i in range(n):
            self.procs.append(subprocess.Popen(
                [sys.executable, str(Path(__file__).resolve()), "worker", str(i), addr, system],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env,
                cwd=str(pythonpath)))

    def run(self, size: int, keys: list[bytes], clients: int, seconds: float) -> Sample:
        """Aggregate bytes/s of the first ``clients`` workers reading for ``seconds``, and
        the CPU seconds the server and those clients used meanwhile."""
        start = time.time() + 0.05 + 0.005 * clients
        pids = [p.pid for p in self.procs[:clients]]
        server0, clients0 = cpu_seconds([self.server_pid]), cpu_seconds(pids)
        job = f"{size} {start} {seconds} {','.join(k.hex() for k in keys)}\n"
        for p in self.procs[:clients]:
            _pipe(p.stdin).write(job)
            _pipe(p.stdin).flush()
        total = 0.0
        moved = 0
        for p in self.procs[:clients]:
            got = _pipe(p.stdout).readline().split(maxsplit=2)
            if not got or got[0] != "ok":
                raise RuntimeError(f"client process {p.pid}: {' '.join(got) or 'exited'}")
            total += int(got[1]) * size / float(got[2])
            moved += int(got[1]) * size
        return Sample(total, moved, cpu_seconds([self.server_pid]) - server0,
                      cpu_seconds(pids) - clients0)

    def close(self) -> None:
        for p in self.procs:
            if p.stdin is not None:
                p.stdin.close()
        for p in self.procs:
            try:
                p.wait(10)
            except subprocess.TimeoutExpired:
                p.kill()  # this benchmark's own child, by its handle
                p.wait(5)


@dataclass(frozen=True, slots=True)
class Sample:
    """One cell in one round."""

    rate: float  # aggregate bytes/s
    moved: int  # bytes read in all
    server_cpu: float  # CPU seconds of the server process meanwhile
    client_cpu: float  # and of the client processes

    def server_cpu_per_mib(self) -> float:
        return self.server_cpu / (self.moved / (1 << 20))


_TICK = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pids: Sequence[int]) -> float:
    """User + system CPU seconds of ``pids`` (all their threads), from /proc."""
    total = 0
    for pid in pids:
        try:
            fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / _TICK


def _pipe(f: IO[str] | None) -> IO[str]:
    assert f is not None  # the pools open both pipes
    return f


# ---- the run -------------------------------------------------------------------------------


def start_node(tree: Path | None) -> peers.PeerProcess:
    """A node from this checkout, or from ``tree`` (its own packages first on the path)."""
    if tree is None:
        return peers.start_kvstore()

    def argv(p: int) -> list[str]:
        return ["env", f"PYTHONPATH={tree}", sys.executable, "-m", "kvstore", "serve",
                "--listen", f"{peers.LOOPBACK}:{p}", "--dram-bytes", "1GiB"]

    return peers.start_peer("kvstore-base", argv, peers.tcp_connectable, timeout=60.0)


def _preload(addr: str, tree: Path, keys: dict[int, list[bytes]],
             values: dict[int, list[bytes]]) -> None:
    """Stores the values with ``tree``'s own client (a separate process)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    script = ("import sys, pickle\nfrom kvstore.client import Client\n"
              "addr, data = pickle.load(sys.stdin.buffer)\n"
              "with Client(addr, transport='tcp') as c:\n"
              "    for ks, vs in data: c.put_batch(ks, vs)\n")
    import pickle

    data = [(keys[s], values[s]) for s in keys]
    subprocess.run([sys.executable, "-c", script], input=pickle.dumps((addr, data)),
                   env=env, check=True, cwd=str(tree))


def run_clients_bench(*, quick: bool = False, sizes: Sequence[int] = SIZES,
                      clients: Sequence[int] = CLIENTS, use_redis: bool = True,
                      rounds: int | None = None, baseline_tree: Path | None = None
                      ) -> dict[str, Any]:
    s = QUICK if quick else FULL
    n_rounds = rounds or s.rounds
    rng = random.Random(0x27)
    keys = {size: [os.urandom(16) for _ in range(KEYS)] for size in sizes}
    values = {size: [os.urandom(size) for _ in range(KEYS)] for size in sizes}
    samples: dict[tuple[str, int, int], list[Sample]] = {}
    pools: dict[str, Pool] = {}
    with ExitStack() as stack:
        trees: dict[str, tuple[Path | None, Path]] = {"kvstore": (None, peers.REPO)}
        if baseline_tree is not None:
            trees["kvstore-base"] = (baseline_tree, baseline_tree)
        for name, (node_tree, client_tree) in trees.items():
            node = stack.enter_context(start_node(node_tree))
            _preload(node.addr, client_tree, keys, values)
            pools[name] = Pool(max(clients), node.addr, "kvstore", client_tree, node.pid)
            stack.callback(pools[name].close)
        if use_redis:
            import redis

            rp = stack.enter_context(peers.start_redis())
            with redis.Redis(host=rp.host, port=rp.port, socket_timeout=60) as r:
                pipe = r.pipeline(transaction=False)
                for size in sizes:
                    for k, v in zip(keys[size], values[size], strict=True):
                        pipe.set(k, v)
                pipe.execute()
            pools["redis"] = Pool(max(clients), rp.addr, "redis", peers.REPO, rp.pid)
            stack.callback(pools["redis"].close)
        cells = [(sy, size, n) for sy in pools for size in sizes for n in clients]
        for sy, size, n in cells:  # warm-up: connections made, first faults taken
            pools[sy].run(size, keys[size], n, 0.1)
        for _ in range(n_rounds):
            rng.shuffle(cells)
            for sy, size, n in cells:
                samples.setdefault((sy, size, n), []).append(
                    pools[sy].run(size, keys[size], n, s.cell_seconds))
    return build_results(samples, sizes, clients, n_rounds, s)


def _median_ratio(num: list[float], den: list[float] | None) -> float | None:
    if den is None:
        return None
    return statistics.median(a / b for a, b in zip(num, den, strict=True))


def build_results(cells: dict[tuple[str, int, int], list[Sample]], sizes: Sequence[int],
                  clients: Sequence[int], rounds: int, s: Settings) -> dict[str, Any]:
    samples = {c: [x.rate for x in xs] for c, xs in cells.items()}

    def cpu(system: str, size: int, n: int) -> float | None:
        xs = cells.get((system, size, n))
        return None if xs is None else statistics.median(x.server_cpu_per_mib() for x in xs)

    def client_cpu(size: int, n: int) -> float:
        xs = cells[("kvstore", size, n)]
        return statistics.median(1e3 * x.client_cpu / (x.moved / (1 << 20)) for x in xs)

    rows = []
    one = min(clients)
    for size in sizes:
        for n in clients:
            kv = samples[("kvstore", size, n)]
            rd = samples.get(("redis", size, n))
            base = samples.get(("kvstore-base", size, n))
            rows.append({
                "server_cpu_ms_per_mib": 1e3 * (cpu("kvstore", size, n) or 0.0),
                "clients_cpu_ms_per_mib": client_cpu(size, n),
                "redis_cpu_ms_per_mib": None if rd is None else 1e3 * (
                    cpu("redis", size, n) or 0.0),
                "base_cpu_ms_per_mib": None if base is None else 1e3 * (
                    cpu("kvstore-base", size, n) or 0.0),
                "size": size, "clients": n,
                "kvstore_gbs": statistics.median(kv) / 1e9,
                "redis_gbs": None if rd is None else statistics.median(rd) / 1e9,
                "x_redis": _median_ratio(kv, rd),
                "x_1_client": _median_ratio(kv, samples[("kvstore", size, one)]),
                "redis_x_1_client": None if rd is None else _median_ratio(
                    rd, samples[("redis", size, one)]),
                "x_base": _median_ratio(kv, base),
                "base_x_redis": None if base is None else _median_ratio(base, rd),
                "base_x_1_client": None if base is None else _median_ratio(
                    base, samples[("kvstore-base", size, one)]),
            })
    return {"rounds": rounds, "cell_seconds": s.cell_seconds,
            "loadavg": os.getloadavg(), "rows": rows}


def format_results(res: dict[str, Any]) -> str:
    cols = [("kvstore_gbs", "kvstore GB/s"), ("redis_gbs", "redis GB/s"),
            ("x_redis", "x redis"), ("x_1_client", "x 1 client"),
            ("redis_x_1_client", "redis x 1"), ("x_base", "x base"),
            ("base_x_redis", "base x redis"), ("base_x_1_client", "base x 1"),
            ("server_cpu_ms_per_mib", "node ms/MiB"), ("clients_cpu_ms_per_mib", "clients ms/MiB"),
            ("redis_cpu_ms_per_mib", "redis ms/MiB"),
            ("base_cpu_ms_per_mib", "base ms/MiB")]
    shown = [c for c in cols if any(r[c[0]] is not None for r in res["rows"])]
    lines = ["size     clients  " + "  ".join(f"{h:>12}" for _, h in shown)]
    for r in res["rows"]:
        size = f"{r['size'] >> 20} MiB" if r["size"] >= 1 << 20 else f"{r['size'] >> 10} KiB"
        cells = ["-" if r[k] is None else f"{r[k]:.3f}" if k.endswith("gbs") else f"{r[k]:.2f}"
                 for k, _ in shown]
        lines.append(f"{size:<8} {r['clients']:>7}  " + "  ".join(f"{c:>12}" for c in cells))
    lines.append(f"rounds {res['rounds']} x {res['cell_seconds']} s per cell; "
                 f"load average {res['loadavg'][0]:.1f}")
    return "\n".join(lines)


_UNITS = {"": 1, "B": 1, "KIB": 1 << 10, "MIB": 1 << 20, "GIB": 1 << 30}


def _parse_sizes(text: str) -> tuple[int, ...]:
    """``64KiB,1MiB`` (kept here: an older tree this file is copied into may lack the
    project's parser)."""
    out = []
    for t in (t.strip() for t in text.split(",")):
        if t:
            digits = t.rstrip("BbIiKkMmGg")
            out.append(int(digits) * _UNITS[t[len(digits):].upper()])
    return tuple(out)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["worker"]:
        return worker_main(int(argv[1]), argv[2], argv[3])
    p = argparse.ArgumentParser(prog="kvstore bench clients",
                                description="client processes reading over TCP vs Redis")
    p.add_argument("--quick", action="store_true", help="3 rounds of 0.8 s cells")
    p.add_argument("--rounds", type=int, default=None, help="rounds (default 5, quick 3)")
    p.add_argument("--sizes", default="64KiB,1MiB", help="value sizes, comma-separated")
    p.add_argument("--clients", default="1,16", help="client-process counts, comma-separated")
    p.add_argument("--no-redis", action="store_true", help="kvstore only")
    p.add_argument("--baseline-tree", type=Path, default=None,
                   help="another checkout whose node and client run beside this one's")
    p.add_argument("--out-dir", default="benchmarks/results", help="where the JSON goes")
    args = p.parse_args(argv)
    try:
        sizes = _parse_sizes(args.sizes)
        clients = tuple(int(c) for c in args.clients.split(",") if c)
    except (ValueError, KeyError) as exc:
        p.error(str(exc))
    if not sizes or not clients or min(clients) < 1:
        p.error("need at least one size and client counts >= 1")
    base = None if args.baseline_tree is None else args.baseline_tree.resolve()
    res = run_clients_bench(quick=args.quick, sizes=sizes, clients=clients,
                            use_redis=not args.no_redis, rounds=args.rounds,
                            baseline_tree=base)
    print(format_results(res))
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "clients.json", res)
    return 0


if __name__ == "__main__":
    sys.exit(main())
