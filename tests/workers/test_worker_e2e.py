"""End to end with real processes: a kvstore node, a prefill and a decode worker process."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from conftest import REPO, NodeProcess, free_port, start_node, wait_until

from kvstore import Client
from workers.client import WorkerClient, WorkerError, generate
from workers.kv_blocks import layer_key
from workers.model import PRESETS, LlamaModel

SEED = 7
B = 16


@dataclass(slots=True, kw_only=True)
class WorkerProcess(NodeProcess):
    """A worker process started for a test (``stop``/``output`` as for a node)."""

    role: str


def spawn_worker(tmp_path: Path, role: str, store: str, *extra: str) -> WorkerProcess:
    port = free_port()
    log = tmp_path / f"{role}-{port}.log"
    args = [sys.executable, "-m", "workers", role, "--store", store,
            "--listen", f"127.0.0.1:{port}", "--model-config", "tiny", "--seed", str(SEED),
            "--block-tokens", str(B), "--threads", "1", *extra]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    return WorkerProcess(addr=f"127.0.0.1:{port}", proc=proc, log=log, role=role)


def wait_ready(w: WorkerProcess, ready_timeout: float = 60.0) -> WorkerProcess:
    role, proc = w.role, w.proc
    deadline = time.monotonic() + ready_timeout
    ready = f"workers: {role} serving on {w.addr}"
    while ready not in w.output():
        if proc.poll() is not None:
            raise RuntimeError(f"{role} worker exited with {proc.returncode}:\n{w.output()}")
        if time.monotonic() > deadline:
            w.stop(signal.SIGKILL)
            raise RuntimeError(f"{role} worker not ready in {ready_timeout}s:\n{w.output()}")
        time.sleep(0.05)
    return w


@dataclass(slots=True, kw_only=True)
class Cluster:
    node: NodeProcess
    prefill: WorkerProcess
    decode: WorkerProcess
    pc: WorkerClient
    dc: WorkerClient


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    tmp = tmp_path_factory.mktemp("workers")
    node = start_node(tmp, dram="128MiB")
    procs: list[WorkerProcess] = []
    try:
        procs.append(spawn_worker(tmp, "prefill", node.addr))
        procs.append(spawn_worker(tmp, "decode", node.addr, "--max-batch", "4"))
        for w in procs:
            wait_ready(w)
        yield Cluster(node=node, prefill=procs[0], decode=procs[1],
                      pc=WorkerClient(procs[0].addr, timeout=60),
                      dc=WorkerClient(procs[1].addr, timeout=60))
    finally:
        codes = [(w.stop(), w.output()) for w in procs]
        node_code = node.stop()
    for code, out in codes:
        assert code == 0, out
        assert "stopped" in out
    assert node_code == 0, node.output()


@pytest.fixture(scope="module")
def reference() -> LlamaModel:
    return LlamaModel.random(PRESETS["tiny"], seed=SEED)


def prompt(seed: int, n: int) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, PRESETS["tiny"].vocab_size, (n,), generator=g).tolist()


def test_same_prompt_twice_hits_the_cache_with_the_same_tokens(
        cluster: Cluster, reference: LlamaModel) -> None:
    p = prompt(1, 203)
    want = reference.generate(p, 16)
    first = generate(cluster.pc, cluster.dc, p, 16)
    second = generate(cluster.pc, cluster.dc, p, 16)
    assert first["prefill"]["cached_tokens"] == 0
    assert second["prefill"]["cached_tokens"] == 192
    assert second["prefill"]["computed_tokens"] == 11
    assert first["tokens"] == second["tokens"] == want
    for r in (first, second):
        assert r["decode"]["fetched_tokens"] == 203 and r["decode"]["recomputed_tokens"] == 0
        assert len(r["tbt_s"]) == 15 and r["decode"]["mean_tbt_s"] > 0
    assert len(second["prefill"]["keys"]) == 12 and len(second["prefill"]["keys"][0]) == 32


def test_corrupting_a_stored_block_changes_the_output(
        cluster: Cluster, reference: LlamaModel) -> None:
    p = prompt(2, 120)
    want = reference.generate(p, 12)
    cold = generate(cluster.pc, cluster.dc, p, 12)
    assert cold["tokens"] == want
    g = torch.Generator().manual_seed(1)
    with Client(cluster.node.addr) as store:
        for key_hex in cold["prefill"]["keys"][:3]:
            for layer in range(PRESETS["tiny"].n_layers):
                lk = layer_key(bytes.fromhex(key_hex), layer)
                size = len(store.get(lk) or b"")
                assert size > 0 and store.remove(lk)
                assert store.put(lk, (torch.randn(size // 4, generator=g) * 4).numpy())
    bad = generate(cluster.pc, cluster.dc, p, 12)
    assert bad["prefill"]["cached_tokens"] == 112
    assert bad["tokens"] != want


def test_concurrent_requests_are_batched_and_exact(
        cluster: Cluster, reference: LlamaModel) -> None:
    prompts = [prompt(10 + i, 40 + 17 * i) for i in range(4)]
    out: dict[int, Any] = {}

    def run(i: int) -> None:
        out[i] = generate(cluster.pc, cluster.dc, prompts[i], 24)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for i, p in enumerate(prompts):
        assert out[i]["tokens"] == reference.generate(p, 24)
    health = cluster.dc.health()
    assert health["requests_done"] >= 4 and health["max_batch"] == 4


def test_health_reports_load(cluster: Cluster) -> None:
    cluster.pc.prefill(prompt(3, 50))
    ph, dh = cluster.pc.health(), cluster.dc.health()
    assert ph["ok"] and ph["role"] == "prefill" and ph["queued"] == 0 and ph["active"] == 0
    assert ph["tokens_per_s"] > 0 and ph["compute_tokens_per_s"] > 0
    assert dh["ok"] and dh["role"] == "decode" and dh["active"] == 0
    assert ph["namespace"] == dh["namespace"] and "/B16" in ph["namespace"]


def _post(addr: str, path: str, data: bytes, method: str = "POST") -> tuple[int, dict]:
    req = urllib.request.Request(f"http://{addr}{path}", data=data, method=method,
                                 headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=30) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as exc:
        return exc.code, json.loads(exc.read())


def test_prefill_puts_its_full_blocks_with_the_retention_asked(cluster: Cluster) -> None:
    with Client(cluster.node.addr) as store:
        def retained() -> int:
            return int(store.stats()["node"]["retained_blocks"])

        before = retained()
        plain = cluster.pc.prefill(prompt(21, 40))  # 2 full blocks and a tail, no retain_s
        assert plain["written_blocks"] == 2
        assert retained() == before
        kept = cluster.pc.prefill(prompt(22, 40), request_id="kept", retain_s=60.0)
        assert kept["written_blocks"] == 2
        layers = PRESETS["tiny"].n_layers
        assert retained() == before + 2 * layers  # every layer of the full blocks, no tail
        # A later prompt extending it writes only its new block, retained as well.
        longer = cluster.pc.prefill(prompt(22, 40)[:32] + prompt(23, 20), retain_s=60.0)
        assert (longer["cached_tokens"], longer["written_blocks"]) == (32, 1)
        assert retained() == before + 3 * layers


@pytest.mark.parametrize(("path", "body", "status", "message"), [
    ("/prefill", b"{not json", 400, "not JSON"),
    ("/prefill", b"[1, 2]", 400, "JSON object"),
    ("/prefill", b"{}", 400, "token_ids must be a non-empty list"),
    ("/prefill", b'{"token_ids": []}', 400, "token_ids must be a non-empty list"),
    ("/prefill", b'{"token_ids": [1, "2"]}', 400, "must hold integers"),
    ("/prefill", b'{"token_ids": [1, true]}', 400, "must hold integers"),
    ("/prefill", b'{"token_ids": [1, 512]}', 400, "token ids must be integers in [0, 512)"),
    ("/prefill", b'{"token_ids": [1], "request_id": 5}', 400, "request_id"),
    ("/prefill", b'{"token_ids": [1], "extra": 1}', 400, "unknown fields: extra"),
    ("/prefill", b'{"token_ids": [1], "retain_s": -1}', 400, "retain_s must be finite"),
    ("/prefill", b'{"token_ids": [1], "retain_s": "60"}', 400, "retain_s must be a number"),
    ("/prefill", b'{"token_ids": [1], "retain_s": 604801}', 400, "over the limit"),
    ("/decode", b'{"token_ids": [1]}', 404, "on a prefill worker"),
    ("/nope", b"{}", 404, "no endpoint /nope"),
    ("/health", b"{}", 405, "takes GET"),
])
def test_prefill_rejects_bad_input(cluster: Cluster, path: str, body: bytes, status: int,
                                   message: str) -> None:
    code, payload = _post(cluster.prefill.addr, path, body)
    assert code == status
    assert message in payload["error"]


@pytest.mark.parametrize(("body", "message"), [
    ({"token_ids": [1, 2], "max_new_tokens": 3}, "first_token must be an integer"),
    ({"token_ids": [1, 2], "first_token": 3}, "max_new_tokens must be a positive integer"),
    ({"token_ids": [1, 2], "first_token": 3, "max_new_tokens": 0}, "max_new_tokens"),
    ({"token_ids": [1, 2], "first_token": 600, "max_new_tokens": 2}, "[0, 512)"),
    ({"token_ids": [1, 2], "first_token": 3, "max_new_tokens": 1024}, "max_seq_len 1024"),
    ({"token_ids": [1, 2], "first_token": 3, "max_new_tokens": 2, "stop_token_ids": 4},
     "stop_token_ids"),
])
def test_decode_rejects_bad_input(cluster: Cluster, body: dict, message: str) -> None:
    with pytest.raises(WorkerError) as info:
        cluster.dc._call("POST", "/decode", body)
    assert info.value.status == 400
    assert message in info.value.message


def test_decode_stop_tokens_and_single_token(cluster: Cluster, reference: LlamaModel) -> None:
    p = prompt(4, 30)
    want = reference.generate(p, 10)
    r = cluster.pc.prefill(p, request_id="stop-1")
    d = cluster.dc.decode(p, r["first_token"], 10, request_id="stop-1",
                          stop_token_ids=[want[3]])
    assert d["tokens"] == want[: want.index(want[3]) + 1]
    one = cluster.dc.decode(p, r["first_token"], 1)
    assert one["tokens"] == [want[0]] and one["tbt_s"] == []


def test_sigterm_finishes_the_request_in_flight(tmp_path: Path, cluster: Cluster,
                                                reference: LlamaModel) -> None:
    dec = wait_ready(spawn_worker(tmp_path, "decode", cluster.node.addr))
    client = WorkerClient(dec.addr, timeout=60)
    p = prompt(5, 40)
    result: dict[str, Any] = {}

    def run() -> None:
        result["d"] = client.decode(p, reference.generate(p, 1)[0], 600)

    t = threading.Thread(target=run)
    t.start()
    try:
        wait_until(lambda: client.health()["active"] == 1, 30, "the request to start")
    finally:
        code = dec.stop()
        t.join(60)
    assert code == 0, dec.output()
    assert len(result["d"]["tokens"]) == 600
    with pytest.raises(WorkerError) as info:
        client.health()
    assert info.value.status == 0  # nobody listens any more


def test_startup_errors_exit_2(tmp_path: Path, cluster: Cluster) -> None:
    dead = f"127.0.0.1:{free_port()}"
    r = subprocess.run([sys.executable, "-m", "workers", "prefill", "--store", dead,
                        "--model-config", "tiny"], capture_output=True, text=True, cwd=REPO,
                       timeout=120)
    assert r.returncode == 2 and f"store {dead}" in r.stderr
    r = subprocess.run([sys.executable, "-m", "workers", "decode", "--store", cluster.node.addr,
                        "--model-config", str(tmp_path / "missing")], capture_output=True,
                       text=True, cwd=REPO, timeout=120)
    assert r.returncode == 2 and "not a preset" in r.stderr
