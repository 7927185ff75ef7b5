"""The tenant view of a node: what a caller may do and see, for every transport.

Both the gRPC servicer (``kvstore.server``) and the transfer channel
(``kvstore.node.channel_server``) authenticate a caller into a ``Principal``
(``kvstore.auth.security`` reads tokens and the auth file) and then ask this module,
never decide themselves:

* **Key salting and quotas**: ``Principal.key``/``keys``/``parent`` salt a
  tenant's keys (``kvstore.core.keys.salt_key``); ``Principal.owner``/``quota`` are what a put is
  counted and limited under (``kvstore.auth.quotas``). Transports pass every key they
  are given through them.
* **Copies are charged to their tenant**: a node that copies a tenant's block to a peer
  (a forwarded replicated put, Replicate, repair) names the tenant (``charging``); the
  peer's principal is then the cluster role *charged to* that tenant: keys stay as
  stored, the bytes count against the tenant's quota there. Only the cluster role (or an
  open node's caller) may name a tenant; a tenant naming one gets PERMISSION_DENIED.
* **Copies are capped**: a tenant's replicated put may ask for at most the cluster's
  ``--replicas`` copies (``check_copies``); the cluster role may ask for more.
* **Shared memory**: ``Principal.may_map_region``: the whole region, so only an
  open node's callers and the cluster role.
* **Roles**: an operation marked ``@cluster_only`` (Replicate, Drain, and any
  channel op that moves blocks between nodes) is refused to tenant principals
  with PERMISSION_DENIED before it reads anything. Declaring a new op
  cluster-only is the one decorator line on its handler.
* **Reply bounds**: ``check_reply_bytes`` refuses a read whose reply would pass
  a byte bound, before anything is allocated (repeated keys count each time).
* **Stats**: ``stats_view`` is the one place that decides what ``Stats`` shows:
  the cluster role (and an open node) sees everything; a tenant sees the node's
  capacity and its own usage, never another tenant's.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from kvstore.core.errors import REPLY_BOUND, PermissionDenied, ReplyTooLarge

# The salting formula is kvstore.core.keys' (with every other stored-key derivation); its
# names stay importable from here and from kvstore.auth.security.
from kvstore.core.keys import TENANT_DOMAIN as TENANT_DOMAIN
from kvstore.core.keys import BlockKey, salt_key
from kvstore.core.sizes import format_size

F = TypeVar("F", bound=Callable[..., Any])


@dataclass(frozen=True, slots=True, kw_only=True)
class Tenant:
    name: str
    token_sha256: bytes
    role: str = "tenant"
    quota_bytes: int | None = None

    @property
    def salts(self) -> bool:
        return self.role == "tenant"


@dataclass(frozen=True, slots=True, kw_only=True)
class Principal:
    """The caller of one request. ``tenant`` None: the node has no auth file (open).
    ``charged``: the tenant a cluster-role caller's puts are charged to (``charging``)."""

    tenant: Tenant | None = None
    charged: Tenant | None = None

    @property
    def owner(self) -> str | None:
        """The name a put's bytes are counted (and, with a quota, limited) under: a tenant's
        own, or the one a cluster-role copy is charged to; else None (nobody is charged)."""
        t = self.tenant
        if t is not None and t.salts:
            return t.name
        return None if self.charged is None else self.charged.name

    @property
    def quota(self) -> int | None:
        t = self.tenant
        if t is not None and t.salts:
            return t.quota_bytes
        return None if self.charged is None else self.charged.quota_bytes

    @property
    def may_map_region(self) -> bool:
        """Same-host shared memory maps every block: only for an open node or the cluster."""
        return self.tenant is None or not self.tenant.salts

    def key(self, key: BlockKey) -> BlockKey:
        t = self.tenant
        return salt_key(t.name, key) if t is not None and t.salts else key

    def keys(self, keys: Sequence[BlockKey]) -> list[BlockKey]:
        t = self.tenant
        if t is None or not t.salts:
            return list(keys)
        return [salt_key(t.name, k) for k in keys]

    def parent(self, parent: BlockKey | None) -> BlockKey | None:
        return None if parent is None else self.key(parent)


OPEN = Principal()



_CLUSTER_ONLY = "_kvstore_cluster_only"


