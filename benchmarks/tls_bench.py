"""``python -m benchmarks.tls_bench``: what TLS costs on the transfer channel.

Two nodes on loopback, one plaintext and one serving TLS (a throwaway CA and node
certificate made with ``openssl``), same-host shared memory off so both use the TCP
channel. One client per node puts ``--bytes`` of blocks of each size, then gets them
back into a preallocated buffer (median of 3 passes). The ratio TLS / plaintext is the
price of encryption in this Python data path (``ssl`` has no ``sendmsg``; every
record is encrypted by OpenSSL in the calling thread).

Writes ``benchmarks/results/tls_bench.json``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from benchmarks.stats import format_table, size_label, write_json
from conductor.live.local import free_port
from kvstore.auth.security import ClientTls
from kvstore.client import Client

RESULTS = Path(__file__).resolve().parent / "results"


def make_pki(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a node certificate for 127.0.0.1; returns (ca, cert, key)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=d, check=True, capture_output=True)

    ec = ["-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes"]
    run("req", "-x509", *ec, "-keyout", "ca.key", "-out", "ca.pem", "-days", "1",
        "-subj", "/CN=bench-ca")
    run("req", *ec, "-keyout", "node.key", "-out", "node.csr", "-subj", "/CN=node")
    (d / "ext").write_text("subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth\n")
    run("x509", "-req", "-in", "node.csr", "-CA", "ca.pem", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "node.pem", "-days", "1", "-extfile", "ext")
    return d / "ca.pem", d / "node.pem", d / "node.key"


def start_node(d: Path, extra: Sequence[str]) -> tuple[subprocess.Popen, str]:
    addr = f"127.0.0.1:{free_port()}"
    log = d / f"node-{addr.rsplit(':', 1)[1]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, "-m", "kvstore", "serve", "--listen", addr,
                                 "--dram-bytes", "1GiB", "--no-shm", *extra], stdout=out,
                                stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 60
    while b"serving on" not in log.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"node did not start:\n{log.read_text()[-2000:]}")
        time.sleep(0.05)
    return proc, addr


def measure(addr: str, tls: ClientTls | None, size: int, total: int, tag: int
            ) -> tuple[float, float]:
    n = max(16, total // size)
    value, buf = os.urandom(size), bytearray(size)
    keys = [(tag << 32 | i).to_bytes(16, "big") for i in range(n)]
    with Client(addr, transport="tcp", tls=tls) as c:
        t0 = time.perf_counter()
        for k in keys:
            c.put(k, value)
        put = n * size / (time.perf_counter() - t0) / 1e9
        gets = []
        for _ in range(3):
            t0 = time.perf_counter()
            for k in keys:
                c.get_into(k, buf)
            gets.append(n * size / (time.perf_counter() - t0) / 1e9)
    return put, statistics.median(gets)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.tls_bench",
                                description=__doc__.split("\n")[0] if __doc__ else None)
    p.add_argument("--bytes", type=int, default=256 << 20, help="bytes per size and node")
    p.add_argument("--out-dir", default=str(RESULTS))
    args = p.parse_args(argv)
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="kvstore-tls-bench-") as tmp:
        d = Path(tmp)
        ca, cert, key = make_pki(d)
        plain, plain_addr = start_node(d, [])
        secure, tls_addr = start_node(d, ["--tls-cert", str(cert), "--tls-key", str(key)])
        try:
            for i, size in enumerate((64 << 10, 1 << 20, 4 << 20)):
                pp, pg = measure(plain_addr, None, size, args.bytes, 2 * i)
                tp, tg = measure(tls_addr, ClientTls(ca=str(ca)), size, args.bytes, 2 * i + 1)
                rows.append({"size": size, "plain_put_gbps": pp, "plain_get_gbps": pg,
                             "tls_put_gbps": tp, "tls_get_gbps": tg,
                             "put_ratio": tp / pp, "get_ratio": tg / pg})
        finally:
            for proc in (plain, secure):
                proc.terminate()
                proc.wait(30)
    print(format_table(
        ["block", "plain put", "plain get", "TLS put", "TLS get", "put ratio", "get ratio"],
        [[size_label(r["size"]), r["plain_put_gbps"], r["plain_get_gbps"], r["tls_put_gbps"],
          r["tls_get_gbps"], r["put_ratio"], r["get_ratio"]] for r in rows]))
    if args.out_dir:
        path = write_json(Path(args.out_dir) / "tls_bench.json",
                          {"command": "python -m benchmarks.tls_bench", "rows": rows})
        print(f"\nwrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
