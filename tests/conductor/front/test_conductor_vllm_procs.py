"""``conductor.front.vllm_procs.free_port``: servers started together get distinct ports."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from conductor.front import vllm_procs


class _Probe:
    """A socket whose ``bind(0)`` is given the next port of ``offers``."""

    offers: Iterator[int]

    def __init__(self) -> None:
        self.port = 0

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def bind(self, addr: tuple[str, int]) -> None:
        assert addr == ("127.0.0.1", 0)
        self.port = next(_Probe.offers)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


def test_a_port_the_kernel_offers_again_is_not_handed_out_twice(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The kernel offered 40001 again before the first server bound it: the second caller
    gets the next offer, 40002, and a later offer of either is skipped too."""
    monkeypatch.setattr(vllm_procs, "_HANDED_OUT", set())
    _Probe.offers = iter([40001, 40001, 40002, 40002, 40001, 40003])
    monkeypatch.setattr(vllm_procs.socket, "socket", _Probe)
    assert [vllm_procs.free_port() for _ in range(3)] == [40001, 40002, 40003]


def test_a_real_port_is_free_on_loopback() -> None:
    import socket

    port = vllm_procs.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there
    assert port not in {vllm_procs.free_port() for _ in range(5)}
