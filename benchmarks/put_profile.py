"""Where a remote put's time goes: CPU per put on each side of the transfer channel.

Starts a node's transfer-channel server (no gRPC) in a child process, sends N puts
of SIZE bytes over TCP from this process, and prints the client's user/system CPU
per put, the server connection thread's CPU per put, and the server's cProfile
(top functions by own time). Used to explain ``kvstore bench api``'s put figures.

    python -m benchmarks.put_profile --size 1MiB --count 1200
"""

from __future__ import annotations

import argparse
import cProfile
import multiprocessing
import os
import pstats
import resource
import socket
import sys
import time
from collections.abc import Sequence
from multiprocessing.connection import Connection

from kvstore.core.sizes import parse_size


def _serve(port: int, region: int, ops: int, ready: Connection) -> None:
    """The child: a node's channel server; sends its HELLO token over ``ready`` once up."""
    from kvstore.auth.tenancy import OPEN
    from kvstore.node import channel_server
    from kvstore.node.semantics import Node, NodeSettings

    class ProfiledServer(channel_server.ChannelServer):
        """Profiles each connection's thread (its HELLO, then every request it serves)."""

        def serve_connection(self, sock: socket.socket) -> None:
            prof = cProfile.Profile()
            start = time.thread_time()
            prof.enable()
            try:
                super().serve_connection(sock)
            finally:
                prof.disable()
                cpu = time.thread_time() - start
                print(f"server connection thread: {cpu / ops * 1e6:.0f} us CPU per put "
                      "(cProfile on: Python parts inflated)", flush=True)
                pstats.Stats(prof).sort_stats("tottime").print_stats(8)
                sys.stdout.flush()

    node = Node(NodeSettings(dram_bytes=region))
    server = ProfiledServer(node, host="127.0.0.1", port=port, unix_name=None)
    server.start()
    # An open node (no auth file): OpenChannel would hand every caller this token.
    ready.send_bytes(server.token_for(OPEN))
    time.sleep(3600)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m benchmarks.put_profile")
    p.add_argument("--size", default="1MiB")
    p.add_argument("--count", type=int, default=1200)
    p.add_argument("--port", type=int, default=0, help="0: pick a free port")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    from benchmarks.peers import free_port
    from kvstore.protocol.wire import Mode
    from kvstore.remote.channel_client import ChannelConnection, ChannelSession

    port = args.port or free_port()
    region = max(64 << 20, 2 * size * args.count // 4)
    ready, child_end = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.Process(target=_serve, args=(port, region, args.count, child_end))
    child.start()
    try:
        if not ready.poll(60):
            raise SystemExit("put_profile: the channel server did not start within 60 s")
        token = ready.recv_bytes()
        time.sleep(5)  # let the VM settle after the region was faulted in
        session = ChannelSession(tcp_host="127.0.0.1", tcp_port=port, unix_path="", token=token,
                                 region_bytes=region)
        conn = ChannelConnection(session, Mode.TCP, timeout=30)
        value = memoryview(os.urandom(size))
        per_round = args.count // 4
        for _ in range(4):
            keys = [os.urandom(16) for _ in range(per_round)]
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            stored = 0
            for k in keys:
                stored += conn.put([k], [value], [None], False)[0]
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if stored != per_round:  # a refused put (no room) would flatter the figures
                raise SystemExit(f"put_profile: {per_round - stored} of {per_round} puts "
                                 "were not stored")
            print(f"client: {per_round / dt:,.0f} puts/s, {per_round * size / dt / 1e9:.2f} GB/s;"
                  f" user {(r1.ru_utime - r0.ru_utime) / per_round * 1e6:.0f} us, "
                  f"system {(r1.ru_stime - r0.ru_stime) / per_round * 1e6:.0f} us CPU per put")
            conn.remove(keys)
        conn.close()
        time.sleep(1.0)  # the server prints its profile when the connection ends
    finally:
        child.kill()
        child.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
