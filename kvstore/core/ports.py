"""Free ports for the processes kvstore starts on one machine: the nodes, workers, etcd,
Conductors and vLLM servers of the tests, demos and benchmarks, and ``kvstore cluster up``.

``free_port`` asks the kernel (a socket bound to port 0) and never hands out the same port
twice in one process. Servers started together are each given a port before any of them
binds it, and the kernel can offer a just-closed probe's port again: without the rule two of
them can get the same port (two vLLM servers of one test module once did, and both fronts
refused with 'instance ids must be unique'). A port is free when handed out, not reserved:
whoever takes it must still bind it, and something else may take it first.
"""

from __future__ import annotations

import socket
import threading

_HANDED_OUT: set[int] = set()
"""Ports ``free_port`` returned in this process (on any host): free when asked, maybe not
bound yet."""
_LOCK = threading.Lock()
"""Held from the probe to the set's update, so two threads never get the same port."""


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` (an IPv4 address), never one this process
    was given before."""
    with _LOCK:
        while True:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
                s.bind((host, 0))
                port = int(s.getsockname()[1])
            if port not in _HANDED_OUT:
                _HANDED_OUT.add(port)
                return port
