"""``conductor serve`` in front of real vLLM OpenAI servers with KVStoreConnector.

Three vLLM servers for the module (started in parallel, ~1 min): ``P`` (kv_both) and
``D`` (kv_consumer) share namespace ``NS``; ``C`` (kv_both, namespace ``NS_C``) is the
colocated reference and the colocated mode's instance. Fronts are real
``python -m conductor serve`` processes (cheap to start). The test that kills ``D``
runs last (file order).
"""

from __future__ import annotations

import json
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import Response

from conductor.front.vllm_instances import parse_metrics
from conductor.front.vllm_procs import Proc, start_conductor, start_vllm, wait_ready
from kvstore import Client, block_keys

pytestmark = pytest.mark.timeout(900)

BLOCK = 32
NS = f"cond-test-{time.time_ns()}"
NS_C = NS + "-colocated"


def prompt(seed: int, n: int = 200) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 500, n)]


def loadable(n: int) -> int:
    """Prompt tokens a kv_consumer loads: whole blocks, leaving the last token."""
    return (n - 1) // BLOCK * BLOCK


@pytest.fixture(scope="module")
def servers(tiny_llama: Path, store_node: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    procs = {
        "P": start_vllm(sys.executable, tiny_llama, logs, name="P", store=store_node.addr,
                        namespace=NS, role="kv_both", max_model_len=512),
        "D": start_vllm(sys.executable, tiny_llama, logs, name="D", store=store_node.addr,
                        namespace=NS, role="kv_consumer", max_model_len=512),
        "C": start_vllm(sys.executable, tiny_llama, logs, name="C", store=store_node.addr,
                        namespace=NS_C, role="kv_both", max_model_len=512),
    }
    try:
        for p in procs.values():
            wait_ready(p, "/v1/models", 400)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def front(servers: dict[str, Proc], store: str, logs: Path, name: str, *extra: str,
          colocated: bool = False) -> Proc:
    """Disaggregated fronts learn the namespace and block size from the instances;
    colocated ones are also given both (flags that agree are accepted)."""
    inst = (["--vllm", servers["C"].url, "--kv-namespace", NS_C, "--block-tokens",
             str(BLOCK)] if colocated else
            ["--vllm-prefill", servers["P"].url, "--vllm-decode", servers["D"].url])
    return start_conductor(logs, name=name, args=["--store", store, *inst, *extra])


@pytest.fixture(scope="module")
def disagg(servers: dict[str, Proc], store_node: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    p = front(servers, store_node.addr, tmp_path_factory.mktemp("front"), "disagg",
              "--durable-timeout", "20s", "--ttft-slo", "60s", "--tbt-slo", "5s")
    yield p
    assert p.stop() == 0, p.output()


@pytest.fixture(scope="module")
def colocated(servers: dict[str, Proc], store_node: Any,
              tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    p = front(servers, store_node.addr, tmp_path_factory.mktemp("front"), "colocated",
              "--ttft-slo", "60s", "--tbt-slo", "5s", colocated=True)
    yield p
    assert p.stop() == 0, p.output()


def complete(url: str, tokens: list[int], max_tokens: int, **extra: Any) -> httpx.Response:
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, **extra}
    return httpx.post(url + "/v1/completions", json=body, timeout=120)


def reference(c: Proc, tokens: list[int], max_tokens: int) -> list[int]:
    """Greedy tokens of a single colocated vLLM (C), asked directly."""
    r = complete(c.url, tokens, max_tokens, model=model_of(c))
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def model_of(p: Proc) -> str:
    return httpx.get(p.url + "/v1/models", timeout=10).json()["data"][0]["id"]


def streamed(url: str, tokens: list[int], max_tokens: int) -> tuple[list[int], list[dict]]:
    ids: list[int] = []
    events: list[dict] = []
    body = {"prompt": tokens, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "return_token_ids": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            events.append(ev)
            if "choices" in ev:
                ids += ev["choices"][0].get("token_ids") or []
    return ids, events


def vllm_metric(p: Proc, name: str) -> float:
    text = httpx.get(p.url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith(name + "{") or line.startswith(name + " "))


def front_metric(p: Proc, line_prefix: str) -> float:
    text = httpx.get(p.url + "/metrics", timeout=10).text
    vals = [float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
            if line.startswith(line_prefix)]
    return sum(vals)


HITS = "vllm:external_prefix_cache_hits_total"


def test_models_health_metrics(disagg: Proc, servers: dict[str, Proc]) -> None:
    models = httpx.get(disagg.url + "/v1/models", timeout=10).json()
    assert models["data"][0]["id"] == model_of(servers["P"])
    assert models["data"][0]["max_model_len"] == 512
    h = httpx.get(disagg.url + "/health", timeout=10)
    assert h.status_code == 200, h.text
    assert h.json()["status"] == "ok"
    assert h.json()["mode"] == "disaggregated"
    assert set(h.json()["instances"]) == {servers["P"].url, servers["D"].url}
    m = httpx.get(disagg.url + "/metrics", timeout=10)
    assert m.status_code == 200
    assert "conductor_ttft_seconds_bucket" in m.text


def test_disaggregated_tokens_equal_colocated_and_decode_loads_prefix(
        disagg: Proc, servers: dict[str, Proc]) -> None:
    tokens = prompt(1)
    want = reference(servers["C"], tokens, 12)
    hits0 = vllm_metric(servers["D"], HITS)
    r = complete(disagg.url, tokens, 12)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    # D (kv_consumer) computed only the last partial block: the rest came from the store.
    assert vllm_metric(servers["D"], HITS) - hits0 == loadable(len(tokens))
    p_url, d_url = servers["P"].url, servers["D"].url
    assert front_metric(disagg, f'conductor_instance_chosen_total{{instance="{p_url}"'
                        ) >= 1
    assert front_metric(disagg, f'conductor_instance_chosen_total{{instance="{d_url}"'
                        ) >= 1


def test_disaggregated_stream_passes_tokens_through(disagg: Proc,
                                                    servers: dict[str, Proc]) -> None:
    tokens = prompt(2, 170)
    want = reference(servers["C"], tokens, 10)
    hits0 = vllm_metric(servers["D"], HITS)
    ids, events = streamed(disagg.url, tokens, 10)
    assert ids == want
    # several events, not one buffered answer (vLLM may put two tokens in one event when
    # its output loop lags, so not necessarily one per token)
    assert len(events) >= 3
    assert vllm_metric(servers["D"], HITS) - hits0 == loadable(len(tokens))
    assert front_metric(disagg, "conductor_ttft_seconds_count") >= 1


def test_second_turn_finds_the_first_in_the_store(disagg: Proc,
                                                  servers: dict[str, Proc]) -> None:
    first = prompt(3, 130)
    r = complete(disagg.url, first, 4)
    assert r.status_code == 200, r.text
    found0 = front_metric(disagg, "conductor_prefix_tokens_found_total")
    second = first + r.json()["choices"][0]["token_ids"] + prompt(33, 60)
    want = reference(servers["C"], second, 6)
    r2 = complete(disagg.url, second, 6)
    assert r2.json()["choices"][0]["token_ids"] == want
    # the first turn's 4 full blocks were in the store when the second turn arrived
    assert front_metric(disagg, "conductor_prefix_tokens_found_total") - found0 == 128


def test_colocated_tokens_equal_and_store_prefix_reused(colocated: Proc,
                                                        servers: dict[str, Proc]) -> None:
    tokens = prompt(4)
    want = reference(servers["C"], tokens, 12)  # C saves the prompt's blocks (NS_C)
    r = complete(colocated.url, tokens, 12)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["token_ids"] == want
    ids, _ = streamed(colocated.url, tokens, 12)
    assert ids == want
    assert front_metric(colocated, "conductor_prefix_tokens_found_total") >= \
        len(tokens) // BLOCK * BLOCK
    # The front counts each instance's KV cache (vLLM's own figure) and, every request
    # over, holds none of it (a stream's end is counted just after its last chunk).
    deadline = time.monotonic() + 30
    while True:
        instances = httpx.get(colocated.url + "/health", timeout=10).json()["instances"]
        if not any((i["kv_room"] or {}).get("requests") for i in instances.values()):
            break
        assert time.monotonic() < deadline, instances
        time.sleep(0.05)  # another process's background work: no barrier reaches it
    for url, seen in instances.items():
        shape = parse_metrics(httpx.get(url + "/metrics", timeout=10).text)
        (labels, _), = shape["vllm:cache_config_info"]
        kv_tokens = int(labels["num_gpu_blocks"]) * int(labels["block_size"])
        assert seen["kv_room"] == {"capacity_blocks": kv_tokens // BLOCK, "held_blocks": 0,
                                   "requests": 0}


def _session_cache(front: Proc) -> dict[str, Any]:
    return httpx.get(front.url + "/health", timeout=10).json()["session_cache"]


def _after_turns(front: Proc, turns: int) -> dict[str, Any]:
    """The front's session counts once ``turns`` turns ended (a turn's blocks are retained
    in the background after its answer was sent)."""
    deadline = time.monotonic() + 30
    while (got := _session_cache(front))["turns"] < turns:
        assert time.monotonic() < deadline, got
        time.sleep(0.05)  # another process's background work: no barrier reaches it
    return got


def test_sessions_keep_their_blocks_between_turns_until_deleted(
        disagg: Proc, colocated: Proc, store_node: Any) -> None:
    """``--session-ttl`` is on by default (300 s): a turn's blocks are retained at its end,
    the next turn of the session prefetches them, DELETE releases them."""
    def retained() -> int:
        with Client(store_node.addr) as c:
            return int(c.stats()["node"]["retained_blocks"])

    base, before = retained(), _session_cache(disagg)
    first = prompt(41, 130)  # 4 full blocks of 32
    r = complete(disagg.url, first, 4, session_id="agent-1")  # the field names it
    assert r.status_code == 200, r.text
    after = _after_turns(disagg, before["turns"] + 1)
    assert after["retained_keys"] - before["retained_keys"] == 4
    assert retained() == base + 4
    second = first + r.json()["choices"][0]["token_ids"] + prompt(42, 60)  # 6 blocks
    r = httpx.post(disagg.url + "/v1/completions", timeout=120,
                   headers={"X-Session-Affinity": "agent-1"},
                   json={"prompt": second, "max_tokens": 4, "temperature": 0})
    assert r.status_code == 200, r.text
    after = _after_turns(disagg, before["turns"] + 2)
    assert after["prefetched_keys"] - before["prefetched_keys"] == 4  # the first turn's
    assert after["store_errors"] == 0
    assert retained() == base + 6
    gone = httpx.delete(disagg.url + "/v1/sessions/agent-1", timeout=10)
    assert gone.json() == {"id": "agent-1", "object": "session.deleted", "deleted": True}
    assert retained() == base
    again = httpx.delete(disagg.url + "/v1/sessions/agent-1", timeout=10)
    assert again.status_code == 404 and again.json()["error"]["type"] == "not_found_error"
    # Colocated: the instance saves the blocks retained as it runs (the front passes the
    # TTL in kv_transfer_params); the front's turn-end retain refreshes the ones already in
    # without waiting for the rest (those not stored yet count as missing there).
    before = _session_cache(colocated)
    r = complete(colocated.url, prompt(43, 100), 4, session_id="agent-2")  # 3 blocks
    assert r.status_code == 200, r.text
    after = _after_turns(colocated, before["turns"] + 1)
    assert (after["retained_keys"] - before["retained_keys"]
            + after["missing_keys"] - before["missing_keys"]) == 3
    deadline = time.monotonic() + 30
    while retained() != base + 3:  # the connector's saves finish after the answer
        assert time.monotonic() < deadline, retained()
        time.sleep(0.05)  # another process's background work: no barrier reaches it
    assert httpx.delete(colocated.url + "/v1/sessions/agent-2", timeout=10).status_code == 200
    assert retained() == base


def test_bad_requests_get_400(disagg: Proc) -> None:
    r = httpx.post(disagg.url + "/v1/completions", content=b"{not json", timeout=10)
    assert r.status_code == 400
    assert r.json()["error"]["type"] == "invalid_request_error"
    r = complete(disagg.url, [1, 2, 3], 0)
    assert r.status_code == 400
    assert "max_tokens" in r.json()["error"]["message"]
    r = httpx.post(disagg.url + "/v1/completions", json={"prompt": "hello"}, timeout=10)
    assert r.status_code == 400
    assert "--tokenizer" in r.json()["error"]["message"]
    r = complete(disagg.url, prompt(5, 500), 100)
    assert r.status_code == 400
    assert "max_model_len 512" in r.json()["error"]["message"]


def test_overload_is_rejected_with_429_and_reason(servers: dict[str, Proc], store_node: Any,
                                                  tmp_path: Path) -> None:
    # A TTFT SLO no prefill can meet: the scheduler's estimate rejects at arrival.
    p = front(servers, store_node.addr, tmp_path, "reject", "--ttft-slo", "1us")
    try:
        hits0 = vllm_metric(servers["D"], "vllm:request_success_total")
        r = complete(p.url, prompt(6), 8)
        assert r.status_code == 429, r.text
        err = r.json()["error"]
        assert err["code"] == 429
        assert err["reason"].startswith("TTFT ")
        assert err["reason"].endswith("> SLO 0.00 s")
        assert front_metric(p, 'conductor_rejections_total{reason="ttft_slo"}') == 1
        assert front_metric(p, 'conductor_requests_total{outcome="rejected"') == 1
        # nothing reached an instance
        assert vllm_metric(servers["D"], "vllm:request_success_total") == hits0
    finally:
        assert p.stop() == 0, p.output()


def test_decode_is_asked_only_once_the_blocks_are_stored(servers: dict[str, Proc],
                                                         store_node: Any,
                                                         tmp_path: Path) -> None:
    """Step 3's ordering, checked where it matters: a recording proxy in front of D asks
    the store, when each decode request arrives, whether every full block of its prompt
    is there. A front that asked decode before the prefill's saves landed fails this. The
    request also tells the decode instance's connector so (``kvstore_stored_blocks``:
    every full block), so the instance does not ask the store itself."""
    import uvicorn

    seen: list[tuple[int, int]] = []
    hinted: list[int | None] = []
    app = FastAPI()
    upstream = servers["D"].url
    client = Client(store_node.addr)

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(path: str, request: Request) -> Response:
        raw = await request.body()
        body = json.loads(raw) if raw else {}
        # the start-up's connector description request is not a decode
        describe = (body.get("kv_transfer_params") or {}).get("kvstore_describe")
        if path == "v1/completions" and not describe:
            keys = block_keys(body["prompt"], BLOCK, NS)
            seen.append((client.prefix_match(keys), len(keys)))
            hinted.append((body.get("kv_transfer_params") or {}).get("kvstore_stored_blocks"))
        async with httpx.AsyncClient() as h:
            r = await h.request(request.method, f"{upstream}/{path}", content=raw,
                                headers={"content-type": "application/json"}, timeout=120)
        return Response(r.content, status_code=r.status_code,
                        media_type=r.headers.get("content-type"))

    from conductor.front.vllm_procs import free_port

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port,
                                           log_level="warning", lifespan="off"))
    t = threading.Thread(target=server.run, daemon=True)
    t.start()
    try:
        while not server.started:
            assert t.is_alive()
            time.sleep(0.01)
        proxied = {**servers, "D": Proc(name="D-proxy", proc=servers["D"].proc,
                                        log=servers["D"].log, url=f"http://127.0.0.1:{port}")}
        p = front(proxied, store_node.addr, tmp_path, "ordered", "--ttft-slo", "60s",
                  "--tbt-slo", "5s")
        try:
            for seed in range(10, 16):  # fresh prompts: nothing stored before their prefill
                tokens = prompt(seed, 100 + 20 * (seed - 10))
                r = complete(p.url, tokens, 2)
                assert r.status_code == 200, r.text
        finally:
            assert p.stop() == 0, p.output()
        assert len(seen) == 6
        assert all(found == want and want >= 3 for found, want in seen), seen
        assert hinted == [want for _, want in seen]
    finally:
        server.should_exit = True
        t.join(10)
        client.close()


def test_blocks_that_never_arrive_end_in_504_without_asking_decode(
        servers: dict[str, Proc], store_node: Any, tmp_path: Path) -> None:
    """A front whose store is not the connectors' (another node; the start-up probe is
    skipped by starting the front in-process) waits its bound and answers 504; decode is
    never asked."""
    import asyncio

    from conftest import start_node

    from conductor.front.http_front import serve
    from conductor.front.store_view import StoreView
    from conductor.front.vllm_front import FrontConfig, VllmFront
    from conductor.front.vllm_procs import free_port
    from conductor.scheduling.types import Slo

    other = start_node(tmp_path, dram="64MiB")
    store = Client(other.addr)
    cfg = FrontConfig(slo=Slo(ttft_s=60, tbt_s=5), durable_timeout_s=1.0)
    f = VllmFront(config=cfg, store=StoreView(store), prefill=[servers["P"].url],
                  decode=[servers["D"].url])
    port = free_port()
    ready = threading.Event()
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()

    def run() -> None:
        loop.run_until_complete(serve(f, host="127.0.0.1", port=port, codec=None, stop=stop,
                                      on_ready=lambda _: ready.set(), check_namespace=False))

    t = threading.Thread(target=run, daemon=True)
    t.start()
    try:
        assert ready.wait(60)
        before = vllm_metric(servers["D"], "vllm:request_success_total")
        r = complete(f"http://127.0.0.1:{port}", prompt(20), 4)
        assert r.status_code == 504, r.text
        msg = r.json()["error"]["message"]
        assert "not in the store within 1 s: 0 of 6 blocks stored" in msg
        assert f"none at all under namespace {NS!r}" in msg
        assert "--store / --etcd" in msg
        assert vllm_metric(servers["D"], "vllm:request_success_total") == before
    finally:
        loop.call_soon_threadsafe(stop.set)
        t.join(30)
        store.close()
        assert other.stop() == 0


def test_the_front_learns_the_namespace_and_refuses_disagreement(
        disagg: Proc, servers: dict[str, Proc], store_node: Any, tmp_path: Path) -> None:
    """The disaggregated front was given no namespace: it asked the connectors (the
    decode instance's too); instances that disagree, or a flag that disagrees with them,
    stop the start-up with a sentence naming both sides."""
    h = httpx.get(disagg.url + "/health", timeout=10).json()
    assert (h["namespace"], h["block_tokens"]) == (NS, BLOCK)
    p, c = servers["P"].url, servers["C"].url
    cases = [
        (["--vllm", f"{p},{c}"], f"instances disagree on the kvstore namespace: {p} has "
                                 f"{NS!r}, {c} has {NS_C!r}"),
        (["--vllm-prefill", p, "--vllm-decode", servers["D"].url, "--kv-namespace", "other"],
         f"--kv-namespace is 'other' but {p}'s connector uses namespace {NS!r}"),
        (["--vllm-prefill", servers["D"].url, "--vllm-decode", p],
         f"prefill instance {servers['D'].url} runs its connector with kv_role "
         f"'kv_consumer', which saves nothing"),
    ]
    for i, (args, message) in enumerate(cases):
        with pytest.raises(RuntimeError) as e:
            start_conductor(tmp_path, name=f"refused-{i}",
                            args=["--store", store_node.addr, *args])
        assert f"conductor serve: error: {message}" in str(e.value), str(e.value)


SPECIAL = {0: "<unk>", 1: "<s>", 2: "</s>", 500: "<|system|>", 501: "<|user|>",
           502: "<|assistant|>"}
WORDS = {i: SPECIAL.get(i, f"w{i}") for i in range(512)}
TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|> {{ m.content }} {% endfor %}"
            "{% if add_generation_prompt %}<|assistant|>{% endif %}")