def cluster_only(handler: F) -> F:
    """Marks a handler as an operation of the cluster role (nodes and operators)."""
    setattr(handler, _CLUSTER_ONLY, True)
    return handler


def is_cluster_only(handler: Callable[..., Any]) -> bool:
    return bool(getattr(handler, _CLUSTER_ONLY, False))


def is_tenant(p: Principal) -> bool:
    """A caller whose keys are salted: neither an open node's caller nor the cluster role."""
    return p.tenant is not None and p.tenant.salts


def require_cluster_role(p: Principal, what: str) -> None:
    """PERMISSION_DENIED if ``p`` is a tenant."""
    if is_tenant(p):
        assert p.tenant is not None
        raise PermissionDenied(f"{what} needs a cluster-role token; tenant {p.tenant.name!r} "
                               f"may not call it")


def charging(p: Principal, tenant: Tenant) -> Principal:
    """``p`` with its puts charged to ``tenant`` (the copies a peer sends of ``tenant``'s
    blocks); PERMISSION_DENIED if ``p`` is a tenant: it may not charge anyone else."""
    if is_tenant(p):
        assert p.tenant is not None
        raise PermissionDenied(f"only the cluster role names the tenant a put is charged to; "
                               f"tenant {p.tenant.name!r} may not")
    return Principal(tenant=p.tenant, charged=tenant)


def check_copies(p: Principal, copies: int, replicas: int) -> None:
    """PERMISSION_DENIED if tenant ``p`` asks for more copies of a block than the cluster
    keeps (``replicas``, the node's ``--replicas``): copies made for a tenant are charged
    to it on every node, and no tenant may place one on every node by asking. The same
    request is valid from the cluster role, so it is a permission, not a bad argument."""
    if copies > replicas and is_tenant(p):
        assert p.tenant is not None
        raise PermissionDenied(f"tenant {p.tenant.name!r} asked for {copies} copies of a block; "
                               f"this cluster keeps at most {replicas} (--replicas {replicas}): "
                               f"ask for {replicas} or fewer")


def check_role(p: Principal, handler: Callable[..., Any], what: str) -> None:
    """PERMISSION_DENIED if ``handler`` is cluster-only and ``p`` is a tenant."""
    if is_cluster_only(handler):
        require_cluster_role(p, what)


def check_reply_bytes(sizes: Sequence[int | None], limit: int, what: str) -> int:
    """The reply's value bytes (misses count 0); ``ReplyTooLarge`` past ``limit``.

    Called with the sizes of the blocks a read names, repeats included, before
    any buffer for the reply exists: a caller cannot make the node allocate more
    than ``limit`` bytes for one reply, however it repeats keys.
    """
    total = sum(n for n in sizes if n is not None)
    if total > limit:
        raise ReplyTooLarge(
            f"{what} reply would be {total} bytes ({format_size(total)}), over the "
            f"{limit}-byte ({format_size(limit)}) {REPLY_BOUND}: ask for fewer keys per "
            f"request")
    return total


# Node-section items a tenant may see: the node's own settings and state, nothing that
# sums other tenants' activity.
_TENANT_NODE_ITEMS = frozenset({"policy", "uptime_s", "draining"})
_TENANT_TIER_COUNTERS = frozenset({"capacity"})


def stats_view(p: Principal, stats: dict[str, Any]) -> dict[str, Any]:
    """What ``p`` may see of ``Node.stats()``."""
    if not is_tenant(p):
        return stats
    assert p.tenant is not None
    name = p.tenant.name
    used = stats["node"].get("namespace_bytes", {}).get(name, 0)
    node: dict[str, Any] = {k: v for k, v in stats["node"].items() if k in _TENANT_NODE_ITEMS}
    node["tenant"] = name
    node["namespace_bytes"] = {name: used}
    kept = stats["node"].get("namespace_retained_bytes", {}).get(name)
    if kept:  # its own retained bytes (``tiers.retention``), never the node's sums
        node["namespace_retained_bytes"] = {name: kept}
    if p.tenant.quota_bytes is not None:
        node["quota_bytes"] = p.tenant.quota_bytes
    tiers = {t: {"name": s["name"], **{k: v for k, v in s.items() if k in _TENANT_TIER_COUNTERS}}
             for t, s in stats["tiers"].items()}
    return {"node": node, "tiers": tiers}
