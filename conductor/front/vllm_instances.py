"""vLLM OpenAI-server instances as the Conductor sees them: load, shape and speed.

``VllmInstance`` wraps one server URL with a pooled async HTTP client (httpx). It reads
the server's own Prometheus ``/metrics`` for its load (``vllm:num_requests_running``,
``vllm:num_requests_waiting``, ``vllm:kv_cache_usage_perc``) and its KV-cache shape
(``vllm:cache_config_info``: block size and number of blocks), and ``/v1/models`` for
the served model name and ``max_model_len``.

``read_connector`` asks the instance's kvstore connector for its namespace, block size
and role (``kvstore.integrations.vllm.describe``: one one-token request), and
``read_tokenizer`` whether the server tokenizes text itself (``POST /tokenize``; not with
``--skip-tokenizer-init``).

``Calibration`` turns what the front observes into a per-instance cost model: prefill
seconds per computed token (from each prefill's wall time and the tokens it did not
find cached) and the decode step time (from each streamed or timed decode). Until an
instance has been observed it uses conservative defaults, so the very first decisions
are estimates; each completed request moves them (exponential moving average).

``PendingPrefill`` is one request the front sent to an instance: it counts in the
instance's ``in_flight`` until it ``end``s, and its prefill's tokens count in the
instance's queue (``VllmInstance.queue_s``) until they are released, once, at its first
token or when the request ends, whichever comes first (each exactly once, whatever order
the front's paths call them in). A prefill's time to first token
covers the prompt tokens sent there before it and still pending as well as its own (the
engine runs them first), so it is observed as the time of both: the learnt rate stays a
rate of compute, not of compute plus whatever queue the instance had at the time (which
would make a busy instance look slow long after its queue drained, and the front avoid
it while the other queued). A prefill that reuses more cached tokens than it computes is
not observed: its time is mostly loading those tokens and fixed costs, which learnt as a
rate per computed token would make the instance that served the most cache hits look
the slowest (after a workload of cache hits, a run sent 3 of 16 misses to one instance
and 13 to the other).
"""

from __future__ import annotations

import itertools
import math
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import httpx

from conductor.front.kv_room import KvRoom, ResidentId
from conductor.scheduling.costs import PolyCostModel
from kvstore.integrations.vllm.describe import DESCRIBE_PARAM, REPLY_KEY

DEFAULT_PREFILL_S_PER_TOKEN = 1e-3
"""Before the first observation: 1000 prompt tokens/s (a small model on CPU does more)."""
DEFAULT_DECODE_STEP_S = 0.05
NET_BYTES_PER_S = 2e9
"""Loopback store reads (benchmarks/RESULTS.md); only weighs fetched blocks' transfer."""
HEAD_CREDIT = 0.5
"""The most of its own estimate a running prefill's progress takes off its instance's
queue (``VllmInstance.queue_s``). With all of it, a prefill running slower than the
calibration said looked finished once overdue, and the front sent the next prompt behind
it while the other instance was idle (one run's misses: TTFT p50 0.48 s against 0.28 s)."""
KV_BYTES_PER_TOKEN = 1
"""Placeholder for the transfer term: the store's loads are part of the observed prefill
time, so the cost model charges them nothing separately."""

_LINE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def parse_metrics(text: str) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Prometheus text exposition -> ``{name: [(labels, value), ...]}`` (comments skipped)."""
    out: dict[str, list[tuple[dict[str, str], float]]] = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        m = _LINE.match(line)
        if m is None:
            continue
        try:
            value = float(m.group(4))
        except ValueError:
            continue
        labels = dict(_LABEL.findall(m.group(3) or ""))
        out.setdefault(m.group(1), []).append((labels, value))
    return out


def metric_sum(metrics: dict[str, list[tuple[dict[str, str], float]]], name: str) -> float:
    """Sum over every label set of ``name`` (0 when absent)."""
    return sum(v for _, v in metrics.get(name, ()))


@dataclass(slots=True, kw_only=True, frozen=True)
class InstanceLoad:
    """One reading of an instance's ``/metrics``."""

    running: int
    waiting: int
    kv_usage: float
    """Fraction of the KV cache in use, 0..1."""
    external_hits: int
    """``vllm:external_prefix_cache_hits``: prompt tokens loaded from the store so far."""


