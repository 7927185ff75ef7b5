"""Many client threads against one real node: every byte read back is the byte written.

Threads start together on a Barrier. Each test runs with one Client per thread
and with one Client shared by all threads (its connection pool then serves
concurrent calls), over tcp and shm; grpc, being slow, runs once.
"""

from __future__ import annotations

import os
import random
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import NodeProcess, start_node

from kvstore import Client

THREADS = 4
MAX_VALUE = 512 << 10

VARIANTS = [
    pytest.param("tcp", False, id="tcp-own"),
    pytest.param("tcp", True, id="tcp-shared"),
    pytest.param("shm", False, id="shm-own"),
    pytest.param("shm", True, id="shm-shared"),
    pytest.param("grpc", False, id="grpc-own"),
]


def run_together(n: int, work: Callable[[int], None], timeout: float = 60.0) -> None:
    """Runs ``work(i)`` for i in range(n) on n threads released together by a Barrier."""
    barrier = threading.Barrier(n)
    errors: list[BaseException] = []
    lock = threading.Lock()

    def body(i: int) -> None:
        try:
            barrier.wait(timeout)
            work(i)
        except BaseException as exc:
            with lock:
                errors.append(exc)
            barrier.abort()

    threads = [threading.Thread(target=body, args=(i,), name=f"client-{i}") for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout)
    assert not any(t.is_alive() for t in threads), "a client thread hung"
    if errors:
        raise errors[0]


class Clients:
    """One client per thread, or one shared by every thread."""

    def __init__(self, addr: str, transport: str, shared: bool, n: int) -> None:
        self._clients = [Client(addr, transport=transport, timeout=30)
                         for _ in range(1 if shared else n)]
        for c in self._clients:
            assert c.transport == transport

    def __getitem__(self, i: int) -> Client:
        return self._clients[i % len(self._clients)]

    def close(self) -> None:
        for c in self._clients:
            c.close()


@pytest.fixture
def clients_for(request: pytest.FixtureRequest) -> Iterator[Callable[..., Clients]]:
    made: list[Clients] = []

    def make(addr: str, transport: str, shared: bool, n: int = THREADS) -> Clients:
        made.append(Clients(addr, transport, shared, n))
        return made[-1]

    yield make
    for c in made:
        c.close()


def random_value(rnd: random.Random) -> bytes:
    # Mostly spread over the whole range, sometimes tiny.
    n = rnd.randint(1, 64) if rnd.random() < 0.15 else rnd.randint(1, MAX_VALUE)
    return os.urandom(n)


@pytest.mark.parametrize(("transport", "shared"), VARIANTS)
def test_concurrent_random_blocks_read_back_exact(node: NodeProcess, transport: str,
                                                  shared: bool,
                                                  clients_for: Callable[..., Clients]) -> None:
    clients = clients_for(node.addr, transport, shared)
    rounds = 25 if transport == "grpc" else 100
    published: dict[bytes, bytes] = {}  # blocks every thread may read; never removed
    lock = threading.Lock()

    def work(i: int) -> None:
        c = clients[i]
        rnd = random.Random(1000 + i)
        window: list[tuple[bytes, bytes]] = []
        for r in range(rounds):
            k, v = os.urandom(16), random_value(rnd)
            assert c.put(k, v) is True
            assert c.put(k, v) is False
            assert c.get(k) == v
            buf = bytearray(len(v) + 7)
            assert c.get_into(k, buf) == len(v)
            assert bytes(buf[: len(v)]) == v
            if r < 3:
                with lock:
                    published[k] = v
            else:
                window.append((k, v))
            with lock:
                others = rnd.sample(sorted(published), min(3, len(published)))
                expected = [published[o] for o in others]
            assert c.get_batch(others) == expected
            if len(window) > 6:  # bounded footprint: no eviction in a 64 MiB node
                old, _ = window.pop(0)
                assert c.remove(old) is True
        keys = [k for k, _ in window]
        assert c.get_batch(keys) == [v for _, v in window]
        assert c.exists(keys) == [True] * len(keys)

    run_together(THREADS, work)
    with Client(node.addr, transport="grpc") as c:
        assert c.get_batch(list(published)) == list(published.values())
        assert c.stats()["tiers"]["dram"]["evictions"] == 0


@pytest.mark.parametrize(("transport", "shared"), VARIANTS)
def test_constant_eviction_never_returns_wrong_bytes(tmp_path: Path, transport: str,
                                                     shared: bool,
                                                     clients_for: Callable[..., Clients]
                                                     ) -> None:
    small = start_node(tmp_path, dram="8MiB")
    try:
        clients = clients_for(small.addr, transport, shared)
        rounds = 30 if transport == "grpc" else 120
        written: dict[bytes, bytes] = {}
        lock = threading.Lock()
        outcome = {"hits": 0, "misses": 0}

        def check(keys: list[bytes], got: list[bytes | None]) -> None:
            assert len(got) == len(keys)
            for k, g in zip(keys, got, strict=True):
                assert g is None or g == written[k], f"wrong bytes for {k.hex()}"
                with lock:
                    outcome["hits" if g is not None else "misses"] += 1

        def work(i: int) -> None:
            c = clients[i]
            rnd = random.Random(2000 + i)
            for _ in range(rounds):
                k, v = os.urandom(16), random_value(rnd)
                with lock:
                    written[k] = v  # before the put: a reader may see it at once
                    pool = list(written)
                assert c.put(k, v) is True
                picks = [rnd.choice(pool) for _ in range(4)]
                check(picks, c.get_batch(picks))
                one = rnd.choice(pool)
                check([one], [c.get(one)])
                buf = bytearray(MAX_VALUE)
                n = c.get_into(one, buf)
                check([one], [None if n is None else bytes(buf[:n])])

        run_together(THREADS, work)
        with Client(small.addr, transport="grpc") as c:
            s = c.stats()["tiers"]["dram"]
            assert s["evictions"] > 0
            assert s["used"] <= s["capacity"]
            keys = list(written)
            check(keys, c.get_batch(keys))
        assert outcome["hits"] > 0 and outcome["misses"] > 0
    finally:
        assert small.stop() == 0, small.output()


@pytest.mark.parametrize(("transport", "shared"), VARIANTS)
def test_same_key_from_many_threads_stores_once(node: NodeProcess, transport: str,
                                                shared: bool,
                                                clients_for: Callable[..., Clients]) -> None:
    writers = 6
    clients = clients_for(node.addr, transport, shared, writers)
    rounds = 4 if transport == "grpc" else 12
    for r in range(rounds):
        k = os.urandom(16)
        size = (1 << 20) + r * 4099  # large enough for the puts to overlap
        values = [os.urandom(size) for _ in range(writers)]  # each thread its own bytes
        results: list[bool | None] = [None] * writers

        def work(i: int, k: bytes = k, values: list[bytes] = values,
                 results: list[bool | None] = results) -> None:
            results[i] = clients[i].put(k, values[i])

        run_together(writers, work)
        assert results.count(True) == 1, results
        assert results.count(False) == writers - 1, results
        winner = results.index(True)
        for i in range(writers):
            assert clients[i].get(k) == values[winner]
    with Client(node.addr, transport="grpc") as c:
        s = c.stats()["tiers"]["dram"]
        assert s["blocks"] == rounds  # the losers' space went back
        assert s["used"] == sum(-(-((1 << 20) + r * 4099) // 64) * 64 for r in range(rounds))
