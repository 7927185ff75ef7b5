"""The decode worker: load a prompt's KV from the store, then greedy-decode with
continuous batching.

Load (in the caller's thread, so it overlaps other requests' decoding): every layer
of the prompt's full blocks and of its request-scoped tail is read with one
``get_batch_into`` straight into a cache sized for the whole generation. Whatever
is missing (evicted since prefill, a tail that was never written, or everything
when the store fails) is recomputed from the first missing token on, and reported
as ``recomputed_tokens``. The tail objects are removed once loaded.

Decode: one engine thread runs steps over the active batch; a request joins at the
next step boundary once loaded (up to ``max_batch`` at a time) and leaves as soon as
it is done, so short and long requests share steps without waiting for each other.
Projections and the MLP run batched, attention per sequence
(``LlamaModel.decode_batch``).

TBT: the gap between a request's successive tokens; the first gap runs from the
moment the request joined (its first token came from prefill).
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from kvstore import KVStoreError
from workers.kv_blocks import FetchResult, KVBlockStore, StoredBlocks, kv_shape
from workers.metrics import Ema, RateMeter
from workers.model import KVCache, LlamaModel

log = logging.getLogger("workers.decode")


@dataclass(slots=True, kw_only=True)
class DecodeResult:
    """``tokens`` starts with the prefill's first token and has at most
    ``max_new_tokens`` entries (fewer after a stop token); ``len(tbt_s) ==
    len(tokens) - 1``. ``fetched_tokens + recomputed_tokens == prompt_tokens``."""

    request_id: str
    tokens: list[int]
    prompt_tokens: int
    fetched_tokens: int
    recomputed_tokens: int
    tail_from_store: bool
    load_s: float
    queue_s: float
    decode_s: float
    tbt_s: list[float]
    mean_tbt_s: float | None
    mean_batch: float | None
    fetched_bytes: int
    logits: list[torch.Tensor] | None = field(default=None, repr=False)

    def to_json(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__slots__
                if name != "logits"}


@dataclass(slots=True, kw_only=True, eq=False)
class _Sequence:
    """One request inside the engine (compared by identity). Fields after ``cache`` are
    the engine's."""

    cache: KVCache
    out: list[int]
    max_new_tokens: int
    stop_token_ids: frozenset[int]
    keep_logits: bool
    logits: list[torch.Tensor] = field(default_factory=list)
    tbt: list[float] = field(default_factory=list)
    batch_sizes: list[int] = field(default_factory=list)
    t_joined: float = 0.0
    t_last: float = 0.0
    t_done: float = 0.0
    t_queued: float = 0.0
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)

    def finished(self) -> bool:
        return len(self.out) >= self.max_new_tokens or self.out[-1] in self.stop_token_ids


