"""``CandidateCache``: memoised, bounded, per view; the one cache the cluster client and
the forwarder share."""

from __future__ import annotations

from collections.abc import Sequence

import pytest

from replication.cluster_client import ClusterClient
from replication.copies.forwarder import Forwarder
from replication.copies.peers import PeerPool
from replication.membership import StaticMembership
from replication.placement.candidates import CandidateCache
from replication.placement.rendezvous import Member, NodeId, Placement

MEMBERS = tuple(Member(node_id=NodeId(f"n{i}"), addr=f"127.0.0.1:{9000 + i}") for i in range(5))
KEYS = [bytes([i]) * 16 for i in range(8)]


def _pair(owners: list[NodeId], rest: list[NodeId]) -> tuple[list[NodeId], list[NodeId]]:
    return owners, rest


def test_get_is_the_shape_of_the_placements_candidates() -> None:
    placement = Placement(MEMBERS)
    cache = CandidateCache(placement, lambda owners, rest: (tuple(owners), len(rest)))
    for key in KEYS:
        for r in (1, 2, 3):
            owners, rest = placement.candidates(key, r)
            assert cache.get(key, r) == (tuple(owners), len(rest))
    assert len(cache) == len(KEYS) * 3  # per (key, replicas)


def test_an_entry_is_computed_once_until_the_bound_clears_the_cache() -> None:
    shaped: list[NodeId] = []

    def shape(owners: list[NodeId], rest: list[NodeId]) -> NodeId:
        shaped.append(owners[0])
        return owners[0]

    cache = CandidateCache(Placement(MEMBERS), shape, max_keys=3)
    first = [cache.get(k, 2) for k in KEYS[:3]]
    assert [cache.get(k, 2) for k in KEYS[:3]] == first and len(shaped) == 3  # memoised
    assert len(cache) == 3
    cache.get(KEYS[3], 2)  # at the bound: starts afresh with this one
    assert len(cache) == 1 and len(shaped) == 4
    assert cache.get(KEYS[0], 2) == first[0] and len(shaped) == 5  # recomputed, same answer


def test_get_many_ranks_only_what_is_not_memoised_in_one_call() -> None:
    asked: list[list[bytes]] = []

    class Counted(Placement):
        def candidates_many(self, keys: Sequence[bytes], replicas: int
                            ) -> list[tuple[list[NodeId], list[NodeId]]]:
            asked.append(list(keys))
            return super().candidates_many(keys, replicas)

    cache = CandidateCache(Counted(MEMBERS), _pair)
    cache.get(KEYS[2], 2)
    got = cache.get_many(KEYS, 2)
    assert got == [Placement(MEMBERS).candidates(k, 2) for k in KEYS]
    assert asked == [KEYS[:2] + KEYS[3:]]  # one call, the memoised key left out
    assert cache.get_many(KEYS, 2) == got and len(asked) == 1  # all memoised now
    assert cache.get_many([], 2) == [] and len(asked) == 1


def test_get_many_past_the_bound_starts_afresh() -> None:
    cache = CandidateCache(Placement(MEMBERS), _pair, max_keys=4)
    cache.get_many(KEYS[:3], 1)
    assert len(cache) == 3
    cache.get_many(KEYS[3:5], 1)  # 3 + 2 > 4: cleared first, then these two
    assert len(cache) == 2


def test_max_keys_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_keys"):
        CandidateCache(Placement(MEMBERS), _pair, max_keys=0)


def test_the_cluster_client_and_the_forwarder_keep_one_per_view() -> None:
    membership = StaticMembership(MEMBERS)
    with ClusterClient(membership=membership, replicas=2) as client:
        view = client._view
        assert isinstance(view.cache, CandidateCache)
        assert view.candidates(KEYS[0]) == view.placement.candidates(KEYS[0], 2)
    forwarder = Forwarder(PeerPool())
    try:
        forwarder.attach(membership, "n0", replicas=2)
        targets = forwarder._targets
        assert isinstance(targets, CandidateCache)
        owners, rest = targets.placement.candidates(KEYS[0], 3)
        by_id = {m.node_id: m.addr for m in MEMBERS}
        # The replica targets: owners then the rest, in ranking order, this node left out.
        assert targets.get(KEYS[0], 3) == tuple(by_id[n] for n in owners + rest if n != "n0")
    finally:
        forwarder.close()