@dataclass(slots=True, kw_only=True, frozen=True)
class InstanceShape:
    """What must agree between instances and the front: model, block size, capacity."""

    model: str
    max_model_len: int
    block_size: int | None
    """vLLM's block size from ``vllm:cache_config_info`` (None: not exported)."""
    kv_tokens: int | None
    """KV-cache capacity in tokens (num_gpu_blocks * block_size), None if not exported."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ConnectorInfo:
    """What an instance's kvstore connector says about itself."""

    namespace: str
    block_tokens: int
    kv_role: str
    """vLLM's ``kv_role``: ``kv_both``, ``kv_producer`` (saves) or ``kv_consumer`` (loads)."""
    shards: tuple[str, ...] = ()
    """The shards each block is stored in (an engine on several ranks); empty: one rank,
    each block under its own key (``kvstore.integrations.vllm.describe``)."""

    @property
    def saves(self) -> bool:
        return self.kv_role in ("kv_both", "kv_producer")

    @property
    def loads(self) -> bool:
        return self.kv_role in ("kv_both", "kv_consumer")


TOKENIZER_PROBE = "kvstore tokenizer probe: 0123 abc ABC \u00e9\u4e2d"
"""Text every instance tokenizes at start-up; all must give the same ids (one tokenizer)."""


@dataclass(slots=True, kw_only=True)
class _Ema:
    value: float | None = None
    alpha: float = 0.3
    samples: int = 0

    def add(self, x: float) -> None:
        if not math.isfinite(x) or x <= 0:
            return
        self.samples += 1
        self.value = x if self.value is None else (1 - self.alpha) * self.value + self.alpha * x


@dataclass(slots=True, kw_only=True)
class Calibration:
    """Per-instance speed learnt from observed requests (see the module docstring)."""

    prefill_s_per_token: _Ema = field(default_factory=_Ema)
    prefill_fixed_s: _Ema = field(default_factory=_Ema)
    decode_step_s: _Ema = field(default_factory=_Ema)

    def observe_prefill(self, *, computed_tokens: int, seconds: float) -> None:
        """A prefill that computed ``computed_tokens`` took ``seconds`` end to end. Tiny
        prefills measure the fixed overhead (HTTP, scheduling); the others the rate."""
        if computed_tokens <= 0 or seconds <= 0:
            return
        fixed = self.prefill_fixed_s.value or 0.0
        if computed_tokens < 16:
            self.prefill_fixed_s.add(seconds)
            return
        self.prefill_s_per_token.add(max(seconds - fixed, seconds / 2) / computed_tokens)

    def observe_decode(self, *, tokens: int, seconds: float) -> None:
        """``tokens`` generated after the first one took ``seconds``."""
        if tokens >= 1:
            self.decode_step_s.add(seconds / tokens)

    def decode_step(self) -> float:
        """Seconds per generated token (the default until a decode is observed)."""
        return self.decode_step_s.value or DEFAULT_DECODE_STEP_S

    def cost(self) -> PolyCostModel:
        return PolyCostModel(
            kv_bytes_per_token=KV_BYTES_PER_TOKEN,
            p_fixed=self.prefill_fixed_s.value or 0.0,
            p_token=self.prefill_s_per_token.value or DEFAULT_PREFILL_S_PER_TOKEN,
            net_bytes_per_s=NET_BYTES_PER_S,
            d_fixed=self.decode_step())

    def snapshot(self) -> dict[str, Any]:
        return {"prefill_s_per_token": self.prefill_s_per_token.value,
                "prefill_fixed_s": self.prefill_fixed_s.value,
                "decode_step_s": self.decode_step_s.value,
                "prefill_samples": self.prefill_s_per_token.samples,
                "decode_samples": self.decode_step_s.samples}


