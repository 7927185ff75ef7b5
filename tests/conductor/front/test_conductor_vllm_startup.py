"""``conductor.front.vllm_startup``: what must agree between the instances and the flags
(the engine tests read it from real vLLM servers)."""

from __future__ import annotations

import httpx
import pytest

from conductor.front.vllm_instances import ConnectorInfo, InstanceShape, VllmInstance
from conductor.front.vllm_startup import StartupMismatch, check_roles, layout_of, shards_of

P, D = "http://p:1", "http://d:2"


def info(ns: str = "NS", block: int = 32, role: str = "kv_both",
         shards: tuple[str, ...] = ()) -> ConnectorInfo:
    return ConnectorInfo(namespace=ns, block_tokens=block, kv_role=role, shards=shards)


def shape(block: int | None = 32) -> InstanceShape:
    return InstanceShape(model="m", max_model_len=512, block_size=block, kv_tokens=None)


SHAPES = {P: shape(), D: shape()}


def test_the_namespace_and_block_size_are_learnt_from_the_connectors() -> None:
    assert layout_of({P: info(), D: info(role="kv_consumer")}, SHAPES, namespace="",
                     block_tokens=0) == ("NS", 32)
    # flags that agree are fine
    assert layout_of({P: info(), D: info()}, SHAPES, namespace="NS",
                     block_tokens=32) == ("NS", 32)


def test_instances_that_disagree_are_named_both() -> None:
    with pytest.raises(StartupMismatch) as e:
        layout_of({P: info("NS"), D: info("NS-2")}, SHAPES, namespace="", block_tokens=0)
    assert str(e.value) == ("instances disagree on the kvstore namespace: http://p:1 has "
                            "'NS', http://d:2 has 'NS-2'")
    with pytest.raises(StartupMismatch, match="disagree on the block size in tokens: "
                       "http://p:1 has 32, http://d:2 has 16"):
        layout_of({P: info(), D: info(block=16)}, SHAPES, namespace="", block_tokens=0)


def test_flags_that_disagree_with_the_instances_are_named_with_them() -> None:
    with pytest.raises(StartupMismatch) as e:
        layout_of({P: info(), D: info()}, SHAPES, namespace="other", block_tokens=0)
    assert str(e.value) == ("--kv-namespace is 'other' but http://p:1's connector uses "
                            "namespace 'NS'")
    with pytest.raises(StartupMismatch, match="--block-tokens is 16 but http://p:1 uses "
                       "32-token blocks"):
        layout_of({P: info(), D: info()}, SHAPES, namespace="", block_tokens=16)


def test_a_silent_connector_needs_both_flags() -> None:
    with pytest.raises(StartupMismatch) as e:
        layout_of({P: info(), D: None}, SHAPES, namespace="", block_tokens=0)
    assert str(e.value).startswith("http://d:2 does not describe its kvstore connector")
    assert str(e.value).endswith("give --kv-namespace and --block-tokens")
    # with the flags, the others still must agree with them
    assert layout_of({P: info(), D: None}, SHAPES, namespace="NS",
                     block_tokens=32) == ("NS", 32)
    assert layout_of({P: None, D: None}, SHAPES, namespace="X", block_tokens=32) == ("X", 32)


def test_roles_must_fit_what_each_instance_does() -> None:
    http = httpx.AsyncClient()
    p, d = VllmInstance(P, role="prefill", http=http), VllmInstance(D, role="decode", http=http)
    check_roles([p, d], {P: info(role="kv_producer"), D: info(role="kv_consumer")})
    with pytest.raises(StartupMismatch, match="prefill instance http://p:1 runs its "
                       "connector with kv_role 'kv_consumer', which saves nothing"):
        check_roles([p, d], {P: info(role="kv_consumer"), D: info(role="kv_consumer")})
    with pytest.raises(StartupMismatch, match="decode instance http://d:2 runs its "
                       "connector with kv_role 'kv_producer', which loads nothing"):
        check_roles([p, d], {P: info(), D: info(role="kv_producer")})


def test_instances_must_store_the_same_shards() -> None:
    tp2 = ("tp0of2.pp0of1", "tp1of2.pp0of1")
    assert shards_of({P: info(shards=tp2), D: info(shards=tp2)}) == tp2
    assert shards_of({P: info(), D: None}) == ()
    assert shards_of({P: None}) == ()
    with pytest.raises(StartupMismatch) as e:
        shards_of({P: info(shards=tp2), D: info()})
    assert str(e.value) == ("instances disagree on the kvstore shards (the engines' tensor / "
                            "pipeline parallel shape): http://p:1 has ('tp0of2.pp0of1', "
                            "'tp1of2.pp0of1'), http://d:2 has ()")
