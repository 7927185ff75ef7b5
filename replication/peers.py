"""One client per peer node, shared by everything in a process that talks to peers.

A ``PeerPool`` hands out a ``kvstore.client.Client`` per gRPC address, created on
first use and kept until ``retain`` drops addresses that left the membership or
``close`` ends them all. Clients are thread-safe, so one per peer is enough.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable

from kvstore.client import Client
from kvstore.errors import Unavailable
from kvstore.security import ClientTls


class PeerPool:
    def __init__(self, *, transport: str = "auto", timeout: float = 10.0,
                 token: str | None = None, tls: ClientTls | None = None,
                 channel_io_timeout: float | None = None) -> None:
        self.transport = transport
        self.timeout = timeout
        self._io_timeout = channel_io_timeout
        self._token = token
        self._tls = tls
        self._lock = threading.Lock()
        # guarded by _lock:
        self._clients: dict[str, Client] = {}
        self._closed = False

    def get(self, addr: str) -> Client:
        with self._lock:
            if self._closed:
                raise Unavailable("peer pool is closed")
            client = self._clients.get(addr)
            if client is None:
                client = Client(addr, transport=self.transport, timeout=self.timeout,
                                token=self._token, tls=self._tls,
                                channel_io_timeout=self._io_timeout)
                self._clients[addr] = client
            return client

    def retain(self, addrs: Iterable[str]) -> None:
        """Closes the clients of every address not in ``addrs``."""
        keep = set(addrs)
        with self._lock:
            gone = [a for a in self._clients if a not in keep]
            dropped = [self._clients.pop(a) for a in gone]
        for c in dropped:
            c.close()

    def close(self) -> None:
        with self._lock:
            self._closed = True
            clients, self._clients = list(self._clients.values()), {}
        for c in clients:
            c.close()

    def __enter__(self) -> PeerPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
