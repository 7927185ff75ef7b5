"""The tenant view: role marks, reply bounds, and what Stats shows a tenant."""

from __future__ import annotations

import pytest

from kvstore.auth import tenancy
from kvstore.auth.security import OPEN, Principal, Tenant
from kvstore.core.errors import REPLY_BOUND, PermissionDenied, ReplyTooLarge

A = Principal(tenant=Tenant(name="a", token_sha256=b"\x01" * 32, quota_bytes=1000))
B = Principal(tenant=Tenant(name="b", token_sha256=b"\x02" * 32))
CLUSTER = Principal(tenant=Tenant(name="ops", token_sha256=b"\x03" * 32, role="cluster"))


def test_cluster_only_handlers_refuse_tenants_only() -> None:
    @tenancy.cluster_only
    def forward() -> None: ...

    def get() -> None: ...

    assert tenancy.is_cluster_only(forward) and not tenancy.is_cluster_only(get)
    for p in (OPEN, CLUSTER):
        tenancy.check_role(p, forward, "FORWARD")
    for p in (A, B):
        tenancy.check_role(p, get, "GET")
        with pytest.raises(PermissionDenied, match="FORWARD needs a cluster-role token"):
            tenancy.check_role(p, forward, "FORWARD")


def test_reply_bound_counts_repeats_and_is_exact_at_the_limit() -> None:
    assert tenancy.check_reply_bytes([400, None, 400, 200], 1000, "GET") == 1000
    # The type for new clients, the words for clients before it.
    with pytest.raises(ReplyTooLarge, match=REPLY_BOUND) as err:
        tenancy.check_reply_bytes([400, None, 400, 201], 1000, "GET")
    assert "GET reply would be 1001 bytes" in str(err.value)
    assert tenancy.check_reply_bytes([], 0, "GET") == 0


STATS = {
    "node": {"policy": "lru", "uptime_s": 3.5, "draining": False, "in_flight": 4,
             "pending_promotions": 1, "namespace_bytes": {"a": 300, "b": 700},
             "dram_pinned": True, "node_id": "n1"},
    "tiers": {"dram": {"name": "dram", "capacity": 4096, "used": 1000, "blocks": 3,
                       "hits": 9, "misses": 2}},
}


def test_a_tenant_sees_only_its_own_usage() -> None:
    assert tenancy.stats_view(A, STATS) == {
        "node": {"policy": "lru", "uptime_s": 3.5, "draining": False, "tenant": "a",
                 "namespace_bytes": {"a": 300}, "quota_bytes": 1000},
        "tiers": {"dram": {"name": "dram", "capacity": 4096}},
    }
    c = Principal(tenant=Tenant(name="c", token_sha256=b"\x04" * 32))
    assert tenancy.stats_view(c, STATS)["node"]["namespace_bytes"] == {"c": 0}
    assert tenancy.stats_view(CLUSTER, STATS) is STATS
    assert tenancy.stats_view(OPEN, STATS) is STATS
