"""The prefill worker: fetch the cached prefix, compute the rest, stream new KV to the store.

Per request (one at a time; a worker's cores are saturated by one prefill):

1. ``lookup``: block keys of the prompt, ``prefix_match`` on their last-layer keys.
2. ``fetch``: every layer of the matched blocks, straight into a fresh cache
   (``get_batch_into``); a miss in any layer shortens the prefix to the blocks
   before it.
3. ``compute``: the model runs the uncached tokens layer by layer. At least the
   last prompt token is always computed, since its logits give the first token.
4. ``write``: ``on_layer_done`` hands each finished layer to a sender thread that
   puts that layer of every new full block (and of the partial tail, for the
   decode worker), while the next layers compute. The result is returned only
   after the sender has finished, so a decode worker that gets it finds the blocks
   stored; TTFT includes that wait (``write_tail_s``).

Overlap: ``write_overlap`` is the fraction of the sender's busy time (wall time
inside ``put_batch``) that fell inside the compute interval; 1.0 means every byte
was hidden under compute, 0.0 that writing was fully serial.
"""

from __future__ import annotations

import queue
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import BlockKey, KVStoreError
from workers.kv_blocks import FetchResult, KVBlockStore, StoredBlocks, kv_shape
from workers.metrics import Ema, RateMeter
from workers.model import KVCache, LlamaModel


@dataclass(slots=True, kw_only=True)
class PrefillResult:
    """What one prefill did and how long each phase took (seconds, wall clock).

    ``cached_tokens + computed_tokens == prompt_tokens``. ``ttft_s`` runs from the call
    until the result is ready, writes included (``lookup_s + fetch_s + compute_s +
    write_tail_s`` plus waiting for the worker). ``fetch_s`` includes allocating the
    request's cache. ``write_overlap`` is None when nothing was written. A store that
    fails is not fatal: the prefix counts as uncached, writes stop, and
    ``store_errors`` says what happened.
    """

    request_id: str
    first_token: int
    prompt_tokens: int
    cached_tokens: int
    computed_tokens: int
    matched_blocks: int
    fetched_blocks: int
    written_blocks: int
    tail_tokens: int
    lookup_s: float
    fetch_s: float
    compute_s: float
    store_write_s: float
    write_tail_s: float
    write_overlap: float | None
    ttft_s: float
    fetched_bytes: int
    written_bytes: int
    store_errors: list[str]
    keys: list[BlockKey]
    logits: torch.Tensor | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        """The RPC form: keys as hex, logits left out."""
        out: dict[str, Any] = {}
        for name in self.__slots__:
            if name == "logits":
                continue
            value = getattr(self, name)
            out[name] = [k.hex() for k in value] if name == "keys" else value
        return out