class DecodeWorker:
    """Decode against a kvstore ``Client``. Thread-safe; ``close()`` lets running requests
    finish and stops the engine thread."""

    def __init__(self, model: LlamaModel, store: StoredBlocks, *, block_tokens: int = 16,
                 namespace: str | None = None, max_batch: int = 8, remove_tail: bool = True,
                 staged: bool | None = None) -> None:
        if max_batch <= 0:
            raise ValueError(f"max_batch must be positive, got {max_batch}")
        self.model = model
        self.kv = KVBlockStore(store, model, block_tokens=block_tokens, namespace=namespace,
                               staged=staged)
        self.block_tokens = block_tokens
        self.namespace = self.kv.namespace
        self.max_batch = max_batch
        self.remove_tail = remove_tail
        self._cond = threading.Condition()
        # guarded by _cond:
        self._pending: list[_Sequence] = []
        self._active: list[_Sequence] = []
        self._loading = 0
        self._closing = False
        self._done = 0
        self._tokens = RateMeter()
        self._step_s = Ema()
        self._thread = threading.Thread(target=self._engine, name="decode-engine", daemon=True)
        self._thread.start()

    # ---- public ----------------------------------------------------------------------------

    def decode(self, token_ids: Sequence[int], first_token: int, max_new_tokens: int, *,
               request_id: str | None = None, stop_token_ids: Sequence[int] = (),
               keep_logits: bool = False) -> DecodeResult:
        """Generates up to ``max_new_tokens`` tokens after the prompt ``token_ids``, the
        first being ``first_token`` (from prefill). ``request_id`` names the prefill's
        tail objects; without it the tail is recomputed."""
        tokens = list(token_ids)
        c = self.model.config
        if not tokens:
            raise ValueError("token_ids must not be empty")
        if not isinstance(max_new_tokens, int) or max_new_tokens <= 0:
            raise ValueError(f"max_new_tokens must be a positive integer, got {max_new_tokens!r}")
        self.model.check_tokens([*tokens, first_token, *stop_token_ids])
        capacity = len(tokens) + max_new_tokens - 1
        if capacity > c.max_seq_len:
            raise ValueError(f"prompt of {len(tokens)} + {max_new_tokens} new tokens exceeds "
                             f"max_seq_len {c.max_seq_len}")
        rid = request_id or uuid.uuid4().hex
        with self._cond:
            if self._closing:
                raise RuntimeError("decode worker is shutting down")
            self._loading += 1
        try:
            t0 = time.perf_counter()
            cache = self.model.new_cache(capacity)
            fetched, tail_ok, nbytes = self._load(cache, tokens, request_id)
            load_s = time.perf_counter() - t0
        finally:
            with self._cond:
                self._loading -= 1
        seq = _Sequence(cache=cache, out=[first_token], max_new_tokens=max_new_tokens,
                        stop_token_ids=frozenset(stop_token_ids), keep_logits=keep_logits)
        if not seq.finished():
            seq.t_queued = time.perf_counter()
            with self._cond:
                self._pending.append(seq)
                self._cond.notify_all()
            seq.done.wait()
            if seq.error is not None:
                raise RuntimeError(f"decode failed: {seq.error}") from seq.error
        with self._cond:
            self._done += 1
        steps = seq.batch_sizes
        return DecodeResult(
            request_id=rid,
            tokens=seq.out,
            prompt_tokens=len(tokens),
            fetched_tokens=fetched,
            recomputed_tokens=len(tokens) - fetched,
            tail_from_store=tail_ok,
            load_s=load_s,
            queue_s=(seq.t_joined - seq.t_queued) if steps else 0.0,
            decode_s=(seq.t_done - seq.t_joined) if steps else 0.0,
            tbt_s=seq.tbt,
            mean_tbt_s=sum(seq.tbt) / len(seq.tbt) if seq.tbt else None,
            mean_batch=sum(steps) / len(steps) if steps else None,
            fetched_bytes=nbytes,
            logits=seq.logits if keep_logits else None,
        )

    def status(self) -> dict[str, Any]:
        """Load for a scheduler: queued (loading or waiting to join), the active batch,
        generated tokens/s over the last window and the mean step time."""
        with self._cond:
            return {
                "role": "decode",
                "queued": self._loading + len(self._pending),
                "active": len(self._active),
                "max_batch": self.max_batch,
                "requests_done": self._done,
                "tokens_per_s": self._tokens.rate(),
                "step_s": self._step_s.value,
                "block_tokens": self.block_tokens,
                "namespace": self.namespace,
                "model": self.model.name,
                **kv_shape(self.model),
            }

    def close(self) -> None:
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        self._thread.join()

    # ---- load ------------------------------------------------------------------------------

    def _load(self, cache: KVCache, tokens: list[int], request_id: str | None
              ) -> tuple[int, bool, int]:
        """Fills ``cache`` with the prompt's KV; (tokens fetched, tail fetched, bytes)."""
        B = self.block_tokens
        n = len(tokens)
        keys = self.kv.block_keys(tokens)
        tail_tokens = n - len(keys) * B
        tail = self.kv.tail_key(request_id, tokens) if tail_tokens and request_id else None
        try:
            r = self.kv.fetch(cache, keys, tail=tail, tail_tokens=tail_tokens)
        except KVStoreError as exc:  # the store is only a cache: recompute everything
            log.warning("request %s: fetching its KV failed (%s); recomputing", request_id, exc)
            r = FetchResult(blocks=0, tail=False, nbytes=0, seconds=0.0)
        fetched = r.blocks * B + (tail_tokens if r.tail else 0)
        if fetched < n:
            if fetched < len(keys) * B:
                log.info("request %s: %d of %d blocks in the store, recomputing %d tokens",
                         request_id, r.blocks, len(keys), n - fetched)
            cache.length = fetched
            self.model.prefill(tokens[fetched:], cache)
        cache.length = n
        if tail is not None and self.remove_tail:
            self.kv.remove_tail(tail)
        return fetched, r.tail, r.nbytes

    # ---- engine ----------------------------------------------------------------------------

    def _engine(self) -> None:
        while True:
            with self._cond:
                while not (self._pending or self._active or self._closing):
                    self._cond.wait()
                if not (self._pending or self._active):
                    return  # closing and idle
                joined = time.perf_counter()
                while self._pending and len(self._active) < self.max_batch:
                    seq = self._pending.pop(0)
                    seq.t_joined = seq.t_last = joined
                    self._active.append(seq)
                batch = list(self._active)
            try:
                self._step(batch)
            except BaseException as exc:  # handed to every waiting caller of this batch
                log.exception("decode step failed")
                with self._cond:
                    for s in batch:
                        if s in self._active:
                            s.error = exc
                            self._active.remove(s)
                            s.done.set()

    def _step(self, batch: list[_Sequence]) -> None:
        t0 = time.perf_counter()
        logits = self.model.decode_batch([s.out[-1] for s in batch], [s.cache for s in batch])
        now = time.perf_counter()
        nexts = logits.argmax(dim=-1).tolist()
        with self._cond:
            self._step_s.add(now - t0)
            self._tokens.add(len(batch))
            for s, token, row in zip(batch, nexts, logits, strict=True):
                s.out.append(int(token))
                if s.keep_logits:
                    s.logits.append(row.clone())
                s.tbt.append(now - s.t_last)
                s.t_last = now
                s.batch_sizes.append(len(batch))
                if s.finished():
                    s.t_done = now
                    self._active.remove(s)
                    s.done.set()
