"""``python -m benchmarks.kv_events_bench``: what KV events cost a node's puts.

One in-process node (DRAM tier), ``--blocks`` small blocks (4 KiB: the per-block
metadata path dominates, the worst case for a per-event cost) put then removed, in
rounds that alternate events off / on (a publisher with one subscriber draining its
PUB socket in this process). Reports per round kind the median puts/s and removes/s,
their ratio on/off (the peer: the same node without events, in the same run), the
same for puts in batches of 64 over the TCP channel to a ``kvstore serve`` process, how
long the subscriber took to receive every event after the last put, and the time and
size of a snapshot of all blocks from the replay endpoint.

Writes ``benchmarks/results/kv_events_bench.json`` and ``kv_events_bench.png``.
"""

from __future__ import annotations

import argparse
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import (
    Panel,
    format_table,
    median,
    paired_median_ratio,
    plot_panels,
    write_json,
)
from kvstore import Client
from kvstore.core.keys import BlockKey
from kvstore.core.ports import free_port
from kvstore.node.kv_events import KVEventPublisher, KVEventSettings
from kvstore.node.semantics import Node, NodeSettings
from kvstore.remote.kv_event_subscriber import KVEventSubscriber, decode

RESULTS = Path(__file__).resolve().parent / "results"
VALUE = memoryview(b"v" * 4096)


class _Counter:
    """Drains a SUB socket on a thread, counting events (``decode``) or messages."""

    def __init__(self, sub: KVEventSubscriber, *, decode: bool = True) -> None:
        self.sub = sub
        self.decode = decode
        self.events = 0
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            got = self.sub.recv(0.05)
            if got is not None:
                self.events += len(decode(got[1])) if self.decode else 1

    def wait_for(self, n: int, timeout: float = 60.0) -> float:
        t0 = time.perf_counter()
        while self.events < n:
            if time.perf_counter() - t0 > timeout:
                raise TimeoutError(f"{self.events} of {n} events arrived")
            time.sleep(0.001)
        return time.perf_counter() - t0


def one_round(blocks: int, events: bool) -> dict[str, Any]:
    node = Node(NodeSettings(dram_bytes=max(64 << 20, blocks * 4096 * 2), prefault=False))
    pub = counter = None
    base = 0
    keys = [BlockKey(i.to_bytes(16, "big")) for i in range(1, blocks + 1)]
    try:
        if events:
            pub = KVEventPublisher(node, KVEventSettings(endpoint="tcp://127.0.0.1:0",
                                                         replay_endpoint="tcp://127.0.0.1:0"))
            counter = _Counter(KVEventSubscriber(pub.endpoint, pub.replay_endpoint))
            assert pub.ready.wait(10.0)
            probe = BlockKey(b"\xff" * 16)
            while counter.events == 0:  # until the subscription reached the publisher
                node.put(probe, VALUE)
                node.remove(probe)
                time.sleep(0.01)
            time.sleep(0.2)  # the probes' last events arrive
            base = counter.events
        t0 = time.perf_counter()
        for i, k in enumerate(keys):
            node.put(k, VALUE, parent=keys[i - 1] if i else None)
        put_s = time.perf_counter() - t0
        out: dict[str, Any] = {"puts_per_s": blocks / put_s}
        if counter is not None and pub is not None:
            out["drain_after_puts_s"] = counter.wait_for(base + blocks)
            t0 = time.perf_counter()
            _seq, payload = _snapshot(pub)
            out["snapshot_s"] = time.perf_counter() - t0
            out["snapshot_bytes"] = len(payload)
        t0 = time.perf_counter()
        for k in keys:
            node.remove(k)
        out["removes_per_s"] = blocks / (time.perf_counter() - t0)
        if counter is not None and events:
            counter.wait_for(base + 2 * blocks)
        return out
    finally:
        if counter is not None:
            counter.stop.set()
            counter.thread.join()
            counter.sub.close()
        if pub is not None:
            pub.close()
        node.close()


