"""Sessions end to end over HTTP: the live Conductor's service in process, toy worker
processes, and an in-process kvstore node sharing the test's clock with the Conductor, so
retention deadlines and idle expiry are exact. Shows retain at turn end, the prefetch on
arrival, affinity to the previous prefill worker, ``DELETE /v1/sessions/{id}``, idle
expiry, and that the node's retention cap still applies."""

from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from conftest import REPO

from conductor.front.session_cache import SESSION_HEADER
from conductor.live.local import Proc, free_port
from conductor.live.runner import LiveConductor
from conductor.live.service import ConductorClient, ConductorService
from conductor.scheduling.types import Slo
from kvstore.node.semantics import Node, NodeSettings
from kvstore.server import NodeServer
from workers.model import PRESETS

TTL = 60.0
BLOCK_TOKENS = 16
LAYERS = PRESETS["tiny"].n_layers
DRAM = 8 << 20
FRACTION = 0.02  # the node retains at most 2% of 8 MiB: 40 of the tiny model's objects


class Clock:
    def __init__(self) -> None:
        self.now = 10_000.0

    def __call__(self) -> float:
        return self.now


@dataclass(slots=True, kw_only=True)
class Setup:
    clock: Clock
    node: Node
    live: LiveConductor
    service: ConductorService
    client: ConductorClient
    workers: list[Proc]

    def node_stats(self) -> dict[str, Any]:
        return self.node.stats()["node"]

    def cache(self) -> dict[str, Any]:
        return self.client.health()["session_cache"]


def _worker(role: str, store: str, directory: Path) -> Proc:
    addr = f"127.0.0.1:{free_port()}"
    log = directory / f"{role}-{addr.rsplit(':', 1)[1]}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "workers", role, "--store", store, "--model-config", "tiny",
             "--seed", "0", "--block-tokens", str(BLOCK_TOKENS), "--threads", "1",
             "--listen", addr], stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
            stdin=subprocess.DEVNULL, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return Proc(name=role, addr=addr, proc=proc, log=log)


def _ready(p: Proc) -> None:
    import time

    deadline = time.monotonic() + 120
    while "serving on" not in p.output():
        assert p.proc.poll() is None, p.output()
        assert time.monotonic() < deadline, p.output()
        time.sleep(0.05)  # another process's start-up: no barrier reaches it


@pytest.fixture(scope="module")
def setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Setup]:
    directory = tmp_path_factory.mktemp("sessions")
    clock = Clock()
    node = Node(NodeSettings(dram_bytes=DRAM, prefault=False,
                             max_retained_fraction=FRACTION), clock=clock)
    server = NodeServer(node, listen=f"127.0.0.1:{free_port()}", grpc_workers=8)
    server.start()
    store = server.addresses.grpc
    workers = [_worker(r, store, directory) for r in ("prefill", "prefill", "decode")]
    service = None
    from kvstore import Client

    c = Client(store, transport="grpc")
    try:
        for w in workers:
            _ready(w)
        live = LiveConductor(store=c, prefill=[w.addr for w in workers[:2]],
                             decode=[workers[2].addr], slo=Slo(ttft_s=30.0, tbt_s=1.0),
                             clock=clock, session_ttl_s=TTL)
        service = ConductorService(live, listen="127.0.0.1:0")
        service.start()
        yield Setup(clock=clock, node=node, live=live, service=service,
                    client=ConductorClient(service.addr, timeout=120), workers=workers)
    finally:
        if service is not None:
            service.stop()
        for w in workers:
            w.proc.terminate()
        codes = [w.proc.wait(30) for w in workers]
        c.close()
        server.stop(grace=1.0)
        node.close()
    assert codes == [0, 0, 0], [w.output()[-2000:] for w in workers]


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PRESETS["tiny"].vocab_size) for _ in range(n)]


def _post(setup: Setup, body: dict[str, Any], headers: dict[str, str]) -> dict[str, Any]:
    req = urllib.request.Request(f"http://{setup.service.addr}/generate",
                                 data=json.dumps(body).encode(), method="POST",
                                 headers={"Content-Type": "application/json", **headers})
    with urllib.request.urlopen(req, timeout=120) as resp:
        return json.loads(resp.read())


