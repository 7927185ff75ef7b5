"""The upsert family (``mooncake_upsert``) on a real node: replacement, and that a refused
upsert leaves the stored value in place (the wheel's own answers are checked side by side
in tests/engines/test_mooncake_wheel.py)."""

from __future__ import annotations

import ctypes
from collections.abc import Iterator

import pytest
from conftest import start_node

from kvstore.integrations.mooncake.store import (
    DFS_SERVICE_UNAVAILABLE,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OK,
    MooncakeDistributedStore,
    ReplicateConfig,
)

MiB = 1 << 20


@pytest.fixture(scope="module")
def node_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    node = start_node(tmp_path_factory.mktemp("mc-upsert"), dram="8MiB")
    yield node.addr
    node.stop()


@pytest.fixture
def store(node_addr: str) -> Iterator[MooncakeDistributedStore]:
    s = MooncakeDistributedStore()
    assert s.setup("h", "", 0, 0, "tcp", "", node_addr) == OK
    yield s
    s.remove_all()
    s.close()


def test_upsert_replaces_and_inserts(store: MooncakeDistributedStore) -> None:
    assert store.put("up/a", b"old") == OK
    assert store.put("up/a", b"ignored") == OK and store.get("up/a") == b"old"  # write-once
    assert store.upsert("up/a", b"new value") == OK
    assert store.upsert("up/fresh", b"f") == OK
    assert store.get_batch(["up/a", "up/fresh"]) == [b"new value", b"f"]
    assert sorted(store.written_keys()) == ["up/a", "up/fresh"]


def test_refused_upserts_keep_the_old_value(store: MooncakeDistributedStore) -> None:
    assert store.put("keep/a", b"old") == OK
    dfs = ReplicateConfig()
    dfs.dfs_replica_num = 1
    ttl = ReplicateConfig()
    ttl.soft_pin_ttl_ms = 10  # without ENABLE
    assert store.upsert("keep/a", b"new", dfs) == DFS_SERVICE_UNAVAILABLE
    assert store.upsert("keep/a", b"new", ttl) == INVALID_PARAMS
    assert store.upsert("keep/a", b"") == INVALID_PARAMS
    assert store.upsert("keep/a", 5) == INVALID_PARAMS  # not a buffer
    assert store.upsert_batch(["keep/a"], [b"1", b"2"]) == INVALID_PARAMS
    other = (ctypes.c_ubyte * 8)()
    assert store.upsert_from("keep/a", ctypes.addressof(other), 8) == INVALID_PARAMS
    assert store.upsert_parts("keep/a", b"x", object()) == INVALID_PARAMS
    assert store.get("keep/a") == b"old"


def test_a_put_failing_after_the_removal_leaves_the_key_absent(
        store: MooncakeDistributedStore) -> None:
    """Documented: an upsert is a removal then a put; a value the node cannot hold
    (16 MiB on 8 MiB) is -200 and the old value is gone."""
    assert store.put("gone/a", b"old") == OK
    assert store.upsert("gone/a", bytes(16 * MiB)) == NO_AVAILABLE_HANDLE
    assert store.is_exist("gone/a") == 0


def test_batch_upsert_from_per_key(store: MooncakeDistributedStore) -> None:
    buf = (ctypes.c_ubyte * 16)(*range(16))
    ptr = ctypes.addressof(buf)
    assert store.register_buffer(ptr, 16) == OK
    assert store.put("bf/a", b"old") == OK
    assert store.batch_upsert_from(["bf/a", "bf/b", "bf/c"], [ptr, ptr + 4, ptr + 14],
                                   [4, 2, 4]) == [OK, OK, INVALID_PARAMS]  # c: past the end
    assert store.get_batch(["bf/a", "bf/b", "bf/c"]) == [bytes([0, 1, 2, 3]), bytes([4, 5]),
                                                         b""]
    assert store.batch_upsert_from(["bf/a"], [ptr], [1, 2]) == [INVALID_PARAMS]
    assert store.unregister_buffer(ptr) == OK
