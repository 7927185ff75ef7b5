"""The connector's identity fails closed: what decides the KV bytes is in the default
namespace (the weights' fingerprint first), so an engine never loads KV computed by other
weights or settings.

The first test runs vLLM's engine (CPU build): a tiny random Llama is served, then
overwritten in place by other weights (same path, same config, same file sizes: the case
the model's name and revision cannot tell apart), and served again. The others build the
connector from vLLM's own config classes, without an engine (they run under vLLM 0.33 too).
"""

from __future__ import annotations

import re
import shutil
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from vllm_llm import generate, kvstore_llm

from kvstore import Client
from kvstore.integrations.identity import fingerprint_checkpoint


def make_tiny_llama(out: Path, *, seed: int) -> Path:
    """The engines' tiny Llama (``conftest.make_tiny_llama``), written at ``out``."""
    from conductor.front.vllm_procs import write_tiny_llama

    return write_tiny_llama(out, seed=seed, layers=2, max_positions=2048)

BLOCK = 32
PROMPT_TOKENS = 200
LOADABLE = (PROMPT_TOKENS - 1) // BLOCK * BLOCK  # 192: six blocks


def prompt(seed: int) -> list[int]:
    rng = np.random.default_rng(seed)
    return [int(t) for t in rng.integers(3, 500, PROMPT_TOKENS)]




def stored_blocks(client: Client) -> int:
    return sum(int(t.get("blocks", 0)) for t in client.stats()["tiers"].values())


def wait_for_blocks(client: Client, n: int) -> None:
    deadline = time.monotonic() + 60
    while stored_blocks(client) < n:
        assert time.monotonic() < deadline, f"never {n} blocks in the node"
        time.sleep(0.05)


def checkpoint_files(model: Path) -> dict[str, int]:
    return {p.name: p.stat().st_size for p in sorted(model.iterdir())}


