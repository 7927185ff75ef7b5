"""Where a remote put's (or get's) time goes: CPU per op on each side of the channel.

Starts a node's transfer-channel server (no gRPC) in a child process, sends N puts
(``--op get``: N gets of stored values, into a preallocated buffer) of SIZE bytes over
TCP from this process, and prints the client's user/system CPU per op, the server
connection thread's CPU per op, and the server's cProfile (top functions by own time);
``--client-profile`` adds the client's. Used to explain ``kvstore bench api``'s figures.

    python -m benchmarks.put_profile --size 1MiB --count 1200
    python -m benchmarks.put_profile --op get --size 64KiB --count 8000 --client-profile
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

PROFILE_LINES = 40


def _serve(port: int, region: int, ops: int, profile: bool, ready: Connection) -> None:
    """The child: a node's channel server; sends its HELLO token over ``ready`` once up."""
    from kvstore.auth.tenancy import OPEN
    from kvstore.node import channel_server
    from kvstore.node.semantics import Node, NodeSettings

    class ProfiledServer(channel_server.ChannelServer):
        """Times (and with ``profile``, profiles) each connection's thread: its HELLO,
        then every request it serves."""

        def serve_connection(self, sock: socket.socket) -> None:
            # CPU time, not wall time: on a loaded machine wall time is mostly waiting.
            prof = cProfile.Profile(time.thread_time) if profile else None
            start = time.thread_time()
            if prof is not None:
                prof.enable()
            try:
                super().serve_connection(sock)
            finally:
                if prof is not None:
                    prof.disable()
                cpu = time.thread_time() - start
                print(f"server connection thread: {cpu / ops * 1e6:.1f} us CPU per op"
                      + (" (cProfile on: Python parts inflated)" if prof else ""), flush=True)
                if prof is not None:
                    pstats.Stats(prof).sort_stats("tottime").print_stats(PROFILE_LINES)
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
    p.add_argument("--op", choices=("put", "get"), default="put",
                   help="get: get_into of stored values (default put)")
    p.add_argument("--port", type=int, default=0, help="0: pick a free port")
    p.add_argument("--no-server-profile", action="store_true",
                   help="time the server thread without cProfile (true CPU per op)")
    p.add_argument("--client-profile", action="store_true",
                   help="also print the client's cProfile (top functions by own time)")
    args = p.parse_args(argv)
    size = parse_size(args.size)
    from benchmarks.peers import free_port
    from kvstore.protocol.wire import Mode
    from kvstore.remote.channel_client import ChannelConnection, ChannelSession

    port = args.port or free_port()
    region = max(64 << 20, 2 * size * args.count // 4)
    ready, child_end = multiprocessing.Pipe(duplex=False)
    child = multiprocessing.Process(
        target=_serve, args=(port, region, args.count, not args.no_server_profile, child_end))
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
        dst = memoryview(bytearray(size))
        per_round = args.count // 4
        prof = cProfile.Profile(time.thread_time) if args.client_profile else None
        stored_keys = [os.urandom(16) for _ in range(16)]
        if args.op == "get":
            conn.put(stored_keys, [value] * len(stored_keys), [None] * len(stored_keys), False)
        for _ in range(4):
            keys = [os.urandom(16) for _ in range(per_round)]
            r0 = resource.getrusage(resource.RUSAGE_SELF)
            t0 = time.perf_counter()
            done = 0
            if prof is not None:
                prof.enable()
            if args.op == "put":
                for k in keys:
                    done += conn.put([k], [value], [None], False)[0]
            else:
                for i in range(per_round):
                    done += conn.get([stored_keys[i & 15]], [dst])[0] == size
            if prof is not None:
                prof.disable()
            dt = time.perf_counter() - t0
            r1 = resource.getrusage(resource.RUSAGE_SELF)
            if done != per_round:  # a refused put (no room) would flatter the figures
                raise SystemExit(f"put_profile: {per_round - done} of {per_round} "
                                 f"{args.op}s failed")
            print(f"client: {per_round / dt:,.0f} {args.op}s/s, "
                  f"{per_round * size / dt / 1e9:.2f} GB/s; "
                  f"user {(r1.ru_utime - r0.ru_utime) / per_round * 1e6:.1f} us, "
                  f"system {(r1.ru_stime - r0.ru_stime) / per_round * 1e6:.1f} us CPU per op")
            if args.op == "put":
                conn.remove(keys)
        conn.close()
        if prof is not None:
            print("client cProfile (all rounds):")
            pstats.Stats(prof).sort_stats("tottime").print_stats(PROFILE_LINES)
        time.sleep(1.0)  # the server prints its profile when the connection ends
    finally:
        child.kill()
        child.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
