"""``python -m benchmarks.mooncake_sessions``: Mooncake 0.3.13's layer-by-layer transfers,
kvstore's class against the real wheel, in one run.

Run it with the Mooncake environment's Python (``scripts/setup-mooncake-env.sh`` prints it;
it has the ``mooncake-transfer-engine-non-cuda==0.3.13.post1`` wheel). It starts the
wheel's ``mooncake_master`` (HTTP metadata server, TCP, 127.0.0.1) with a client that mounts
a 1 GiB segment, and a ``kvstore serve`` node (1 GiB DRAM); both stores run the same
workload in one process, in a fresh random order each round: ``--keys`` objects of
``--layers`` x ``--chunk`` bytes, written and read

* ``session``: ``batch_put_session_start``, one ``batch_put_from_multi_buffer_ranges`` per
  layer, ``batch_put_session_end``; then ``batch_get_session_start``, one
  ``batch_get_into_multi_buffer_ranges`` per layer, ``batch_get_session_end``;
* ``whole``: one ``batch_put_from`` / ``batch_get_into`` of the same objects (the peer line
  for what a session costs over a single transfer); ``whole get again`` reads them a second
  time. A kvstore client maps the node's region from another process, so its first read of
  a block faults the block's pages into its own page tables (one fault per 64 KiB here);
  the second read, like every read once a long-running client has touched the region, does
  not. The wheel's client holds its segment in its own process.

Reports GB/s (median over rounds) and the paired median ratio kvstore / wheel per cell.
Writes ``benchmarks/results/mooncake_sessions.json``, and the plot
``mooncake_sessions.png`` where matplotlib is importable (not in the Mooncake environment:
``.venv/bin/python -m benchmarks.mooncake_sessions --plot`` draws it from the JSON).
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.stats import format_table, median, paired_median_ratio, write_json
from conductor.live.local import free_port

RESULTS = Path(__file__).resolve().parent / "results"
CELLS = ("session put", "session get", "whole put", "whole get", "whole get again")


def _wait(pred: Callable[[], bool], what: str, timeout: float = 60) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def start_master(d: Path) -> tuple[subprocess.Popen, dict[str, str]]:
    import mooncake

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"
    rpc, http, metrics = free_port(), free_port(), free_port()
    with open(d / "master.log", "wb") as out:
        proc = subprocess.Popen(
            [str(Path(mooncake.__file__).parent / "mooncake_master"), f"--rpc_port={rpc}",
             "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
             f"--metrics_port={metrics}"], stdout=out, stderr=subprocess.STDOUT)

    def up() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/metadata?key=x", timeout=1)
        except urllib.error.HTTPError:
            return True
        except OSError:
            return False
        return True

    _wait(up, "mooncake_master")
    return proc, {"local_hostname": "127.0.0.1",
                  "metadata_server": f"http://127.0.0.1:{http}/metadata",
                  "global_segment_size": "1GB", "local_buffer_size": "64MB",
                  "protocol": "tcp", "master_server_addr": f"127.0.0.1:{rpc}"}


def start_node(d: Path) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    log = d / "node.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--listen", addr,
                                 "--dram-bytes", "1GiB"], stdout=out, stderr=subprocess.STDOUT)
    _wait(lambda: b"serving on" in log.read_bytes(), "kvstore node")
    return proc, addr


def one_round(store: Any, tag: str, keys: int, layers: int, chunk: int, src: Any,
              dst: Any) -> dict[str, float]:
    """Seconds per cell for one round on ``store`` (fresh keys under ``tag``)."""
    size = layers * chunk
    sp, dp = ctypes.addressof(src), ctypes.addressof(dst)
    out: dict[str, float] = {}
    ks = [f"{tag}/s{i}" for i in range(keys)]
    t0 = time.perf_counter()
    assert store.batch_put_session_start(ks, [size] * keys) == [0] * keys
    for lay in range(layers):
        ptrs = [[sp + i * size + lay * chunk] for i in range(keys)]
        got = store.batch_put_from_multi_buffer_ranges(ks, ptrs, [[chunk]] * keys,
                                                       [[lay * chunk]] * keys)
        assert got == [chunk] * keys, got
    assert store.batch_put_session_end(ks) == [0] * keys
    out["session put"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    assert store.batch_get_session_start(ks) == [0] * keys
    for lay in range(layers):
        ptrs = [[dp + i * size + lay * chunk] for i in range(keys)]
        got = store.batch_get_into_multi_buffer_ranges(ks, ptrs, [[chunk]] * keys,
                                                       [[lay * chunk]] * keys)
        assert got == [chunk] * keys, got
    assert store.batch_get_session_end(ks) == 0
    out["session get"] = time.perf_counter() - t0
    assert bytes(dst) == bytes(src), "session round trip corrupted bytes"
    ks = [f"{tag}/w{i}" for i in range(keys)]
    ptrs1 = [sp + i * size for i in range(keys)]
    t0 = time.perf_counter()
    assert store.batch_put_from(ks, ptrs1, [size] * keys) == [0] * keys
    out["whole put"] = time.perf_counter() - t0
    ptrs2 = [dp + i * size for i in range(keys)]
    t0 = time.perf_counter()
    assert store.batch_get_into(ks, ptrs2, [size] * keys) == [size] * keys
    out["whole get"] = time.perf_counter() - t0
    ctypes.memset(dst, 0, len(bytes(dst)))
    t0 = time.perf_counter()
    assert store.batch_get_into(ks, ptrs2, [size] * keys) == [size] * keys
    out["whole get again"] = time.perf_counter() - t0
    assert bytes(dst) == bytes(src), "whole round trip corrupted bytes"
    return out


def run(args: argparse.Namespace) -> dict[str, Any]:
    from mooncake.store import MooncakeDistributedStore as Wheel

    from kvstore.integrations.mooncake.store import MooncakeDistributedStore as Ours

    total = args.keys * args.layers * args.chunk
    src = (ctypes.c_ubyte * total).from_buffer(bytearray(os.urandom(total)))
    dst = (ctypes.c_ubyte * total)()
    procs: list[subprocess.Popen] = []
    with tempfile.TemporaryDirectory() as tmp:
        try:
            master, wheel_cfg = start_master(Path(tmp))
            procs.append(master)
            node, addr = start_node(Path(tmp))
            procs.append(node)
            stores = {"wheel": Wheel(), "kvstore": Ours()}
            assert stores["wheel"].setup(wheel_cfg) == 0
            assert stores["kvstore"].setup({**wheel_cfg, "master_server_addr": addr}) == 0
            for s in stores.values():
                assert s.register_buffer(ctypes.addressof(src), total) == 0
                assert s.register_buffer(ctypes.addressof(dst), total) == 0
            secs: dict[str, dict[str, list[float]]] = {n: {c: [] for c in CELLS}
                                                       for n in stores}
            for r in range(args.rounds):
                order = list(stores)
                random.shuffle(order)
                for name in order:
                    ctypes.memset(dst, 0, total)
                    for cell, t in one_round(stores[name], f"r{r}", args.keys, args.layers,
                                             args.chunk, src, dst).items():
                        secs[name][cell].append(t)
            for s in stores.values():
                s.close()
        finally:
            for p in procs:
                p.terminate()
                p.wait(timeout=30)
    gbps = {n: {c: [total / t / 1e9 for t in ts] for c, ts in cells.items()}
            for n, cells in secs.items()}
    return {"keys": args.keys, "layers": args.layers, "chunk": args.chunk,
            "rounds": args.rounds, "bytes_per_round": total, "gbps": gbps,
            "median_gbps": {n: {c: median(v) for c, v in cells.items()}
                            for n, cells in gbps.items()},
            "ratio_kvstore_over_wheel": {c: paired_median_ratio(gbps["kvstore"][c],
                                                                gbps["wheel"][c])
                                         for c in CELLS},
            "load_average": os.getloadavg()[0]}


def plot(result: dict[str, Any], path: Path) -> bool:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, ax = plt.subplots(figsize=(7, 3.5))
    xs = range(len(CELLS))
    for off, name in ((-0.2, "wheel"), (0.2, "kvstore")):
        ax.bar([x + off for x in xs], [result["median_gbps"][name][c] for c in CELLS],
               width=0.4, label=name)
    ax.set_xticks(list(xs), CELLS)
    ax.set_ylabel("GB/s (median)")
    ax.set_title(f"Mooncake 0.3.13 API: {result['keys']} objects x {result['layers']} layers "
                 f"x {result['chunk'] >> 10} KiB")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--keys", type=int, default=8)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--chunk", type=int, default=64 << 10, help="bytes per layer per object")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--plot", action="store_true", help="only draw the PNG from the JSON")
    args = ap.parse_args(argv)
    json_path, png = RESULTS / "mooncake_sessions.json", RESULTS / "mooncake_sessions.png"
    if args.plot:
        print("wrote", png if plot(json.loads(json_path.read_text()), png) else "nothing")
        return 0
    result = run(args)
    rows = [[c, result["median_gbps"]["wheel"][c], result["median_gbps"]["kvstore"][c],
             result["ratio_kvstore_over_wheel"][c]] for c in CELLS]
    print(format_table(["cell", "wheel GB/s", "kvstore GB/s", "kvstore / wheel"], rows))
    print("wrote", write_json(json_path, result))
    if plot(result, png):
        print("wrote", png)
    else:
        print("no matplotlib here: .venv/bin/python -m benchmarks.mooncake_sessions --plot")
    return 0


if __name__ == "__main__":
    sys.exit(main())
