"""``kvstore.core.ports.free_port``: a free port, never the same one twice in a process."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from kvstore.core import ports


class _Probe:
    """A socket whose ``bind((host, 0))`` is given the next port of ``offers``; it records
    the hosts it was bound on and checks that the lock is held while it probes."""

    offers: Iterator[int]
    hosts: list[str]

    def __init__(self, *args: Any) -> None:
        self.port = 0

    def __enter__(self) -> _Probe:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def bind(self, addr: tuple[str, int]) -> None:
        assert addr[1] == 0
        assert ports._LOCK.locked()
        _Probe.hosts.append(addr[0])
        self.port = next(_Probe.offers)

    def getsockname(self) -> tuple[str, int]:
        return ("127.0.0.1", self.port)


@pytest.fixture
def offer(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., None]]:
    """``offer(*ports)``: the kernel offers these ports, in order, to a process that was
    given none before."""
    monkeypatch.setattr(ports, "_HANDED_OUT", set())
    monkeypatch.setattr(ports.socket, "socket", _Probe)
    _Probe.hosts = []

    def offer(*offers: int) -> None:
        _Probe.offers = iter(offers)

    yield offer


def test_a_port_offered_twice_is_handed_out_once(offer: Callable[..., None]) -> None:
    """The kernel offers 5000 twice, then 5001: the second caller gets 5001."""
    offer(5000, 5000, 5001)
    assert ports.free_port() == 5000
    assert ports.free_port() == 5001
    assert _Probe.hosts == ["127.0.0.1"] * 3


def test_every_port_handed_out_is_skipped_later(offer: Callable[..., None]) -> None:
    """The kernel offered 40001 again before the first server bound it: the second caller
    gets the next offer, 40002, and a later offer of either is skipped too."""
    offer(40001, 40001, 40002, 40002, 40001, 40003)
    assert [ports.free_port() for _ in range(3)] == [40001, 40002, 40003]


def test_the_port_is_probed_on_the_host_asked_for(offer: Callable[..., None]) -> None:
    """``host`` is where the probe binds; a port handed out on one host is not handed out
    again on another."""
    offer(6000, 6000, 6001)
    assert ports.free_port("127.0.0.2") == 6000
    assert ports.free_port("127.0.0.3") == 6001
    assert _Probe.hosts == ["127.0.0.2", "127.0.0.3", "127.0.0.3"]


def test_a_real_port_is_free_on_loopback() -> None:
    port = ports.free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))  # nothing listens there
    assert port not in {ports.free_port() for _ in range(5)}


def test_threads_asking_together_get_distinct_ports() -> None:
    got: list[list[int]] = [[] for _ in range(4)]
    start = threading.Barrier(len(got))

    def ask(mine: list[int]) -> None:
        start.wait()
        mine.extend(ports.free_port() for _ in range(50))

    threads = [threading.Thread(target=ask, args=(mine,)) for mine in got]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    handed_out = [port for mine in got for port in mine]
    assert len(handed_out) == len(set(handed_out)) == 200