@dataclass(slots=True, kw_only=True)
class PendingPrefill:
    """See the module docstring. Made by ``VllmInstance.start_prefill``."""

    instance: VllmInstance
    tokens: int
    """Prompt tokens this prefill computes (its prompt less what is cached)."""
    ahead: int
    """Pending prefill tokens the front had sent to the instance before this one."""
    cached: int = 0
    """Prompt tokens it reuses (the instance's prefix cache or the store)."""
    seq: int = 0
    """Its place in the instance's order of pending prefills."""
    out_tokens: int = 0
    """Output tokens it may generate (all its answers)."""
    resident: ResidentId | None = None
    """Its blocks in the instance's ``kv_room`` until it ends (None: not counted there)."""
    released: bool = False
    ended: bool = False

    def release(self, *, seconds: float | None) -> None:
        """Takes the tokens out of the instance's queue (only the first call does);
        ``seconds``: the prefill's time to first token, observed into the calibration
        (None: it ended without one, or its time is not a prefill's). A first token also
        tells when its blocks are expected back: after its decode."""
        if self.released:
            return
        self.released = True
        self.instance.dequeue(self)
        room = self.instance.kv_room
        if seconds is not None and room is not None and self.resident is not None:
            room.expect_end(self.resident, self.instance.clock() + self.instance.decode_s(
                self.out_tokens))
        if seconds is not None and self.cached <= self.tokens:
            self.instance.calibration.observe_prefill(computed_tokens=self.ahead + self.tokens,
                                                      seconds=seconds)

    def end(self) -> None:
        """The request is over (answered, failed or cancelled): out of ``in_flight``, and
        its prefill out of the queue if no first token came (only the first call does)."""
        if self.ended:
            return
        self.ended = True
        self.release(seconds=None)
        self.instance.in_flight -= 1
        if self.instance.kv_room is not None and self.resident is not None:
            self.instance.kv_room.remove(self.resident)


class UpstreamError(Exception):
    """An instance failed or timed out; ``status`` is the HTTP status to answer with."""

    def __init__(self, message: str, *, status: int = 502) -> None:
        super().__init__(message)
        self.status = status


