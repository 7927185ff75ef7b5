"""The kvstore client library: ``Client``.

``Client(addr)`` is a connection to one node (``kvstore.remote.node_client.NodeClient``);
``Client(etcd="HOST:PORT", replicas=2, write_quorum=2)`` (or ``members=[Member(...)]``)
returns a ``replication.cluster_client.ClusterClient`` with the same API, cluster-wide.
This module sits above both (docs/architecture.md, "How it works"), so neither imports it.

Transports, errors and the retry policy: ``kvstore.remote.node_client`` (the cluster client
uses node clients, so they hold there too).
"""

from __future__ import annotations

from typing import Any

from kvstore.core.errors import InvalidArgument
from kvstore.core.keys import BlockKey
from kvstore.core.prefetch import MAX_PREFETCH_KEYS, PrefetchOutcome
from kvstore.core.retention import MAX_RETAIN_KEYS, RetainOutcome
from kvstore.remote.node_client import TRANSPORTS, NodeClient, SingleKeyCalls, check_put_batch
from replication.cluster_client import ClusterClient

_NODE_OPTIONS = frozenset({"transport", "timeout", "token", "tls", "io_timeout", "charge_to"})


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


__all__ = ["MAX_PREFETCH_KEYS", "MAX_RETAIN_KEYS", "TRANSPORTS", "BlockKey", "Client",
           "ClusterClient", "NodeClient", "PrefetchOutcome", "RetainOutcome", "SingleKeyCalls",
           "check_put_batch"]