@pytest.mark.vllm_engine
@pytest.mark.timeout(900)
def test_a_checkpoint_overwritten_in_place_is_not_served_the_old_kv(
        tmp_path: Path, store_node: Any, client: Client) -> None:
    model = make_tiny_llama(tmp_path / "model", seed=0)
    tokens = prompt(23)
    base = stored_blocks(client)

    with kvstore_llm(model, store_node.addr, None) as llm:  # the default namespace
        old, hits = generate(llm, tokens)
    assert hits == 0
    wait_for_blocks(client, base + LOADABLE // BLOCK)

    # Another engine on the same weights shares them: the identity is the weights',
    # not the process's.
    with kvstore_llm(model, store_node.addr, None) as llm:
        again, hits = generate(llm, tokens)
    assert (again, hits) == (old, LOADABLE)

    # A fine-tune written over the old files: same path, config and sizes.
    config = (model / "config.json").read_bytes()
    sizes = checkpoint_files(model)
    make_tiny_llama(model, seed=1)
    assert (model / "config.json").read_bytes() == config
    assert checkpoint_files(model) == sizes

    with kvstore_llm(model, store_node.addr, None) as llm:
        new, hits = generate(llm, tokens)
    assert hits == 0, "the old weights' KV was offered to an engine on the new weights"

    with kvstore_llm(model, store_node.addr, f"fresh-{time.time_ns()}") as llm:
        fresh, hits = generate(llm, tokens)
    assert hits == 0
    assert new == fresh, "tokens differ from a fresh engine's on the new weights"
    assert fresh != old  # the weights matter to the output, so the check above can fail


IDENTITY = ("weights", "dtype", "quant", "kv_cache_dtype", "kv_skip", "kv_scales",
            "hf_overrides", "tp", "pp")


def namespace_parts(conn: Any) -> dict[str, str]:
    """The identity parts of the connector's namespace (the model part is a path, so the
    namespace is not split on its slashes)."""
    found = {}
    for key in IDENTITY:
        m = re.search(rf"/{key}=([^/]*)", conn.namespace)
        assert m is not None, key
        found[key] = m.group(1)
    return found


@pytest.fixture
def own_model(tiny_llama: Path, tmp_path: Path) -> Path:
    """A copy of the tiny model this test may overwrite."""
    return Path(shutil.copytree(tiny_llama, tmp_path / "model"))


def test_the_default_namespace_names_the_weights_and_what_decides_the_bytes(
        make_connector: Any, store_node: Any, own_model: Path) -> None:
    conn = make_connector("SCHEDULER", store_node.addr, model=own_model)
    parts = namespace_parts(conn)
    digest = fingerprint_checkpoint(own_model).digest
    assert parts["weights"] == f"fingerprint:{digest}"
    assert {k: parts[k] for k in ("dtype", "quant", "kv_cache_dtype", "kv_scales", "tp", "pp",
                                  "hf_overrides", "kv_skip")} == {
        "dtype": "float32", "quant": "none", "kv_cache_dtype": "auto",
        "kv_scales": "checkpoint", "tp": "1", "pp": "1", "hf_overrides": "{}", "kv_skip": ""}
    # the layout parts stay as they were
    for part in ("kv_dtype=torch.float32", "layers=2", "kv_heads=2", "head_size=32",
                 "block=32", "device=cpu", f"model={own_model}"):
        assert f"/{part}/" in conn.namespace, part


def test_weights_overwritten_in_place_change_it(make_connector: Any, store_node: Any,
                                                own_model: Path) -> None:
    before = make_connector("SCHEDULER", store_node.addr, model=own_model).namespace
    make_tiny_llama(own_model, seed=5)
    after = make_connector("SCHEDULER", store_node.addr, model=own_model).namespace
    assert after != before
    assert before.split("/weights=")[0] == after.split("/weights=")[0]  # name unchanged


@pytest.mark.parametrize(("args", "part"), [
    ({"dtype": "bfloat16"}, "dtype"),
    ({"hf_overrides": {"rope_theta": 20000.0}}, "hf_overrides"),
])
def test_settings_that_change_the_bytes_change_it(make_connector: Any, store_node: Any,
                                                  own_model: Path, args: dict,
                                                  part: str) -> None:
    base = namespace_parts(make_connector("SCHEDULER", store_node.addr, model=own_model))
    other = namespace_parts(make_connector("SCHEDULER", store_node.addr, model=own_model,
                                           engine_args=args))
    assert other[part] != base[part]
    assert other["weights"] == base["weights"]


def test_a_weights_id_names_the_weights_instead(make_connector: Any, store_node: Any,
                                                own_model: Path) -> None:
    """The operator's name for the weights (a checkpoint loaded from elsewhere, say)
    replaces the fingerprint; an explicit namespace replaces the whole default."""
    conn = make_connector("SCHEDULER", store_node.addr, model=own_model,
                          weights_id="llama-ft-7")
    assert namespace_parts(conn)["weights"] == "given:llama-ft-7"
    make_tiny_llama(own_model, seed=6)
    assert make_connector("SCHEDULER", store_node.addr, model=own_model,
                          weights_id="llama-ft-7").namespace == conn.namespace
    explicit = make_connector("SCHEDULER", store_node.addr, model=own_model, namespace="mine")
    assert explicit.namespace == "mine"


def test_lora_salt_and_media_stay_in_each_requests_keys() -> None:
    """What the namespace leaves to the request (``request_extra``): two requests that
    differ in any of these never share a key."""
    from types import SimpleNamespace

    from kvstore.integrations.vllm.connector import request_extra

    def req(**kw: Any) -> Any:
        base = {"lora_request": None, "cache_salt": None, "mm_features": None}
        return SimpleNamespace(**{**base, **kw})

    lora = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql")
    moved = SimpleNamespace(lora_name="sql", lora_path="/adapters/sql-v2")
    image = SimpleNamespace(identifier="mmhash-1")
    extras = [request_extra(req()), request_extra(req(lora_request=lora)),
              request_extra(req(lora_request=moved)), request_extra(req(cache_salt="t1")),
              request_extra(req(mm_features=[image])),
              request_extra(req(mm_features=[SimpleNamespace(identifier="mmhash-2")]))]
    assert len(set(extras)) == len(extras)
    assert extras[0] == b""  # plain text: the namespace alone


def test_the_identity_functions_keep_their_connector_path() -> None:
    """They moved to ``engine_identity``; ``connector`` still names the same functions."""
    from kvstore.integrations.vllm import connector, engine_identity

    for name in ("engine_identity", "default_namespace", "header_identity"):
        assert getattr(connector, name) is getattr(engine_identity, name)
