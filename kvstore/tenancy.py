"""The tenant view of a node: what a caller may do and see, for every transport.

Both the gRPC servicer (``kvstore.server``) and the transfer channel
(``kvstore.channel_server``) authenticate a caller into a ``Principal``
(``kvstore.security``) and then ask this module, never decide themselves:

* **Key salting and quotas**: ``Principal.key``/``keys``/``parent`` salt a
  tenant's keys; ``Principal.owner``/``quota`` are what a put is charged to
  (``kvstore.quotas``). Transports pass them through unchanged.
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
from typing import Any, TypeVar

from kvstore.errors import REPLY_BOUND, PermissionDenied, ResourceExhausted
from kvstore.security import Principal
from kvstore.sizes import format_size

F = TypeVar("F", bound=Callable[..., Any])

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


def check_role(p: Principal, handler: Callable[..., Any], what: str) -> None:
    """PERMISSION_DENIED if ``handler`` is cluster-only and ``p`` is a tenant."""
    if is_cluster_only(handler):
        require_cluster_role(p, what)


def check_reply_bytes(sizes: Sequence[int | None], limit: int, what: str) -> int:
    """The reply's value bytes (misses count 0); RESOURCE_EXHAUSTED past ``limit``.

    Called with the sizes of the blocks a read names, repeats included, before
    any buffer for the reply exists: a caller cannot make the node allocate more
    than ``limit`` bytes for one reply, however it repeats keys.
    """
    total = sum(n for n in sizes if n is not None)
    if total > limit:
        raise ResourceExhausted(
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
    if p.tenant.quota_bytes is not None:
        node["quota_bytes"] = p.tenant.quota_bytes
    tiers = {t: {"name": s["name"], **{k: v for k, v in s.items() if k in _TENANT_TIER_COUNTERS}}
             for t, s in stats["tiers"].items()}
    return {"node": node, "tiers": tiers}
