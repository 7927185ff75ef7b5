"""Prefill and decode workers in process, against a real kvstore node process.

Tolerance: logits computed from a store-fetched prefix agree with a cold prefill to
max abs diff <= 1e-4 (float32); greedy tokens are identical.
"""

from __future__ import annotations

import struct
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from conftest import NodeProcess, free_port

from kvstore import Client, block_keys
from workers.decode import DecodeWorker
from workers.kv_blocks import KVBlockStore, default_namespace, layer_key, tail_key
from workers.model import PRESETS, LlamaModel
from workers.prefill import PrefillWorker

B = 16
TOL = 1e-4
TINY = PRESETS["tiny"]


def prompt(seed: int, n: int = 99) -> list[int]:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, TINY.vocab_size, (n,), generator=g).tolist()


@pytest.fixture(scope="module")
def store(shared_node: NodeProcess) -> Iterator[Client]:
    with Client(shared_node.addr) as c:
        yield c


def model(seed: int) -> LlamaModel:
    """A distinct seed per test gives a distinct namespace: tests never see each
    other's blocks on the shared node."""
    return LlamaModel.random(TINY, seed=seed)


def maxdiff(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    assert a is not None and b is not None
    return (a - b).abs().max().item()


def test_layer_and_tail_keys_follow_the_spec() -> None:
    k = bytes(range(16))
    assert layer_key(k, 3) == xxhash.xxh3_128_digest(b"kvstore-workers-layer-v1\x00" + k
                                                      + b"\x03\x00\x00\x00")
    assert layer_key(k, 3) != layer_key(k, 4)
    t = tail_key("ns", "req-1", [1, 2])
    assert t == xxhash.xxh3_128_digest(b"kvstore-workers-tail-v1\x00ns\x00req-1\x00"
                                        + struct.pack("<2I", 1, 2))
    assert t != tail_key("ns", "req-1", [1, 3]) != tail_key("ns", "req-2", [1, 2])


def test_stored_bytes_follow_the_documented_layout(store: Client) -> None:
    m = model(100)
    p = prompt(1)
    r = PrefillWorker(m, store, block_tokens=B).prefill(p, request_id="layout")
    ns = default_namespace(m, B)
    assert [bytes(k) for k in r.keys] == block_keys(p, B, ns)
    assert r.written_blocks == 6 and r.tail_tokens == 3 and not r.store_errors
    _, ref = m.prefill(p)  # an independent cold run in this process

    def expected(layer: int, start: int, stop: int) -> bytes:
        out = b""
        for t in range(start, stop):
            k = ref.kv[layer, t, 0].numpy().astype("<f4")  # (n_kv_heads, head_dim)
            v = ref.kv[layer, t, 1].numpy().astype("<f4")
            out += k.tobytes() + v.tobytes()
        return out

    for i, key in enumerate(r.keys):
        for layer in range(TINY.n_layers):
            got = store.get(layer_key(key, layer))
            assert got is not None and len(got) == B * 2 * TINY.n_kv_heads * TINY.head_dim * 4
            want = expected(layer, i * B, (i + 1) * B)
            assert np.allclose(np.frombuffer(got, "<f4"), np.frombuffer(want, "<f4"),
                               atol=1e-5, rtol=0)
    tk = tail_key(ns, "layout", p)
    for layer in range(TINY.n_layers):
        got = store.get(layer_key(tk, layer))
        assert got is not None and len(got) == 3 * 2 * TINY.n_kv_heads * TINY.head_dim * 4
        assert np.allclose(np.frombuffer(got, "<f4"),
                           np.frombuffer(expected(layer, 96, 99), "<f4"), atol=1e-5, rtol=0)


def test_cached_prefix_gives_the_same_logits_and_tokens(store: Client) -> None:
    m = model(101)
    p = prompt(2)
    reference = m.generate(p, 12)
    cold = PrefillWorker(m, store, block_tokens=B).prefill(p, request_id="c1",
                                                           keep_logits=True)
    assert (cold.cached_tokens, cold.computed_tokens) == (0, 99)
    assert cold.write_overlap is not None and 0.0 <= cold.write_overlap <= 1.0
    assert cold.store_write_s > 0 and cold.written_bytes > 0
    # A fresh worker (nothing in process) finds the prefix in the store.
    warm = PrefillWorker(m, store, block_tokens=B).prefill(p, request_id="c2",
                                                           keep_logits=True)
    assert (warm.matched_blocks, warm.fetched_blocks) == (6, 6)
    assert (warm.cached_tokens, warm.computed_tokens, warm.written_blocks) == (96, 3, 0)
    assert warm.fetched_bytes == 6 * TINY.n_layers * B * 2 * TINY.n_kv_heads * TINY.head_dim * 4
    assert warm.first_token == cold.first_token == reference[0]
    assert maxdiff(warm.logits, cold.logits) <= TOL
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        for r in (cold, warm):
            d = dw.decode(p, r.first_token, 12, request_id=r.request_id)
            assert d.tokens == reference
            assert (d.fetched_tokens, d.recomputed_tokens, d.tail_from_store) == (99, 0, True)
            assert len(d.tbt_s) == 11 and d.mean_tbt_s is not None
        # The tails were removed after loading.
        ns = default_namespace(m, B)
        assert store.exists([layer_key(tail_key(ns, "c1", p), 0)]) == [False]
    finally:
        dw.close()


def test_longer_prompt_reuses_the_shared_prefix_and_full_hits_compute_one_token(
        store: Client) -> None:
    m = model(102)
    p = prompt(3, 64)
    pw = PrefillWorker(m, store, block_tokens=B)
    first = pw.prefill(p, keep_logits=True)
    assert first.tail_tokens == 0 and first.written_blocks == 4
    again = pw.prefill(p, keep_logits=True)  # all 4 blocks stored: recompute the last token
    assert (again.cached_tokens, again.computed_tokens) == (63, 1)
    assert maxdiff(again.logits, first.logits) <= TOL
    longer = p + prompt(4, 40)
    r = pw.prefill(longer, keep_logits=True)
    assert (r.cached_tokens, r.computed_tokens, r.written_blocks) == (64, 40, 2)
    cold_logits, _ = m.prefill(longer)
    assert maxdiff(r.logits, cold_logits) <= TOL
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        assert dw.decode(longer, r.first_token, 8, request_id=r.request_id).tokens == \
            m.generate(longer, 8)
    finally:
        dw.close()


def test_a_prompt_shorter_than_a_block_travels_as_a_tail_only(store: Client) -> None:
    m = model(112)
    p = prompt(14, 5)
    r = PrefillWorker(m, store, block_tokens=B).prefill(p, request_id="short")
    assert (r.keys, r.tail_tokens, r.written_blocks, r.computed_tokens) == ([], 5, 0, 5)
    assert r.written_bytes == TINY.n_layers * 5 * 2 * TINY.n_kv_heads * TINY.head_dim * 4
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        d = dw.decode(p, r.first_token, 7, request_id="short")
    finally:
        dw.close()
    assert (d.fetched_tokens, d.tail_from_store, d.tokens) == (5, True, m.generate(p, 7))


def test_a_missing_layer_shortens_the_prefix_and_is_recomputed(store: Client) -> None:
    m = model(103)
    p = prompt(5)
    pw = PrefillWorker(m, store, block_tokens=B)
    cold = pw.prefill(p, keep_logits=True)
    assert store.remove(layer_key(cold.keys[3], 0))  # an earlier layer of block 3 evicted
    r = pw.prefill(p, keep_logits=True)
    # The last layer still matches all 6 blocks, but only 3 are complete.
    assert (r.matched_blocks, r.fetched_blocks, r.cached_tokens) == (6, 3, 48)
    assert r.written_blocks == 3
    assert maxdiff(r.logits, cold.logits) <= TOL
    assert store.exists([layer_key(cold.keys[3], 0)]) == [True]  # rewritten


def test_decode_recomputes_blocks_and_tail_missing_from_the_store(store: Client) -> None:
    m = model(104)
    p = prompt(6)
    r = PrefillWorker(m, store, block_tokens=B).prefill(p, request_id="gone")
    store.remove(layer_key(r.keys[4], 1))
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        d = dw.decode(p, r.first_token, 10, request_id="gone")
        assert (d.fetched_tokens, d.recomputed_tokens, d.tail_from_store) == (64, 35, False)
        assert d.tokens == m.generate(p, 10)
        # Without a request id there is no tail to find: it is recomputed.
        d2 = dw.decode([*p[:96], 1, 2], 5, 3)
        assert d2.recomputed_tokens >= 2
    finally:
        dw.close()


def test_corrupted_block_bytes_change_the_output(store: Client) -> None:
    """Overwriting a stored block (remove + put of other bytes under the same key)
    changes the logits and tokens: the prefix really is read from the store."""
    m = model(105)
    p = prompt(7)
    reference = m.generate(p, 10)
    pw = PrefillWorker(m, store, block_tokens=B)
    cold = pw.prefill(p, keep_logits=True)
    g = torch.Generator().manual_seed(0)
    for layer in range(TINY.n_layers):
        for key in cold.keys[:2]:
            lk = layer_key(key, layer)
            size = len(store.get(lk) or b"")
            noise = (torch.randn(size // 4, generator=g) * 4).numpy()
            assert store.remove(lk)
            assert store.put(lk, noise)
    warm = pw.prefill(p, request_id="bad", keep_logits=True)
    assert warm.cached_tokens == 96
    assert maxdiff(warm.logits, cold.logits) > 0.5
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        assert dw.decode(p, warm.first_token, 10, request_id="bad").tokens != reference
    finally:
        dw.close()


def test_continuous_batching_serves_concurrent_requests_exactly(store: Client) -> None:
    m = model(106)
    prompts = [prompt(10 + i, n) for i, n in enumerate([20, 99, 50, 33, 70])]
    pw = PrefillWorker(m, store, block_tokens=B)
    firsts = [pw.prefill(pp, request_id=f"cb{i}").first_token for i, pp in enumerate(prompts)]
    dw = DecodeWorker(m, store, block_tokens=B, max_batch=3)
    results: dict[int, Any] = {}

    def run(i: int) -> None:
        results[i] = dw.decode(prompts[i], firsts[i], 20 + 5 * i, request_id=f"cb{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert dw.status()["active"] == 0
    finally:
        dw.close()
    for i, pp in enumerate(prompts):
        assert results[i].tokens == m.generate(pp, 20 + 5 * i)
    assert max(r.mean_batch for r in results.values()) > 1.0
    assert all(r.mean_batch <= 3 for r in results.values())


def test_staged_transfers_match_direct_ones(store: Client) -> None:
    """The host-staging path (used for CUDA caches) run on CPU."""
    m = model(107)
    p = prompt(8)
    pw = PrefillWorker(m, store, block_tokens=B, staged=True)
    cold = pw.prefill(p, request_id="s1", keep_logits=True)
    warm = PrefillWorker(m, store, block_tokens=B).prefill(p, keep_logits=True)
    assert warm.cached_tokens == 96 and maxdiff(warm.logits, cold.logits) <= TOL
    dw = DecodeWorker(m, store, block_tokens=B, staged=True)
    try:
        d = dw.decode(p, cold.first_token, 6, request_id="s1")
        assert d.fetched_tokens == 99 and d.tokens == m.generate(p, 6)
    finally:
        dw.close()


class FailingStore:
    """A client whose ``put_batch`` fails from the ``fail_at``-th call on."""

    def __init__(self, inner: Client, fail_at: int) -> None:
        self.inner = inner
        self.calls = 0
        self.fail_at = fail_at

    def put_batch(self, *args: Any, **kwargs: Any) -> list[bool]:
        self.calls += 1
        if self.calls >= self.fail_at:
            from kvstore import ResourceExhausted
            raise ResourceExhausted("full")
        return self.inner.put_batch(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def test_a_failed_layer_write_stops_later_layers(store: Client) -> None:
    m = model(108)
    p = prompt(9)
    failing = FailingStore(store, fail_at=2)  # layer 0 stored, layer 1 fails
    r = PrefillWorker(m, failing, block_tokens=B).prefill(p)
    assert r.store_errors and "ResourceExhausted" in r.store_errors[0]
    assert failing.calls == 2  # nothing tried after the failure
    assert store.exists([layer_key(k, 0) for k in r.keys]) == [True] * 6
    assert store.exists([layer_key(k, 1) for k in r.keys]) == [False] * 6
    again = PrefillWorker(m, store, block_tokens=B).prefill(p)
    assert again.cached_tokens == 0 and again.written_blocks == 6


def test_a_wrong_size_object_counts_as_missing(store: Client) -> None:
    m = model(109)
    p = prompt(11, 48)
    pw = PrefillWorker(m, store, block_tokens=B)
    cold = pw.prefill(p, keep_logits=True)
    lk = layer_key(cold.keys[1], 0)
    assert store.remove(lk)
    assert store.put(lk, b"x" * 100_000)  # larger than its slot
    kvb = KVBlockStore(store, m, block_tokens=B)
    cache = m.new_cache(48)
    assert kvb.fetch(cache, cold.keys).blocks == 1
    assert store.remove(lk) and store.put(lk, b"x" * 10)  # smaller
    assert kvb.fetch(cache, cold.keys).blocks == 1
    r = pw.prefill(p, keep_logits=True)
    assert r.cached_tokens == 16 and maxdiff(r.logits, cold.logits) <= TOL


def test_an_unreachable_store_degrades_to_computing_everything() -> None:
    m = model(111)
    p = prompt(13)
    with Client(f"127.0.0.1:{free_port()}", transport="grpc", timeout=5) as dead:
        r = PrefillWorker(m, dead, block_tokens=B).prefill(p)
        assert (r.cached_tokens, r.computed_tokens) == (0, 99)
        assert [e.split(":")[0] for e in r.store_errors] == ["lookup", "layer 0"]
        assert r.first_token == m.generate(p, 1)[0]
        dw = DecodeWorker(m, dead, block_tokens=B)
        try:
            d = dw.decode(p, r.first_token, 5, request_id=r.request_id)
        finally:
            dw.close()
        assert (d.fetched_tokens, d.recomputed_tokens) == (0, 99)
        assert d.tokens == m.generate(p, 5)


def test_status_reports_load(store: Client) -> None:
    m = model(110)
    pw = PrefillWorker(m, store, block_tokens=B)
    s = pw.status()
    assert (s["role"], s["queued"], s["active"], s["requests_done"]) == ("prefill", 0, 0, 0)
    pw.prefill(prompt(12))
    pw.prefill(prompt(12))
    s = pw.status()
    assert s["requests_done"] == 2 and s["tokens_per_s"] > 0 and s["compute_tokens_per_s"] > 0
    assert s["cache_hit_ratio"] == pytest.approx(96 / 198)
    dw = DecodeWorker(m, store, block_tokens=B)
    try:
        dw.decode(prompt(12), 1, 4)
        s = dw.status()
        assert (s["role"], s["queued"], s["active"], s["requests_done"]) == ("decode", 0, 0, 1)
        assert s["tokens_per_s"] > 0 and s["step_s"] > 0
    finally:
        dw.close()
    dw = DecodeWorker(m, store)
    try:
        with pytest.raises(ValueError, match="max_seq_len"):
            dw.decode(prompt(12), 1, TINY.max_seq_len)
    finally:
        dw.close()