def _delete(setup: Setup, session: str) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://{setup.service.addr}/v1/sessions/{session}",
                                 method="DELETE")
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_turns_are_retained_prefetched_routed_back_and_deleted(setup: Setup) -> None:
    before = setup.cache()
    p1 = _prompt(100, 1)  # 6 full blocks: 12 objects (one per block and layer)
    t1 = setup.client.generate(p1, 4, session="chat-1")
    assert t1["rejected"] is False
    assert t1["session"] == {"id": "chat-1", "previous_prefill": None, "prefetched_keys": 0}
    st = setup.node_stats()
    assert st["retained_blocks"] == 6 * LAYERS
    p2 = p1 + t1["tokens"] + _prompt(40, 2)  # the next turn extends the conversation
    t2 = _post(setup, {"token_ids": p2, "max_new_tokens": 4}, {SESSION_HEADER: "chat-1"})
    assert t2["session"] == {"id": "chat-1", "previous_prefill": t1["prefill"],
                             "prefetched_keys": 6 * LAYERS}  # the first turn's blocks
    assert t2["prefill"] == t1["prefill"]  # its worker met the SLO: affinity held
    assert t2["cached_tokens"] == 6 * BLOCK_TOKENS
    assert setup.node_stats()["retained_blocks"] == (len(p2) // BLOCK_TOKENS) * LAYERS
    cache = setup.cache()
    assert cache["turns"] - before["turns"] == 2
    assert cache["prefetch_calls"] - before["prefetch_calls"] == 1
    assert cache["retained_keys"] - before["retained_keys"] == (6 + len(p2) // 16) * LAYERS
    assert cache["store_errors"] == 0
    assert _delete(setup, "chat-1") == (200, {"id": "chat-1", "object": "session.deleted",
                                              "deleted": True})
    assert setup.node_stats()["retained_blocks"] == 0
    code, body = _delete(setup, "chat-1")
    assert code == 404
    assert body["error"]["type"] == "not_found_error" and body["error"]["code"] == 404
    assert setup.client.delete_session("never-seen") is False


def test_an_idle_session_is_released_after_its_ttl(setup: Setup) -> None:
    t = setup.client.generate(_prompt(40, 3), 2, session="idle")  # 2 full blocks
    assert t["rejected"] is False
    assert setup.node_stats()["retained_blocks"] == 2 * LAYERS
    expired = setup.cache()["expired"]
    setup.clock.now += TTL - 0.001
    setup.live.session_cache.sweep()
    assert "idle" in setup.live.session_cache
    setup.clock.now += 0.001  # TTL after the turn ended: the sweep (or its thread) ends it
    setup.live.session_cache.sweep()
    assert "idle" not in setup.live.session_cache
    assert setup.cache()["expired"] == expired + 1
    assert setup.node_stats()["retained_blocks"] == 0
    assert setup.client.delete_session("idle") is True  # its worker is still remembered
    assert setup.client.delete_session("idle") is False


def test_the_nodes_retention_cap_still_applies(setup: Setup) -> None:
    st = setup.node_stats()
    cap, denied = st["retained_cap_bytes"], st["retention_denied"]
    before = setup.cache()
    t = setup.client.generate(_prompt(400, 4), 2, session="big")  # 25 blocks: 50 objects
    assert t["rejected"] is False
    st = setup.node_stats()
    assert 0 < st["retained_bytes"] <= cap
    assert st["retention_denied"] > denied
    after = setup.cache()
    new_denied = after["denied_keys"] - before["denied_keys"]
    # The same keys met the cap twice: at the prefill's puts (retained at write time) and
    # at the turn-end retain.
    assert new_denied == 10
    assert st["retention_denied"] - denied == 2 * new_denied
    assert after["retained_keys"] - before["retained_keys"] + new_denied == 25 * LAYERS
    assert setup.client.delete_session("big") is True
    assert setup.node_stats()["retained_blocks"] == 0


def test_a_bad_session_delete_path_is_a_404(setup: Setup) -> None:
    assert _delete(setup, "")[0] == 404