def process_round(blocks: int, events: bool, batch: int = 64) -> dict[str, Any]:
    """``blocks`` puts in batches over the TCP channel to a ``kvstore serve`` process."""
    port = free_port()
    flags = ["--kv-events-endpoint", "tcp://127.0.0.1:0"] if events else []
    proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--listen",
                             f"127.0.0.1:{port}", "--dram-bytes",
                             str(max(64 << 20, blocks * 4096 * 2)), "--no-prefault", *flags],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    counter = None
    try:
        head = ""
        assert proc.stdout is not None
        for line in proc.stdout:
            head += line
            if "kvstore: serving on" in line:
                break
        else:
            raise RuntimeError(f"the node did not start:\n{head}")
        threading.Thread(target=proc.stdout.read, daemon=True).start()  # keep the pipe open
        keys = [i.to_bytes(16, "big") for i in range(1, blocks + 1)]
        values = [VALUE] * batch
        with Client(f"127.0.0.1:{port}", transport="tcp") as c:
            if events:
                m = re.search(r"KV events on (\S+)", head)
                assert m is not None
                # Received, not decoded: this process's GIL is the client's.
                counter = _Counter(KVEventSubscriber(m[1]), decode=False)
                probe = b"\xff" * 16
                while counter.events == 0:
                    c.put(probe, b"p")
                    c.remove(probe)
                    time.sleep(0.01)
                time.sleep(0.2)
            t0 = time.perf_counter()
            for i in range(0, blocks, batch):
                c.put_batch(keys[i:i + batch], values[:len(keys[i:i + batch])])
            out: dict[str, Any] = {"puts_per_s": blocks / (time.perf_counter() - t0)}
        return out
    finally:
        if counter is not None:
            counter.stop.set()
            counter.thread.join()
            counter.sub.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(30)


def _snapshot(pub: KVEventPublisher) -> tuple[int, bytes]:
    """A snapshot through its own subscriber (the counter's sockets stay on its thread)."""
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        return sub.snapshot(timeout=60.0)
    finally:
        sub.close()


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="kv_events_bench", description=__doc__.split("\n")[0])
    ap.add_argument("--blocks", type=int, default=50_000)
    ap.add_argument("--rounds", type=int, default=3, help="rounds of each kind (alternating)")
    ap.add_argument("--quick", action="store_true", help="10,000 blocks, 2 rounds")
    args = ap.parse_args(argv)
    blocks, rounds = (10_000, 2) if args.quick else (args.blocks, args.rounds)
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    tcp: dict[str, list[dict[str, Any]]] = {"off": [], "on": []}
    for _ in range(rounds):
        for kind in ("off", "on"):
            runs[kind].append(one_round(blocks, kind == "on"))
            tcp[kind].append(process_round(blocks, kind == "on"))

    def paired(field: str, rs: dict[str, list[dict[str, Any]]]) -> float | None:
        return paired_median_ratio([r[field] for r in rs["on"]], [r[field] for r in rs["off"]])

    def med(kind: str, field: str) -> float:
        return median([r[field] for r in runs[kind]])

    summary: dict[str, Any] = {
        "blocks": blocks, "block_bytes": len(VALUE), "rounds": rounds,
        "puts_per_s": {k: med(k, "puts_per_s") for k in runs},
        "removes_per_s": {k: med(k, "removes_per_s") for k in runs},
        # Paired by round (on against the off run just before it): load from other
        # processes on the machine moves both alike.
        "put_ratio_on_off": paired("puts_per_s", runs),
        "remove_ratio_on_off": paired("removes_per_s", runs),
        "drain_after_puts_s": med("on", "drain_after_puts_s"),
        "snapshot_s": med("on", "snapshot_s"),
        "snapshot_bytes_per_block": med("on", "snapshot_bytes") / blocks,
        "tcp_puts_per_s": {k: median([r["puts_per_s"] for r in tcp[k]]) for k in tcp},
        "runs": runs, "tcp_runs": tcp,
    }
    summary["tcp_put_ratio_on_off"] = paired("puts_per_s", tcp)
    rows = [[kind, summary["puts_per_s"][kind], summary["removes_per_s"][kind],
             summary["tcp_puts_per_s"][kind]] for kind in ("off", "on")]
    rows.append(["ratio on/off (paired)", summary["put_ratio_on_off"],
                 summary["remove_ratio_on_off"], summary["tcp_put_ratio_on_off"]])
    print(f"KV events: {blocks} blocks of 4 KiB, median of {rounds} rounds")
    print(format_table(["events", "in-process puts/s", "in-process removes/s",
                        "TCP channel puts/s (batches of 64)"], rows))
    print(f"events drained {summary['drain_after_puts_s'] * 1e3:.1f} ms after the last put; "
          f"snapshot of {blocks} blocks: {summary['snapshot_s'] * 1e3:.1f} ms, "
          f"{summary['snapshot_bytes_per_block']:.0f} bytes/block")
    write_json(RESULTS / "kv_events_bench.json", summary)
    plot_panels(RESULTS / "kv_events_bench.png", [Panel(
        title=f"{blocks} puts and removes of 4 KiB blocks",
        x=["in-process puts/s", "in-process removes/s", "TCP puts/s"],
        series={k: [summary["puts_per_s"][k], summary["removes_per_s"][k],
                    summary["tcp_puts_per_s"][k]] for k in runs},
        kind="bars", ylabel="operations/s")], title="KV events: cost on the node")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
