"""The Conductor in front of real processes: a kvstore node, workers, ``conductor serve``."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import REPO

from conductor.live.local import LocalServing, Proc, free_port
from conductor.live.service import ConductorClient
from workers.model import PRESETS, LlamaModel


@pytest.fixture(scope="module")
def serving(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalServing]:
    s = LocalServing.up(tmp_path_factory.mktemp("serving"), prefill=2, decode=1, model="tiny",
                        dram="128MiB")
    try:
        yield s
    finally:
        codes = s.stop()
    assert set(codes.values()) == {0}, {p.name: p.output()[-2000:] for p in s.processes()}


def _prompt(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(PRESETS["tiny"].vocab_size) for _ in range(n)]


def test_generate_matches_the_model_and_reuses_the_cached_prefix(serving: LocalServing
                                                                 ) -> None:
    assert serving.conductor is not None
    client = ConductorClient(serving.conductor.addr, timeout=120)
    prompt = _prompt(200, 1)
    expected = LlamaModel.random(PRESETS["tiny"], 0).generate(prompt, 6)
    first = client.generate(prompt, 6)
    assert first["rejected"] is False and first["tokens"] == expected
    assert first["cached_tokens"] == 0 and first["prompt_tokens"] == 200
    again = client.generate(prompt + _prompt(20, 2), 6)  # same prefix, a new question
    assert again["cached_tokens"] == 192  # twelve full blocks of 16 (the 13th is partial)
    assert again["tokens"] == LlamaModel.random(PRESETS["tiny"], 0).generate(
        prompt + _prompt(20, 2), 6)
    # global cache-aware: the prefix is in the store, so either prefill worker can use it
    assert again["prefill"] in {p.addr for p in serving.prefill}
    cold = client.generate(prompt, 6, use_cache=False)
    assert cold["cached_tokens"] == 0 and cold["tokens"] == expected
    health = client.health()
    assert set(health["prefill"]) == {p.addr for p in serving.prefill}


def test_bad_requests_get_400(serving: LocalServing) -> None:
    assert serving.conductor is not None
    url = f"http://{serving.conductor.addr}/generate"
    for body in ({"token_ids": []}, {"token_ids": [1, -2]}, {"token_ids": [1], "max_new_tokens": 0},
                 {"token_ids": [1], "extra": 1}, [1, 2]):
        req = urllib.request.Request(url, data=json.dumps(body).encode(), method="POST")
        with pytest.raises(urllib.error.HTTPError) as err:
            urllib.request.urlopen(req, timeout=30)
        assert err.value.code == 400
        assert "error" in json.loads(err.value.read())


def test_a_request_that_cannot_meet_the_slo_is_rejected_at_once(serving: LocalServing,
                                                                tmp_path: Path) -> None:
    assert serving.store is not None
    addr = f"127.0.0.1:{free_port()}"
    log = tmp_path / "strict.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [sys.executable, "-m", "conductor", "serve", "--store", serving.store.addr,
             "--prefill", ",".join(p.addr for p in serving.prefill),
             "--decode", ",".join(p.addr for p in serving.decode), "--ttft-slo", "1ms",
             "--listen", addr], stdout=out, stderr=subprocess.STDOUT, cwd=REPO)
    try:
        LocalServing._wait(Proc(name="strict", addr=addr, proc=proc, log=log),
                           "conductor: serving on", 60)
        out_ = ConductorClient(addr, timeout=60).generate(_prompt(300, 5), 4)
        assert out_["rejected"] is True and out_["reason"].startswith("TTFT ")
        assert "SLO 0.00 s" in out_["reason"]
        health = ConductorClient(addr).health()
        assert all(w["requests_done"] >= 0 for w in health["prefill"].values())
    finally:
        proc.terminate()
        assert proc.wait(30) == 0, log.read_text()


def test_serve_with_an_unreachable_worker_fails_in_one_line() -> None:
    out = subprocess.run([sys.executable, "-m", "conductor", "serve", "--store",
                          "127.0.0.1:1", "--prefill", "127.0.0.1:1", "--decode", "127.0.0.1:1",
                          "--listen", f"127.0.0.1:{free_port()}"], capture_output=True,
                         text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1 and "Traceback" not in out.stderr
    assert out.stderr.startswith("conductor serve: error:")


def test_serving_demo_runs_end_to_end() -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore", "demo", "serving", "--model", "tiny",
                          "--max-new-tokens", "4"], capture_output=True, text=True, cwd=REPO,
                         timeout=300)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
    assert "with the store as the KV cache" in out.stdout
    assert "generated tokens identical with and without the cache: True" in out.stdout
    cached = [int(line.split()[-7]) for line in out.stdout.splitlines()
              if line.strip().startswith(("2 ", "5 ")) and "doc A" in line]
    assert cached and all(c > 0 for c in cached[: len(cached) // 2])  # doc A reused


def test_the_conductor_imports_no_torch() -> None:
    """The Conductor names last layers with kvstore.core.keys.layer_key: it runs without torch."""
    code = ("import sys, conductor.live.runner, conductor.cli, conductor.live.service;"
            "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('workers.')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, cwd=REPO).stdout.strip()
    assert out == "['workers.client']"