def write_tokenizer(out: Path) -> Path:
    """A word-level fast tokenizer over the tiny model's 512 ids (``w5`` is id 5), with a
    chat template: written locally, nothing downloaded."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit

    out.mkdir(parents=True, exist_ok=True)
    tok = Tokenizer(WordLevel({w: i for i, w in WORDS.items()}, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(
        {"chat_template": TEMPLATE, "bos_token": "<s>", "eos_token": "</s>"}))
    return out


def words(ids: list[int]) -> str:
    return " ".join(WORDS[i] for i in ids)


@pytest.fixture(scope="module")
def text_front(servers: dict[str, Proc], store_node: Any,
               tmp_path_factory: pytest.TempPathFactory) -> Iterator[Proc]:
    tok = write_tokenizer(tmp_path_factory.mktemp("tokenizer"))
    p = front(servers, store_node.addr, tmp_path_factory.mktemp("front"), "text",
              "--tokenizer", str(tok), "--ttft-slo", "60s", "--tbt-slo", "5s",
              colocated=True)
    yield p
    assert p.stop() == 0, p.output()


def test_text_prompts_with_a_tokenizer(text_front: Proc, servers: dict[str, Proc]) -> None:
    ids = prompt(40, 90)
    want = reference(servers["C"], ids, 8)
    r = httpx.post(text_front.url + "/v1/completions", json={
        "prompt": words(ids), "max_tokens": 8, "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["text"] == words(want)
    assert "token_ids" not in choice  # not asked for
    body = {"prompt": words(ids), "max_tokens": 8, "temperature": 0, "stream": True}
    parts = []
    with httpx.stream("POST", text_front.url + "/v1/completions", json=body,
                      timeout=120) as s:
        for line in s.iter_lines():
            if line.startswith("data: {"):
                parts.append(json.loads(line[6:])["choices"][0]["text"])
    assert "".join(parts).strip() == words(want)
    assert len(parts) >= 3


def test_chat_completions_render_the_template(text_front: Proc,
                                              servers: dict[str, Proc]) -> None:
    user = words(prompt(41, 60))
    ids = [501, *[int(w[1:]) for w in user.split()], 502]  # <|user|> ... <|assistant|>
    want = reference(servers["C"], ids, 6)
    r = httpx.post(text_front.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": user}], "max_tokens": 6,
        "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    out = r.json()
    assert out["object"] == "chat.completion"
    assert out["choices"][0]["message"] == {"role": "assistant", "content": words(want)}
    bad = httpx.post(text_front.url + "/v1/chat/completions", json={"messages": "hi"},
                     timeout=30)
    assert bad.status_code == 400
    assert "messages must be" in bad.json()["error"]["message"]


def test_streamed_usage_chunks_pass_through_the_text_routes(
        text_front: Proc, servers: dict[str, Proc]) -> None:
    """``stream_options.include_usage`` (what ``vllm bench serve`` and AIPerf ask for):
    vLLM's last chunk has no choices, only the usage; the front's text routes pass it
    in their own shape (chat: a ``chat.completion.chunk``) instead of failing on it."""
    user = words(prompt(42, 60))
    plain = [int(w[1:]) for w in user.split()]
    chat_ids = [501, *plain, 502]  # <|user|> ... <|assistant|>, rendered by the front
    for path, body, ids in (("/v1/chat/completions",
                             {"messages": [{"role": "user", "content": user}]}, chat_ids),
                            ("/v1/completions", {"prompt": user}, plain)):
        want = reference(servers["C"], ids, 6)
        with httpx.stream("POST", text_front.url + path, timeout=120, json={
                **body, "max_tokens": 6, "temperature": 0, "stream": True,
                "stream_options": {"include_usage": True}}) as r:
            assert r.status_code == 200
            lines = [line for line in r.iter_lines() if line.startswith("data: ")]
        assert lines[-1] == "data: [DONE]"
        events = [json.loads(line[6:]) for line in lines[:-1]]
        assert all("error" not in e for e in events), events
        *answer, usage = events
        assert usage["choices"] == []
        assert usage["usage"]["completion_tokens"] == 6
        assert usage["usage"]["prompt_tokens"] == len(ids)
        if path == "/v1/chat/completions":
            assert {e["object"] for e in events} == {"chat.completion.chunk"}
            assert answer[0]["choices"][0]["delta"]["role"] == "assistant"
            got = "".join(e["choices"][0]["delta"]["content"] for e in answer)
        else:
            got = "".join(e["choices"][0]["text"] for e in answer)
        assert got.strip() == words(want)


def test_chat_without_a_tokenizer_is_a_clear_400(disagg: Proc) -> None:
    r = httpx.post(disagg.url + "/v1/chat/completions", json={
        "messages": [{"role": "user", "content": "hi"}]}, timeout=30)
    assert r.status_code == 400
    assert "--tokenizer" in r.json()["error"]["message"]


def wait_for(predicate: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


GENERATED = "vllm:generation_tokens_total"


def test_a_client_that_disconnects_cancels_its_upstream_request(
        colocated: Proc, servers: dict[str, Proc]) -> None:
    """Streamed and plain: the client goes away mid-generation and vLLM stops the request
    before its 480 tokens (vLLM 0.32 does not count a client's abort in
    ``request_success{finished_reason="abort"}``, so the generated tokens tell)."""
    import socket

    body = {"max_tokens": 480, "temperature": 0, "ignore_eos": True}

    def leave_a_stream(tokens: list[int], generated_before: float) -> None:
        with httpx.stream("POST", colocated.url + "/v1/completions", timeout=60,
                          json={**body, "prompt": tokens, "stream": True}) as r:
            seen = 0
            for line in r.iter_lines():
                seen += line.startswith("data: {")
                if seen == 3:
                    break  # leaving the block closes the connection

    # The plain request has no stream to watch, so the test learns that vLLM is generating
    # from its metrics.
    host, port = colocated.url.removeprefix("http://").split(":")

    def leave_a_plain_request(tokens: list[int], generated_before: float) -> None:
        plain = json.dumps({**body, "stream": False, "prompt": tokens}).encode()
        sock = socket.create_connection((host, int(port)))
        sock.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: "
                     b"application/json\r\nContent-Length: " + str(len(plain)).encode()
                     + b"\r\n\r\n" + plain)
        wait_for(lambda: vllm_metric(servers["C"], GENERATED) > generated_before, 60,
                 "the plain request to generate")
        sock.close()

    assert_leaving_cancels(colocated, servers["C"], leave_a_stream, first_seed=50)
    assert_leaving_cancels(colocated, servers["C"], leave_a_plain_request, first_seed=60)


def assert_leaving_cancels(front: Proc, c: Proc, leave: Callable[[list[int], float], None],
                           first_seed: int) -> None:
    """``leave(prompt, generated_before)`` sends a request of 480 tokens to ``front`` and
    goes away mid-generation; vLLM must stop it short and the front count it cancelled.

    vLLM on this CPU can outrun the client's close: it does not wait for the client to read
    (the sockets buffer the whole answer), and its metrics, which tell a plain request's
    client when generation started, lag a second or more on a loaded machine. Such a lost
    race is retried with a new prompt; a front that does not cancel loses every attempt."""
    cancelled = 'conductor_requests_total{outcome="cancelled"'
    for attempt in range(4):
        generated, cancels = settled(c, GENERATED), front_metric(front, cancelled)
        leave(prompt(first_seed + attempt, 20), generated)
        wait_for(lambda: vllm_metric(c, "vllm:num_requests_running") == 0, 120,
                 "the request to stop")
        if settled(c, GENERATED) - generated < 480:
            wait_for(lambda n=cancels: front_metric(front, cancelled) == n + 1, 10,
                     "the front to count the cancellation")
            return
    pytest.fail(f"vLLM generated all 480 tokens of every request whose client left "
                f"({leave.__name__})")


def settled(p: Proc, name: str) -> float:
    """``name``'s value once two reads 0.3 s apart agree (vLLM's counters trail its
    ``num_requests_running`` gauge)."""
    last = vllm_metric(p, name)
    while True:
        time.sleep(0.3)
        now = vllm_metric(p, name)
        if now == last:
            return now
        last = now


def test_zz_decode_killed_mid_request_gives_a_clear_error(disagg: Proc,
                                                          servers: dict[str, Proc]) -> None:
    """Runs last: it kills D. The stream ends with an error event naming the decode
    instance, promptly (the client's own timeout would fail a hang)."""
    import signal

    tokens = prompt(30, 60)
    body = {"prompt": tokens, "max_tokens": 400, "temperature": 0, "stream": True,
            "ignore_eos": True}
    errors: list[dict] = []
    got_tokens = 0
    with httpx.stream("POST", disagg.url + "/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                errors.append(ev["error"])
                continue
            got_tokens += 1
            if got_tokens == 3:
                servers["D"].stop(signal.SIGKILL)
    assert got_tokens < 400
    assert len(errors) == 1, errors
    assert errors[0]["code"] == 502
    assert f"decode instance {servers['D'].url} failed mid-stream" in errors[0]["message"]
    assert front_metric(disagg, 'conductor_requests_total{outcome="upstream_error"') == 1
    # a new request to the dead decode instance: a clear 502, no hang
    r2 = complete(disagg.url, prompt(31), 4)
    assert r2.status_code == 502, r2.text
    assert "decode instance" in r2.json()["error"]["message"]