class _LayerWriter:
    """A sender thread for one request: puts each layer the model hands it, in order.

    Invariant (the completeness rule of ``kv_blocks``): after the first failed layer
    nothing more is written, so a stored last layer implies all earlier layers were
    acknowledged.
    """

    def __init__(self, kvb: KVBlockStore, cache: KVCache, keys: Sequence[BlockKey],
                 first_block: int, stop: int, tail: BlockKey | None,
                 retain_s: float | None = None) -> None:
        self.kvb = kvb
        self.cache = cache
        self.keys = keys
        self.first_block = first_block
        self.start = first_block * kvb.block_tokens
        self.stop = stop
        self.tail = tail
        self.retain_s = retain_s
        self.busy: list[tuple[float, float]] = []
        self.bytes = 0
        self.errors: list[str] = []
        self._queue: queue.SimpleQueue[tuple[int, torch.Tensor] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="prefill-writer", daemon=True)
        self._thread.start()

    def on_layer_done(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> None:
        # Runs in the compute thread; on CPU this is a view, staged it is a copy.
        self._queue.put((layer, self.kvb.host_rows(self.cache, layer, self.start, self.stop)))

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            if self.errors:
                continue  # drain without writing: see the invariant
            layer, rows = item
            t0 = time.perf_counter()
            try:
                self.bytes += self.kvb.put_layer(layer, rows, self.keys, self.first_block,
                                                 tail=self.tail, retain_s=self.retain_s)
            except Exception as exc:  # (reported in the result, not fatal)
                self.errors.append(f"layer {layer}: {type(exc).__name__}: {exc}")
            self.busy.append((t0, time.perf_counter()))

    def finish(self) -> None:
        self._queue.put(None)
        self._thread.join()

    def overlap(self, c0: float, c1: float) -> tuple[float, float | None]:
        """(total busy seconds, fraction of them inside ``[c0, c1]``)."""
        total = sum(e - s for s, e in self.busy)
        if total <= 0:
            return 0.0, None
        hidden = sum(max(0.0, min(e, c1) - max(s, c0)) for s, e in self.busy)
        return total, hidden / total


class PrefillWorker:
    """Prefill against a kvstore ``Client`` (single node or cluster: same methods).

    Thread-safe: concurrent calls queue on one lock (``status()['queued']``).
    """

    def __init__(self, model: LlamaModel, store: StoredBlocks, *, block_tokens: int = 16,
                 namespace: str | None = None, write_tail: bool = True,
                 staged: bool | None = None) -> None:
        self.model = model
        self.kv = KVBlockStore(store, model, block_tokens=block_tokens, namespace=namespace,
                               staged=staged)
        self.block_tokens = block_tokens
        self.namespace = self.kv.namespace
        self.write_tail = write_tail
        self._lock = threading.Lock()
        self._stats_lock = threading.Lock()
        self._waiting = 0
        self._active = 0
        self._done = 0
        self._prompt_tokens = RateMeter()
        self._compute_rate = Ema()
        self._hit_tokens = 0
        self._total_tokens = 0

    def prefill(self, token_ids: Sequence[int], *, request_id: str | None = None,
                keep_logits: bool = False, use_cache: bool = True,
                retain_s: float | None = None) -> PrefillResult:
        """``use_cache=False`` skips the cached-prefix lookup (computes every token, still
        writes the blocks decode reads): the baseline a cache is measured against.
        ``retain_s``: the full blocks this call writes are put with that retention
        (seconds; a session's turn: docs/conductor.md, "Sessions"); None: none."""
        tokens = [int(t) for t in token_ids] if not isinstance(token_ids, list) else token_ids
        if not tokens:
            raise ValueError("token_ids must not be empty")
        self.model.check_tokens(tokens)
        if len(tokens) > self.model.config.max_seq_len:
            raise ValueError(f"{len(tokens)} tokens exceed max_seq_len "
                             f"{self.model.config.max_seq_len}")
        rid = request_id or uuid.uuid4().hex
        t_call = time.perf_counter()
        with self._stats_lock:
            self._waiting += 1
        with self._lock:
            with self._stats_lock:
                self._waiting -= 1
                self._active += 1
            try:
                result = self._prefill(tokens, rid, t_call, keep_logits, use_cache, retain_s)
            finally:
                with self._stats_lock:
                    self._active -= 1
        with self._stats_lock:
            self._done += 1
            self._prompt_tokens.add(len(tokens))
            if result.compute_s > 0:
                self._compute_rate.add(result.computed_tokens / result.compute_s)
            self._hit_tokens += result.cached_tokens
            self._total_tokens += len(tokens)
        return result

    def _prefill(self, tokens: list[int], rid: str, t_call: float, keep_logits: bool,
                 use_cache: bool = True, retain_s: float | None = None) -> PrefillResult:
        B = self.block_tokens
        n = len(tokens)
        t0 = time.perf_counter()
        keys = self.kv.block_keys(tokens)
        n_full = len(keys)
        errors: list[str] = []
        try:
            matched = self.kv.cached_blocks(keys) if use_cache else 0
        except KVStoreError as exc:  # degrade to a cold prefill; the store is only a cache
            errors.append(f"lookup: {type(exc).__name__}: {exc}")
            matched = 0
        t1 = time.perf_counter()

        cache = self.model.new_cache(n)
        fetched: FetchResult | None = None
        if matched:
            try:
                fetched = self.kv.fetch(cache, keys[:matched])
            except KVStoreError as exc:
                errors.append(f"fetch: {type(exc).__name__}: {exc}")
        good = fetched.blocks if fetched else 0
        cached_tokens = min(good * B, n - 1)  # the last token is always computed
        cache.length = cached_tokens
        t2 = time.perf_counter()

        tail_tokens = n - n_full * B
        tail = self.kv.tail_key(rid, tokens) if tail_tokens and self.write_tail else None
        stop = n_full * B + (tail_tokens if tail is not None else 0)
        writer = (_LayerWriter(self.kv, cache, keys, good, stop, tail, retain_s)
                  if stop > good * B else None)
        c0 = time.perf_counter()
        try:
            logits, _ = self.model.prefill(tokens[cached_tokens:], cache,
                                           on_layer_done=writer.on_layer_done if writer else None)
            first = int(logits.argmax())
            c1 = time.perf_counter()
        finally:
            if writer is not None:
                writer.finish()  # also on failure: the sender thread must not be left waiting
        t_end = time.perf_counter()
        write_s, overlap = writer.overlap(c0, c1) if writer else (0.0, None)
        return PrefillResult(
            request_id=rid,
            first_token=first,
            prompt_tokens=n,
            cached_tokens=cached_tokens,
            computed_tokens=n - cached_tokens,
            matched_blocks=matched,
            fetched_blocks=good,
            written_blocks=(n_full - good) if writer and not writer.errors else 0,
            tail_tokens=tail_tokens,
            lookup_s=t1 - t0,
            fetch_s=t2 - t1,
            compute_s=c1 - c0,
            store_write_s=write_s,
            write_tail_s=t_end - c1,
            write_overlap=overlap,
            ttft_s=t_end - t_call,
            fetched_bytes=fetched.nbytes if fetched else 0,
            written_bytes=writer.bytes if writer else 0,
            store_errors=errors + (writer.errors if writer else []),
            keys=keys,
            logits=logits if keep_logits else None,
        )

    def status(self) -> dict[str, Any]:
        """Load for a scheduler: queued (waiting for the model), active (0 or 1),
        prompt tokens/s over the last window, and the measured compute speed."""
        with self._stats_lock:
            return {
                "role": "prefill",
                "queued": self._waiting,
                "active": self._active,
                "requests_done": self._done,
                "tokens_per_s": self._prompt_tokens.rate(),
                "compute_tokens_per_s": self._compute_rate.value,
                "cache_hit_ratio": (self._hit_tokens / self._total_tokens
                                    if self._total_tokens else None),
                "block_tokens": self.block_tokens,
                "namespace": self.namespace,
                "model": self.model.name,
                **kv_shape(self.model),
            }
