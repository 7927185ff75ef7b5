"""Where an engine integration's store is: one node, or a cluster.

The vLLM connector, the SGLang HiCache backend and the LMCache plugin read these
keys from their engine's extra config (``get(key)`` returns the value or None):

* ``kvstore_addr`` ``"HOST:PORT"``: one node, ``kvstore.Client(addr)``;
* ``kvstore_etcd`` ``"HOST:PORT"`` (an ``etcd://`` prefix is dropped): the cluster
  registered in that etcd;
* ``kvstore_members`` ``"H1:P1,H2:P2,..."``: a fixed list of cluster nodes (each
  named by its address);
* with a cluster: ``replicas`` (copies of every block, default 1) and ``write_quorum``
  (copies a save waits for, default ``replicas``);
* ``kvstore_token`` and the integration's transport and timeout keys apply to all
  three forms.

Exactly one of the three places must be given.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

PLACE_KEYS = ("kvstore_addr", "kvstore_etcd", "kvstore_members")


def _given(value: object) -> bool:
    return value is not None and value != ""


@dataclass(frozen=True, slots=True, kw_only=True)
class StoreSpec:
    """A checked store config: one node (``addr``), or a cluster (``etcd``/``members``)."""

    addr: str = ""
    etcd: str = ""
    members: tuple[str, ...] = ()
    replicas: int = 1
    write_quorum: int | None = None

    def describe(self) -> str:
        if self.addr:
            return self.addr
        where = f"etcd {self.etcd}" if self.etcd else "members " + ",".join(self.members)
        return (f"cluster at {where} (replicas={self.replicas}, "
                f"write_quorum={self.write_quorum or self.replicas})")

    def connect(self, **options: Any) -> Any:
        """A ``kvstore.Client`` (one node) or ``ClusterClient``; ``options`` (``transport``,
        ``timeout``, ``token``; None: the default) go to either."""
        from kvstore.client import Client  # the integrations load the client lazily

        opts = {k: v for k, v in options.items() if v is not None}
        if self.addr:
            return Client(self.addr, **opts)
        cluster: dict[str, Any] = {"replicas": self.replicas,
                                   "write_quorum": self.write_quorum}
        if self.etcd:
            return Client(etcd=self.etcd, **cluster, **opts)
        from replication.placement.rendezvous import Member, NodeId

        members = [Member(node_id=NodeId(a), addr=a) for a in self.members]
        return Client(members=members, **cluster, **opts)


def store_spec(get: Callable[[str], Any], *, who: str) -> StoreSpec:
    """The store ``get`` names; ValueError (naming the keys) for a config that is wrong."""
    places = {k: get(k) for k in PLACE_KEYS if _given(get(k))}
    if len(places) != 1:
        got = ", ".join(places) or "none"
        raise ValueError(f"{who} needs exactly one of kvstore_addr (HOST:PORT of a node), "
                         f"kvstore_etcd (HOST:PORT of the cluster's etcd) or kvstore_members "
                         f"(H1:P1,H2:P2,...); got {got}")
    (key, value), = places.items()
    replicas, quorum = get("replicas"), get("write_quorum")
    if key == "kvstore_addr":
        if _given(replicas) or _given(quorum):
            raise ValueError(f"{who}: replicas and write_quorum need a cluster "
                             f"(kvstore_etcd or kvstore_members), not kvstore_addr")
        return StoreSpec(addr=_host_port(str(value), who, key))
    try:
        n = int(replicas) if _given(replicas) else 1
        w = int(quorum) if _given(quorum) else None
    except (TypeError, ValueError):
        raise ValueError(f"{who}: replicas and write_quorum must be integers, got "
                         f"{replicas!r} and {quorum!r}") from None
    if n < 1 or not 1 <= (w or n) <= n:
        raise ValueError(f"{who}: need replicas >= 1 and 1 <= write_quorum <= replicas, got "
                         f"replicas={n}, write_quorum={w}")
    if key == "kvstore_etcd":
        etcd = _host_port(str(value).removeprefix("etcd://"), who, key)
        return StoreSpec(etcd=etcd, replicas=n, write_quorum=w)
    addrs = tuple(_host_port(a.strip(), who, key) for a in str(value).split(",") if a.strip())
    if not addrs:
        raise ValueError(f"{who}: kvstore_members lists no HOST:PORT")
    return StoreSpec(members=addrs, replicas=n, write_quorum=w)


def _host_port(value: str, who: str, key: str) -> str:
    host, _, port = value.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"{who}: {key} must be HOST:PORT, got {value!r}")
    return value
