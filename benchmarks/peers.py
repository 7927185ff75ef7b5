"""The processes a benchmark talks to, all on loopback and all owned by it.

* ``start_redis``: a redis-server with persistence off, bound to 127.0.0.1.
* ``start_raw_tcp_peer``: a plain-Python TCP peer in its own process, the
  loopback limit: it sends or receives N bytes per request with ``sendmsg`` /
  ``recv_into`` on preallocated buffers, which is what any Python store's data
  path could at best do. ``RawTcpClient`` is its client, also on preallocated
  buffers.
* ``start_kvstore``: a ``kvstore serve`` node.

Every peer is a ``PeerProcess``: stopped by its own PID (SIGTERM, then SIGKILL
after a grace period) from ``stop()``/``__exit__``, so a ``with`` block or a
``finally`` never leaves one behind. Ports come from the kernel (bind to port 0);
a peer that dies before it is ready (the port was taken meanwhile) is started
again on a new port.

``python -m benchmarks.peers raw-tcp-server --port P`` runs the raw peer.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from kvstore.core.ports import free_port  # re-exported: benchmarks import it from here

REPO = Path(__file__).resolve().parent.parent
LOOPBACK = "127.0.0.1"

# ---- process plumbing ----------------------------------------------------------------------


def tcp_connectable(host: str, port: int, timeout: float = 0.5) -> bool:
    try:
        with socket.create_connection((host, port), timeout=timeout):
            return True
    except OSError:
        return False


class PeerProcess:
    """A subprocess this benchmark started; ``stop()`` ends it by its PID."""

    def __init__(self, name: str, proc: subprocess.Popen[bytes], host: str, port: int,
                 workdir: Path) -> None:
        self.name = name
        self.proc = proc
        self.host = host
        self.port = port
        self.workdir = workdir

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def addr(self) -> str:
        return f"{self.host}:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.workdir / "peer.log"

    def log_tail(self, nbytes: int = 2000) -> str:
        try:
            return self.log_path.read_bytes()[-nbytes:].decode(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, timeout: float = 15.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns the exit code."""
        try:
            if self.proc.poll() is None:
                self.proc.send_signal(signal.SIGTERM)  # Popen signals its own PID only
                try:
                    self.proc.wait(timeout)
                except subprocess.TimeoutExpired:
                    self.proc.kill()
                    self.proc.wait(5)
            return self.proc.returncode
        finally:
            shutil.rmtree(self.workdir, ignore_errors=True)

    def __enter__(self) -> PeerProcess:
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    def __repr__(self) -> str:
        return f"PeerProcess({self.name}, pid={self.pid}, {self.addr})"


def _child_env() -> dict[str, str]:
    # The peers import this repo's packages whether or not it is pip-installed.
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), env.get("PYTHONPATH")) if p)
    return env


def start_peer(name: str, argv_for_port: Callable[[int], Sequence[str]],
               ready: Callable[[str, int], bool], *, port: int | None = None,
               host: str = LOOPBACK, timeout: float = 30.0, attempts: int = 3) -> PeerProcess:
    """Starts ``argv_for_port(port)`` and polls ``ready(host, port)`` until it holds.

    With ``port=None`` a free port is picked, and the start is retried on a new
    one if the process exits before it is ready (another process took the port).
    """
    last = ""
    for _ in range(attempts if port is None else 1):
        p = port if port is not None else free_port(host)
        workdir = Path(tempfile.mkdtemp(prefix=f"kvstore-bench-{name}-"))
        with open(workdir / "peer.log", "wb") as log:
            proc = subprocess.Popen(list(argv_for_port(p)), stdout=log,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    cwd=workdir, env=_child_env())
        peer = PeerProcess(name, proc, host, p, workdir)
        deadline = time.monotonic() + timeout
        try:
            while time.monotonic() < deadline:
                if not peer.alive():
                    break
                if ready(host, p):
                    return peer
                time.sleep(0.05)
        except BaseException:
            peer.stop()
            raise
        last = (f"{name} exited with {proc.returncode}" if not peer.alive()
                else f"{name} not ready after {timeout}s")
        last += f"; log:\n{peer.log_tail()}"
        peer.stop()
    raise RuntimeError(f"cannot start {name}: {last}")


# ---- redis ---------------------------------------------------------------------------------


