"""The tenant view: role marks, reply bounds, what Stats shows a tenant, and copies: their
cap and the tenant they are charged to."""

from __future__ import annotations

import hashlib

import pytest

from kvstore.auth import tenancy
from kvstore.auth.security import (
    CHARGE_TO_HEADER,
    OPEN,
    Principal,
    Tenant,
    TenantRegistry,
    charge_to_metadata,
    principal_of,
)
from kvstore.core.errors import (
    REPLY_BOUND,
    InvalidArgument,
    PermissionDenied,
    ReplyTooLarge,
    Unauthenticated,
)

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


def test_a_copy_charged_to_a_tenant_keeps_its_stored_key_and_counts_against_its_quota() -> None:
    assert A.tenant is not None and CLUSTER.tenant is not None
    for p in (CLUSTER, OPEN):
        charged = tenancy.charging(p, A.tenant)
        assert (charged.owner, charged.quota) == ("a", 1000)
        assert charged.key(b"k" * 16) == b"k" * 16  # as stored on the source: no salt
        assert charged.may_map_region and not tenancy.is_tenant(charged)
    assert (CLUSTER.owner, CLUSTER.quota, OPEN.owner) == (None, None, None)
    for p in (A, B):
        with pytest.raises(PermissionDenied, match="only the cluster role names the tenant"):
            tenancy.charging(p, A.tenant)


def test_a_tenant_asks_for_at_most_the_clusters_copies() -> None:
    for copies in (1, 2):
        tenancy.check_copies(A, copies, 2)
    with pytest.raises(PermissionDenied) as err:
        tenancy.check_copies(A, 3, 2)
    assert "asked for 3 copies" in str(err.value) and "--replicas 2" in str(err.value)
    for p in (CLUSTER, OPEN):  # nodes and operators may ask for more (fan-out, hand-off)
        tenancy.check_copies(p, 5, 2)


def test_the_charge_header_is_read_after_the_token() -> None:
    registry = TenantRegistry([
        Tenant(name="a", token_sha256=hashlib.sha256(b"token-a").digest(), quota_bytes=10),
        Tenant(name="ops", token_sha256=hashlib.sha256(b"token-ops").digest(),
               role="cluster")])

    def md(token: str, *charge: str) -> list[tuple[str, str | bytes]]:
        return [("authorization", f"Bearer {token}"),
                *(charge_to_metadata(name) for name in charge)]

    assert principal_of(registry, md("token-ops")).owner is None
    listed = principal_of(registry, md("token-ops", "a"))
    assert (listed.owner, listed.quota) == ("a", 10)
    unlisted = principal_of(registry, md("token-ops", "ünlisted"))  # counted, not limited
    assert (unlisted.owner, unlisted.quota) == ("ünlisted", None)
    with pytest.raises(PermissionDenied):
        principal_of(registry, md("token-a", "a"))
    with pytest.raises(Unauthenticated):  # the token first: no charge without one
        principal_of(registry, md("wrong", "a"))
    with pytest.raises(InvalidArgument):
        principal_of(registry, [*md("token-ops"), (CHARGE_TO_HEADER, b"\xff")])
    assert principal_of(None, [charge_to_metadata("a")]).owner == "a"  # an open node
