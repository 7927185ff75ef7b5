"""``ClusterClient`` over real node processes: a put is checked once, on either path to its
copies (the one-trip forwarded put, and put + ``Replicate``); a put resent after its
master's answer was lost is reported stored."""

from __future__ import annotations

import signal
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import (
    NodeProcess,
    free_port,
    lose_first_answer,
    start_node,
    start_static_cluster,
)

from kvstore.client import Client
from kvstore.core.errors import InvalidArgument
from kvstore.protocol.wire import Op
from kvstore.remote.node_client import PutBatch
from replication.cluster_client import ClusterClient
from replication.placement.rendezvous import Member, NodeId

MALFORMED: dict[str, tuple[list[Any], list[Any], dict[str, Any]]] = {
    "short key": ([b"k" * 15], [b"v"], {}),
    "more values than keys": ([b"k" * 16], [b"v", b"w"], {}),
    "malformed parent": ([b"k" * 16], [b"v"], {"parents": [b"p"]}),
    "value not bytes-like": ([b"k" * 16], [object()], {}),
    "negative retention": ([b"k" * 16], [b"v"], {"retain_s": -1.0}),
}


def _members(addrs: list[str]) -> list[Member]:
    # Node id = address, as a static cluster's nodes name each other.
    return [Member(node_id=NodeId(a), addr=a) for a in addrs]


def _stop(nodes: list[NodeProcess]) -> None:
    for n in nodes:
        n.stop(signal.SIGKILL if n.proc.poll() is None else signal.SIGTERM)


@pytest.fixture(scope="module")
def forwarding(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    """Two nodes that list each other and themselves: a master forwards a put itself."""
    nodes = start_static_cluster(tmp_path_factory.mktemp("forwarding"), 2, dram="32MiB")
    yield nodes
    _stop(nodes)


@pytest.fixture(scope="module")
def two_trip(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[NodeProcess]]:
    """Two nodes that each list only the other: a master refuses a forwarded put, so the
    client puts, then asks it to ``Replicate``."""
    tmp: Path = tmp_path_factory.mktemp("two-trip")
    ports = [free_port(), free_port()]
    nodes: list[NodeProcess] = []
    try:
        for mine, other in (ports, ports[::-1]):
            nodes.append(start_node(tmp, "--members", f"127.0.0.1:{other}", port=mine,
                                    dram="32MiB"))
    except BaseException:
        _stop(nodes)
        raise
    yield nodes
    _stop(nodes)


def _cluster_puts(c: ClusterClient) -> dict[str, Callable[[list[Any], list[Any], dict[str, Any]],
                                                          object]]:
    """Every put of ``ClusterClient``, as one batch call."""
    def one(keys: list[Any], values: list[Any], kw: dict[str, Any]) -> object:
        parents = kw.get("parents")
        return c.put(keys[0], values[0], parent=None if parents is None else parents[0],
                     retain_s=kw.get("retain_s"))

    return {"put": one,
            "put_batch": lambda keys, values, kw: c.put_batch(keys, values, **kw)}


def test_every_put_of_the_cluster_client_checks_before_it_connects() -> None:
    nowhere = _members([f"127.0.0.1:{free_port()}", f"127.0.0.1:{free_port()}"])
    with Client(members=nowhere, replicas=2, node_timeout=1) as c:
        puts = {n for n in dir(ClusterClient)
                if n.startswith("put") and callable(getattr(ClusterClient, n))}
        calls = _cluster_puts(c)
        assert puts == set(calls)  # a new put joins the table, and so this test
        for name, call in calls.items():
            for case, (keys, values, kw) in MALFORMED.items():
                if name == "put" and "than keys" in case:
                    continue  # one key and one value by signature
                with pytest.raises(InvalidArgument):
                    call(keys, values, kw)


@pytest.mark.parametrize("path", ["forwarding", "two_trip"])
def test_a_cluster_put_is_checked_once(path: str, request: pytest.FixtureRequest,
                                       monkeypatch: pytest.MonkeyPatch) -> None:
    nodes: list[NodeProcess] = request.getfixturevalue(path)
    checks: list[int] = []
    check = PutBatch.check  # the real check, counted

    def counted(cls: type[PutBatch], keys: Any, values: Any, **kw: Any) -> PutBatch:
        checks.append(len(keys))
        return check(keys, values, **kw)

    monkeypatch.setattr(PutBatch, "check", classmethod(counted))
    keys = [bytes([len(path), i]) * 8 for i in range(40)]
    values = [bytes([i]) * 1000 for i in range(40)]
    with Client(members=_members([n.addr for n in nodes]), replicas=2) as c:
        assert c.put_batch(keys, values) == [True] * 40
        assert checks == [40]  # once, by the cluster client; its node clients take it as is
        assert isinstance(c, ClusterClient)
        assert bool(c._no_forward) == (path == "two_trip")  # the path named was taken
    monkeypatch.undo()
    for n in nodes:  # two copies: each node holds every key
        with Client(n.addr, transport="grpc") as one:
            assert one.get_batch(keys) == values



@pytest.mark.parametrize("pipeline", [True, False], ids=["pipelined", "called"])
def test_a_put_resent_after_its_masters_answer_was_lost_is_stored(
        forwarding: list[NodeProcess], monkeypatch: pytest.MonkeyPatch,
        pipeline: bool) -> None:
    """The first master to answer stores and forwards its keys, then its answer is lost
    (the stream resets). Pipelined, the client puts those keys through the next node,
    which holds the forwarded copies already; called, the node client resends to the same
    master, which holds them too. Either way every key is reported stored, with both
    copies."""
    lost = lose_first_answer(monkeypatch, Op.RPUT)
    keys = [bytes([0xA5, pipeline, i, 0]) * 4 for i in range(24)]
    values = [bytes([i]) * 3000 for i in range(24)]
    with ClusterClient(members=_members([n.addr for n in forwarding]), replicas=2,
                       write_quorum=2, transport="tcp", pipeline=pipeline) as c:
        assert c.put_batch(keys, values) == [True] * 24
    assert len(lost) == 1 and 0 < lost[0] < 24  # one master's part was put twice
    monkeypatch.undo()
    for n in forwarding:  # two copies: each node holds every key
        with Client(n.addr, transport="grpc") as one:
            assert one.get_batch(keys) == values