def redis_ping(host: str, port: int, timeout: float = 0.5) -> bool:
    """True if a Redis server answers PING (raw RESP: no client library needed)."""
    try:
        with socket.create_connection((host, port), timeout=timeout) as s:
            s.sendall(b"*1\r\n$4\r\nPING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


def find_redis_server() -> str | None:
    return shutil.which("redis-server") or (
        "/usr/bin/redis-server" if os.access("/usr/bin/redis-server", os.X_OK) else None)


def start_redis(port: int | None = None, *, binary: str | None = None,
                extra: Sequence[str] = ()) -> PeerProcess:
    """A redis-server on loopback, persistence off (a benchmark must not measure fsync)."""
    exe = binary or find_redis_server()
    if exe is None:
        raise RuntimeError("redis-server not found (apt-get install redis-server)")

    def argv(p: int) -> list[str]:
        return [exe, "--port", str(p), "--bind", LOOPBACK, "--save", "", "--appendonly", "no",
                "--daemonize", "no", *extra]

    return start_peer("redis", argv, redis_ping, port=port)


# ---- kvstore -------------------------------------------------------------------------------


def kvstore_ready(host: str, port: int) -> bool:
    if not tcp_connectable(host, port):
        return False
    from kvstore.client import Client  # lazily: the other peers do not need kvstore

    try:
        with Client(f"{host}:{port}", transport="grpc", timeout=2.0) as c:
            c.stats()
        return True
    except Exception:
        return False


def start_kvstore(port: int | None = None, *, dram_bytes: str = "2GiB",
                  extra: Sequence[str] = ()) -> PeerProcess:
    """A ``kvstore serve`` node on loopback; ready once its gRPC ``Stats`` answers."""

    def argv(p: int) -> list[str]:
        return [sys.executable, "-m", "kvstore", "serve", "--listen", f"{LOOPBACK}:{p}",
                "--dram-bytes", dram_bytes, *extra]

    return start_peer("kvstore", argv, kvstore_ready, port=port, timeout=60.0)


# ---- raw TCP peer --------------------------------------------------------------------------

# Request: op (1 byte), slot (4), count (4), length (8). The peer keeps values in
# numbered slots of ``length`` bytes, so a benchmark can make it read and write as
# many distinct buffers as the store under test does (the same cache misses; one
# hot buffer would be a limit no store could meet). GET: the peer sends slots
# ``slot .. slot+count-1`` in one ``sendmsg`` (count > 1: a batch as one request,
# as a store answers a batch get). PUT: ``length`` bytes follow, into ``slot``;
# the peer answers one ACK byte once it has them all, so a put's latency covers
# delivery, as a store's acknowledged put does.
HEADER = struct.Struct("!BIIQ")
OP_GET = 1
OP_PUT = 2
ACK = b"\x01"
MAX_ARENA = 2 << 30  # a bad request must not make the peer allocate without bound
_IOV_MAX = 1024


def recv_exact_into(sock: socket.socket, view: memoryview, n: int) -> None:
    """Fills ``view[:n]`` from ``sock`` (MSG_WAITALL: one syscall when the kernel can).

    MSG_WAITALL only waits on a blocking socket: sockets here have no timeout.
    """
    got = 0
    while got < n:
        r = sock.recv_into(view[got:n], n - got, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        got += r


def recv_exact_into_many(sock: socket.socket, views: Sequence[memoryview]) -> None:
    """Fills every view in order with scattered reads (``recvmsg_into``), no copies."""
    pending = [v for v in views if len(v)]
    while pending:
        r, _, _, _ = sock.recvmsg_into(pending[:_IOV_MAX], 0, socket.MSG_WAITALL)
        if r == 0:
            raise ConnectionError("peer closed the connection")
        _advance(pending, r)


def _advance(pending: list[memoryview], n: int) -> None:
    """Drops the first ``n`` bytes from a list of views (after a partial send/receive)."""
    while n and pending:
        head = pending[0]
        if n >= len(head):
            n -= len(head)
            pending.pop(0)
        else:
            pending[0] = head[n:]
            n = 0


def send_all(sock: socket.socket, parts: Sequence[memoryview | bytes]) -> None:
    """Sends ``parts`` in order with as few ``sendmsg`` calls as the kernel allows (no join)."""
    pending = [memoryview(p).cast("B") for p in parts if len(p)]
    while pending:
        _advance(pending, sock.sendmsg(pending[:_IOV_MAX]))


def _connect(host: str, port: int, timeout: float | None) -> socket.socket:
    sock = socket.create_connection((host, port), timeout=timeout)
    # Small requests and acks must not wait for Nagle's timer, as in kvstore's channel.
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    # Blocking from here on: with a timeout, CPython makes the socket non-blocking
    # and polls before each call, and MSG_WAITALL stops waiting: many more syscalls.
    sock.settimeout(None)
    return sock


class RawTcpClient:
    """Client of the raw peer: sends from and receives into caller-owned buffers."""

    def __init__(self, host: str, port: int, timeout: float | None = 30.0) -> None:
        self.sock = _connect(host, port, timeout)
        self._ack = memoryview(bytearray(1))

    def get_into(self, view: memoryview, n: int, slot: int = 0) -> int:
        """Slot ``slot`` of ``n`` bytes into ``view``."""
        self.sock.sendall(HEADER.pack(OP_GET, slot, 1, n))
        recv_exact_into(self.sock, view, n)
        return n

    def get_many_into(self, views: Sequence[memoryview], n: int, first_slot: int = 0) -> None:
        """``len(views)`` slots of ``n`` bytes: one request, one scattered reply."""
        self.sock.sendall(HEADER.pack(OP_GET, first_slot, len(views), n))
        recv_exact_into_many(self.sock, [v[:n] for v in views])

    def put(self, view: memoryview, slot: int = 0) -> None:
        """``view`` into slot ``slot`` (of ``len(view)`` bytes); returns once acknowledged."""
        send_all(self.sock, [HEADER.pack(OP_PUT, slot, 1, len(view)), view])
        recv_exact_into(self.sock, self._ack, 1)

    def close(self) -> None:
        self.sock.close()

    def __enter__(self) -> RawTcpClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _serve_connection(conn: socket.socket) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.settimeout(None)
    hdr = bytearray(HEADER.size)
    hview = memoryview(hdr)
    arena = memoryview(bytearray())  # the slots, grown on demand, then reused
    try:
        while True:
            try:
                recv_exact_into(conn, hview, HEADER.size)
            except ConnectionError:
                return
            op, slot, count, n = HEADER.unpack(hdr)
            need = (slot + count) * n
            if need > MAX_ARENA or op not in (OP_GET, OP_PUT):
                return
            if need > len(arena):
                # Doubling: a benchmark preloads its slots untimed, and growing by one
                # slot at a time would put a large copy into timed requests. Random,
                # touched pages: zero pages from calloc would all map one physical
                # page and make the sender's reads unrealistically cheap.
                grown = bytearray(os.urandom(min(MAX_ARENA, max(need, 2 * len(arena)))))
                grown[: len(arena)] = arena  # slots already put keep their bytes
                arena = memoryview(grown)
            if op == OP_GET:
                send_all(conn, [arena[(slot + i) * n : (slot + i + 1) * n]
                                for i in range(count)])
            else:
                recv_exact_into(conn, arena[slot * n : (slot + 1) * n], n)
                conn.sendall(ACK)
    except OSError:
        return
    finally:
        conn.close()


def serve_raw_tcp(host: str, port: int) -> None:
    """Serves raw GET/PUT requests, one thread per connection, until killed."""
    srv = socket.create_server((host, port), backlog=64)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_serve_connection, args=(conn,), daemon=True).start()


def start_raw_tcp_peer(port: int | None = None) -> PeerProcess:
    def argv(p: int) -> list[str]:
        return [sys.executable, "-m", "benchmarks.peers", "raw-tcp-server", "--host", LOOPBACK,
                "--port", str(p)]

    return start_peer("raw-tcp", argv, lambda h, p: tcp_connectable(h, p), port=port)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.peers")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("raw-tcp-server", help="serve raw TCP GET/PUT requests")
    s.add_argument("--host", default=LOOPBACK)
    s.add_argument("--port", type=int, required=True)
    args = p.parse_args(argv)
    # SIGTERM (how the benchmark stops it) is a normal end here: exit 0, not -15.
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    with contextlib.suppress(KeyboardInterrupt):
        serve_raw_tcp(args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main())
