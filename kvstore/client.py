"""The kvstore client library: ``Client``.

``Client(addr)`` is a connection to one node (``kvstore.node_client.NodeClient``);
``Client(etcd="HOST:PORT", replicas=2, write_quorum=2)`` (or ``members=[Member(...)]``)
returns a ``replication.cluster_client.ClusterClient`` with the same API, cluster-wide.
This module sits above both (README "How it works"), so neither imports it.

Transports (``transport=``):

* ``"grpc"``: every call is a gRPC call; portable, ~1 GB/s at best.
* ``"tcp"``: a transfer channel negotiated over gRPC; values stream over raw TCP.
* ``"shm"``: same host only; the node's DRAM region is mapped into this process
  and values are copied straight from/into it under read leases/reservations.
* ``"auto"`` (default): ``shm`` if the node is on this host, else ``tcp``, else ``grpc``.

Errors: every failure reaches the caller as a ``kvstore.errors`` exception,
mapped at one choke point (``_errors``): gRPC status codes by code, socket
failures as ``Unavailable``. A gRPC failure the node reported ends with
``(request id ID)``: the id under which the node logged it.

Retry policy: none for errors the node reports. A call that fails with a
transport error is retried once on a fresh connection (every kvstore operation
is idempotent: puts are content-addressed); a second failure is raised.
"""

from __future__ import annotations

from typing import Any

from kvstore.errors import InvalidArgument
from kvstore.keys import BlockKey
from kvstore.node_client import TRANSPORTS, NodeClient, SingleKeyCalls, check_put_batch
from replication.cluster_client import ClusterClient

_NODE_OPTIONS = frozenset({"transport", "timeout", "token", "tls", "io_timeout"})


class Client(NodeClient):
    """A connection to one kvstore node, or (without an address) a cluster client.
    Thread-safe; use as a context manager."""

    def __new__(cls, addr: str | None = None, **options: Any) -> Any:
        if addr is None:
            return ClusterClient(**options)
        cluster_only = set(options) - _NODE_OPTIONS
        if cluster_only:
            raise InvalidArgument(f"{', '.join(sorted(cluster_only))}: cluster options need "
                                  f"etcd= or members= instead of a node address")
        return super().__new__(cls)


__all__ = ["TRANSPORTS", "BlockKey", "Client", "ClusterClient", "NodeClient", "SingleKeyCalls",
           "check_put_batch"]
