"""Nothing on the wire changed: a pure-Python client (as every client before the native
helper) against a node on the native helper, and a native client against a pure-Python
node (as every node before it), over TCP. Each call's exact results, its errors included.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, start_node

from kvstore import Client
from kvstore.core.errors import BufferTooSmall, InvalidArgument, ResourceExhausted
from kvstore.protocol import native_channel

PATHS = [("native", "python"), ("python", "native")]


def _use(path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(native_channel.ENV, "1" if path == "native" else "0")


@pytest.fixture(params=PATHS, ids=["native-node+python-client", "python-node+native-client"])
def ends(
    request: pytest.FixtureRequest,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    native_channel_status: tuple[bool, str | None],
) -> Iterator[tuple[NodeProcess, str]]:
    node_path, client_path = request.param
    if not native_channel_status[0]:
        pytest.skip(f"native channel helper unavailable: {native_channel_status[1]}")
    _use(node_path, monkeypatch)
    node = start_node(tmp_path)
    try:
        _use(client_path, monkeypatch)
        yield node, node_path
    finally:
        code = node.stop()
    assert code == 0, node.output()


def test_every_call_between_old_and_new_ends(ends: tuple[NodeProcess, str]) -> None:
    node, node_path = ends
    words = "native" if node_path == "native" else "pure Python"
    assert f"(channel I/O: {words})" in node.output()
    keys = [bytes([i]) * 16 for i in range(5)]
    values = [os.urandom(n) for n in (1, 4096, 64 << 10, 1 << 20, 3 << 20)]
    with Client(node.addr, transport="tcp", timeout=30) as c:
        assert c.transport == "tcp"
        assert c.put_batch(keys[:4], values[:4]) == [True] * 4
        assert c.put(keys[4], values[4]) is True
        assert c.put(keys[0], values[0]) is False  # stored already
        assert c.get(keys[3]) == values[3]
        buf = bytearray(4 << 20)
        assert c.get_into(keys[4], buf) == len(values[4])
        assert buf[: len(values[4])] == values[4]
        miss = b"m" * 16
        assert c.get_batch([keys[1], miss, keys[2], keys[1]]) == [
            values[1],
            None,
            values[2],
            values[1],
        ]
        outs = [bytearray(len(v)) for v in values]
        assert c.get_batch_into(keys, outs) == [len(v) for v in values]
        assert [bytes(o) for o in outs] == values
        with pytest.raises(BufferTooSmall):
            c.get_into(keys[2], bytearray(100))
        assert c.get(keys[2]) == values[2]  # the stream stayed in frame
        assert c.exists([keys[0], miss]) == [True, False]
        assert c.prefix_match([keys[0], keys[1], miss, keys[2]]) == 2
        with pytest.raises(InvalidArgument):
            c.put(b"short", b"x")
        with pytest.raises(ResourceExhausted):
            c.put(b"z" * 16, bytes(128 << 20))  # larger than the node's 64 MiB
        assert c.remove(keys[0]) is True
        assert c.remove(keys[0]) is False
        assert c.get_batch(keys[1:]) == values[1:]
