"""Cluster scale on paper and by simulation: the arithmetic, and the placement it runs."""

from __future__ import annotations

import pytest

from benchmarks import cluster_scale as cs

GiB = 1 << 30


def test_paper_one_node_of_a_hundred_leaving() -> None:
    pp = cs.paper(nodes=100, blocks=1_000_000_000, replicas=2, block_bytes=64 << 10,
                  repair_bytes_per_s=100 << 20)
    assert pp["copies_held_per_node"] == 20_000_000  # R * B / N
    assert pp["copies_moved"] == 20_000_000
    assert pp["fraction_of_copies_moved"] == 0.01
    assert pp["masters_moved"] == 10_000_000  # B / N
    assert pp["bytes_moved"] == 20_000_000 * 65536
    assert pp["pushes_per_node"] == pytest.approx(20_000_000 / 99)
    # 202,020 pushes of 64 KiB at 100 MiB/s: 126 s
    assert pp["repair_seconds"] == pytest.approx(20_000_000 / 99 * 65536 / (100 << 20))
    assert round(pp["repair_seconds"]) == 126


def test_paper_replicas_past_the_node_count_are_capped() -> None:
    pp = cs.paper(nodes=2, blocks=10, replicas=3, block_bytes=1, repair_bytes_per_s=1)
    assert pp["copies_held_per_node"] == 10  # every node holds every block
    with pytest.raises(ValueError):
        cs.paper(nodes=1, blocks=10, replicas=1, block_bytes=1, repair_bytes_per_s=1)


def test_the_simulation_moves_only_the_leaving_nodes_copies() -> None:
    sim = cs.simulate(nodes=20, blocks=20_000, replicas=2, block_bytes=1,
                      repair_bytes_per_s=1, sample=20_000, seed=3)
    # Rendezvous: every copy the node held gets one new owner, nothing else moves.
    assert sim["copies_moved"] == sim["copies_held_by_leaving"]
    assert sim["fraction_of_copies_moved"] == pytest.approx(1 / 20, rel=0.15)
    assert sim["masters_moved"] == pytest.approx(20_000 / 20, rel=0.15)
    assert sim["pushers"] == 19 and sim["receivers"] == 19
    assert sim["join_copies_to_new_node"] == pytest.approx(2 * 20_000 / 21, rel=0.15)


def test_etcd_extrapolates_per_member() -> None:
    census = {"nodes": 3, "blocks_put": 100, "keys_per_member": 1.0, "bytes_per_member": 97.0,
              "keys_added_by_blocks": 0, "after": {"leases": 3}}
    ex = cs.extrapolate(census, 100)
    assert ex == {"nodes": 100, "keys": 100.0, "bytes": 9700.0, "leases": 100.0,
                  "keys_per_block": 0.0}


@pytest.mark.slow
def test_a_real_cluster_keeps_members_only_in_etcd() -> None:
    census = cs.etcd_census(2, 300, replicas=2)
    assert census["after"]["keys"] == ["/kvstore/v1/members/node-1",
                                       "/kvstore/v1/members/node-2"]
    assert census["keys_added_by_blocks"] == 0
    assert census["revisions_added_by_blocks"] == 0
    assert census["after"]["leases"] == 2