class VllmInstance:
    """One vLLM OpenAI server (see the module docstring)."""

    def __init__(self, url: str, *, role: str, http: httpx.AsyncClient,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self.url = url.rstrip("/")
        if "://" not in self.url:
            self.url = "http://" + self.url
        self.id = self.url
        self.role = role
        self.http = http
        self.calibration = Calibration()
        self.load: InstanceLoad | None = None
        self.shape: InstanceShape | None = None
        self.in_flight = 0
        """Requests the front has sent here and not seen finish."""
        self.kv_room: KvRoom | None = None
        """Its KV cache's room for the front's requests (``conductor.front.kv_room``), once
        the front knows its capacity and block size (None: never waits for room)."""
        self._ours_at_reading = 0
        """``pending_prefills`` when ``load`` was read (the fewer of before and after)."""
        self._pending: dict[int, PendingPrefill] = {}
        """The unreleased prefills in the order they were sent (the engine runs them first
        come, first served); the first is the head."""
        self._seq = itertools.count()
        self._head_since = 0.0
        """When the head began computing: when it was sent to an instance with nothing
        pending, or when the head before it released (``clock``)."""

    @property
    def pending_prefill_tokens(self) -> int:
        """Prompt tokens of prefills the front has sent here and not seen a first token of
        (``PendingPrefill``)."""
        return sum(p.tokens for p in self._pending.values())

    @property
    def pending_prefills(self) -> int:
        """How many prefills ``pending_prefill_tokens`` counts."""
        return len(self._pending)

    async def _get(self, path: str, timeout: float) -> httpx.Response:
        try:
            r = await self.http.get(self.url + path, timeout=timeout)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.role} instance {self.url}: GET {path} failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            raise UpstreamError(f"{self.role} instance {self.url}: GET {path} answered "
                                f"HTTP {r.status_code}")
        return r

    async def read_shape(self, timeout: float = 10.0) -> InstanceShape:
        models = (await self._get("/v1/models", timeout)).json()
        data = models.get("data") or []
        if not data:
            raise UpstreamError(f"{self.role} instance {self.url} serves no model")
        metrics = parse_metrics((await self._get("/metrics", timeout)).text)
        block = gpu_blocks = None
        for labels, _ in metrics.get("vllm:cache_config_info", ()):
            try:
                block = int(labels.get("block_size", ""))
                gpu_blocks = int(labels.get("num_gpu_blocks", ""))
            except ValueError:
                pass
        self.shape = InstanceShape(
            model=str(data[0]["id"]), max_model_len=int(data[0].get("max_model_len") or 0),
            block_size=block,
            kv_tokens=block * gpu_blocks if block and gpu_blocks else None)
        return self.shape

    async def read_connector(self, model: str, timeout: float = 60.0) -> ConnectorInfo | None:
        """The instance's kvstore connector's description (one request of one prompt
        token and one output token), None when no kvstore connector answers."""
        body = {"model": model, "prompt": [1], "max_tokens": 1,
                "kv_transfer_params": {DESCRIBE_PARAM: True}}
        try:
            r = await self.http.post(self.url + "/v1/completions", json=body,
                                     timeout=timeout)
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.role} instance {self.url}: the connector "
                                f"description request failed: {type(exc).__name__}: "
                                f"{exc}") from exc
        if r.status_code != 200:
            raise UpstreamError(f"{self.role} instance {self.url}: the connector "
                                f"description request answered HTTP {r.status_code}: "
                                f"{r.text[:300]}")
        params = r.json().get("kv_transfer_params") or {}
        info = params.get(REPLY_KEY) if isinstance(params, dict) else None
        if not isinstance(info, dict):
            return None
        try:
            shards = info.get("shards") or []
            if not isinstance(shards, list) or not all(isinstance(s, str) for s in shards):
                raise TypeError("shards")
            return ConnectorInfo(namespace=str(info["namespace"]),
                                 block_tokens=int(info["block_tokens"]),
                                 kv_role=str(info["kv_role"]), shards=tuple(shards))
        except (KeyError, TypeError, ValueError):
            raise UpstreamError(f"{self.role} instance {self.url}: a connector "
                                f"description it cannot have meant: {info!r}") from None

    async def read_tokenizer(self, model: str, timeout: float = 10.0) -> list[int] | None:
        """``TOKENIZER_PROBE``'s token ids by the instance's own tokenizer, None when the
        server has none (``--skip-tokenizer-init``: it refuses ``/tokenize``)."""
        try:
            r = await self.http.post(self.url + "/tokenize", timeout=timeout, json={
                "model": model, "prompt": TOKENIZER_PROBE, "add_special_tokens": False})
        except httpx.HTTPError as exc:
            raise UpstreamError(f"{self.role} instance {self.url}: POST /tokenize failed: "
                                f"{type(exc).__name__}: {exc}") from exc
        if r.status_code != 200:
            return None
        tokens = r.json().get("tokens")
        return [int(t) for t in tokens] if isinstance(tokens, list) else None

    async def read_load(self, timeout: float = 5.0) -> InstanceLoad:
        ours = self.pending_prefills
        m = parse_metrics((await self._get("/metrics", timeout)).text)
        self._ours_at_reading = min(ours, self.pending_prefills)
        self.load = InstanceLoad(
            running=int(metric_sum(m, "vllm:num_requests_running")),
            waiting=int(metric_sum(m, "vllm:num_requests_waiting")),
            kv_usage=metric_sum(m, "vllm:kv_cache_usage_perc"),
            external_hits=int(metric_sum(m, "vllm:external_prefix_cache_hits_total")))
        return self.load

    def start_prefill(self, tokens: int, *, cached: int = 0, keys: Sequence[bytes] = (),
                      out_tokens: int = 0, first_by: float | None = None) -> PendingPrefill:
        """Counts a request in ``in_flight`` until the returned handle ``end``s, and its
        prefill of ``tokens`` computed tokens (after ``cached`` reused ones) in this
        instance's queue until the handle is released. With ``first_by`` (its first
        token's expected time) and a ``kv_room``, its blocks (``keys``, its prompt's full
        blocks, and ``out_tokens``) count there until it ends, expected after its decode."""
        pending = PendingPrefill(instance=self, tokens=max(0, tokens),
                                 ahead=self.pending_prefill_tokens, cached=max(0, cached),
                                 seq=next(self._seq), out_tokens=max(0, out_tokens))
        if first_by is not None and self.kv_room is not None:
            pending.resident = self.kv_room.add(
                keys, prompt_tokens=pending.tokens + pending.cached,
                out_tokens=pending.out_tokens,
                ends_at=first_by + self.decode_s(pending.out_tokens))
        if not self._pending:
            self._head_since = self.clock()
        self._pending[pending.seq] = pending
        self.in_flight += 1
        return pending

    def dequeue(self, pending: PendingPrefill) -> None:
        """``pending`` released (``PendingPrefill.release`` calls this once): out of the
        order; if it was the head, the next one begins computing now."""
        head = next(iter(self._pending), None)
        del self._pending[pending.seq]
        if head == pending.seq:
            self._head_since = self.clock()

    def cost(self) -> PolyCostModel:
        """The calibrated speed (``Calibration.cost``)."""
        return self.calibration.cost()

    def decode_s(self, out_tokens: int) -> float:
        """The calibrated time to generate ``out_tokens`` after the first."""
        return max(0, out_tokens - 1) * self.calibration.decode_step()

    def kv_wait_s(self, keys: Sequence[bytes], *, prompt_tokens: int, out_tokens: int,
                  now: float) -> float:
        """Seconds until the KV cache has room for a request of ``keys`` (``KvRoom``); 0
        without a ``kv_room``."""
        if self.kv_room is None:
            return 0.0
        return self.kv_room.wait_s(keys, prompt_tokens=prompt_tokens, out_tokens=out_tokens,
                                   now=now)

    def queue_s(self, *, mean_prompt_tokens: float, now: float | None = None) -> float:
        """Seconds of prefill work ahead of a new request at ``now`` (default: ``clock``):
        the prefills the front has sent here and not seen a first token of, less what the
        head of them has computed since it began (at most ``HEAD_CREDIT`` of its own
        estimate: the estimate is a mean, and an overdue head's remaining time is unknown,
        not zero), plus other clients' work: the engine's waiting requests in the last
        ``/metrics`` reading beyond the front's own prefills pending at that reading, each
        at the mean prompt length. (The front's own are counted by what they compute: a
        waiting hit that loads its prefix is not a whole prompt of work, and the reading
        lags by up to one poll.) Requests past their first token (decoding) are not
        prefill work ahead.

        Without the head's progress, an instance that has just begun a cold prefill and
        one about to finish its own looked equally busy, and a burst of cold prompts could
        queue two on one instance while the other was nearly free."""
        cost = self.calibration.cost()
        waiting = self.load.waiting if self.load else 0
        others = max(0, waiting - self._ours_at_reading)
        ours = cost.prefill_s(self.pending_prefill_tokens, 0)
        head = next(iter(self._pending.values()), None)
        if head is not None:
            at = self.clock() if now is None else now
            ours -= min(max(0.0, at - self._head_since),
                        HEAD_CREDIT * cost.prefill_s(head.tokens, 0))
        return ours + others * cost.prefill_s(max(1, int(mean_prompt_tokens)), 0)

    def completions_url(self) -> str:
        return self.url + "/v1/completions"
