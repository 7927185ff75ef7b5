"""The engine integrations' store keys: one node, or a cluster (store_config)."""

from __future__ import annotations

import pytest

from kvstore.client import Client
from kvstore.integrations.store_config import StoreSpec, store_spec
from replication.cluster_client import ClusterClient


def spec(**cfg: object) -> StoreSpec:
    return store_spec(cfg.get, who="test config")


def test_one_node() -> None:
    assert spec(kvstore_addr="127.0.0.1:7600") == StoreSpec(addr="127.0.0.1:7600")


def test_etcd_and_members_with_replicas_and_quorum() -> None:
    assert spec(kvstore_etcd="etcd://127.0.0.1:2379", replicas=2, write_quorum="1") == \
        StoreSpec(etcd="127.0.0.1:2379", replicas=2, write_quorum=1)
    assert spec(kvstore_members=" h1:1, h2:2 ,h3:3", replicas="3") == \
        StoreSpec(members=("h1:1", "h2:2", "h3:3"), replicas=3)
    assert spec(kvstore_etcd="e:1").describe() == \
        "cluster at etcd e:1 (replicas=1, write_quorum=1)"


@pytest.mark.parametrize(("cfg", "message"), [
    ({}, "exactly one of kvstore_addr .* got none"),
    ({"kvstore_addr": "a:1", "kvstore_etcd": "e:1"},
     "exactly one of .* got kvstore_addr, kvstore_etcd"),
    ({"kvstore_addr": "a:1", "replicas": 2}, "replicas and write_quorum need a cluster"),
    ({"kvstore_etcd": "e:1", "replicas": "two"}, "must be integers, got 'two'"),
    ({"kvstore_etcd": "e:1", "replicas": 2, "write_quorum": 3},
     "1 <= write_quorum <= replicas, got replicas=2, write_quorum=3"),
    ({"kvstore_members": " , "}, "kvstore_members lists no HOST:PORT"),
    ({"kvstore_members": "h1:1,h2"}, "kvstore_members must be HOST:PORT, got 'h2'"),
    ({"kvstore_addr": "nohost"}, "kvstore_addr must be HOST:PORT"),
])
def test_bad_configs_name_the_keys(cfg: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        spec(**cfg)


def test_connect_builds_the_client_of_each_form() -> None:
    with spec(kvstore_addr="127.0.0.1:1").connect(timeout=3.0, token=None) as one:
        assert type(one) is Client and one.timeout == 3.0
    with spec(kvstore_members="127.0.0.1:1,127.0.0.1:2", replicas=2).connect(
            transport="tcp") as many:
        assert isinstance(many, ClusterClient)
        assert (many.replicas, many.write_quorum, many.transport) == (2, 2, "tcp")
        assert [m.addr for m in many.members()] == ["127.0.0.1:1", "127.0.0.1:2"]
