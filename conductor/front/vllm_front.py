"""The Conductor in front of vLLM instances: where each request runs, and in what order.

Disaggregated (``--vllm-prefill`` / ``--vllm-decode``), per request:

1. block keys of the prompt (``kvstore.block_keys`` with the connectors' namespace and
   block size, no ``extra``: plain token prompts without LoRA or cache salt), one
   ``prefix_match`` on the store, each instance's load (its ``/metrics``, polled), and the
   scheduler (``VllmConductor``, Algorithm 1 with per-instance calibrated costs) picks a
   (prefill, decode) pair or rejects (HTTP 429);
2. the prefill instance runs the prompt with ``max_tokens=1``;
3. the front waits until every full block of the prompt is in the store (see
   ``conductor.front.store_view``: polled, bounded by ``durable_timeout_s``; HTTP 504 if not);
4. the decode instance (``kv_consumer``) gets the client's request unchanged; its
   answer, streamed or not, is passed through.

A prompt shorter than one block has nothing to hand over: it goes straight to decode.

Colocated (``--vllm``): the instance with the lowest estimated TTFT = queue + prefill
of the tokens neither its own prefix cache (what the front sent there) nor the store
holds; the request goes there unchanged.

Runs on one asyncio loop: the scheduler's state is touched only from the loop, so it
needs no lock; store calls run in threads, instance calls are async.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from conductor.front.front_metrics import FrontMetrics, reason_label
from conductor.front.openai_api import (
    BadRequest,
    OpenStream,
    check_sampling,
    max_tokens,
    open_stream,
    post_json,
    prompt_token_ids,
    sse_error,
)
from conductor.front.store_view import NotDurable, StoreView
from conductor.front.vllm_instances import UpstreamError, VllmInstance
from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.scheduler import Conductor
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PrefillInstance
from conductor.scheduling.types import InstanceId, PrefillPlan, Request, RequestId, Slo
from kvstore.core.keys import BlockKey, block_keys

LOCAL_CACHE_BLOCKS = 4096


@dataclass(slots=True, kw_only=True, frozen=True)
class FrontConfig:
    namespace: str
    block_tokens: int
    slo: Slo
    policy: str = "global-cache-aware"
    rejection: str = "predictive"
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    durable_timeout_s: float = 30.0


@dataclass(slots=True, kw_only=True)
class JsonReply:
    status: int
    body: dict[str, Any]


@dataclass(slots=True, kw_only=True)
class StreamReply:
    """``chunks`` yields the answer; ``close`` ends the request's bookkeeping and its
    upstream response, once, whether ``chunks`` ran to the end, was interrupted, or never
    started (a client gone before the first byte): the HTTP layer always awaits it."""

    chunks: AsyncIterator[bytes]
    close: Callable[[], Awaitable[None]]


Reply = JsonReply | StreamReply


class _KnownPool:
    """The scheduler's global cache: the store's answer, asked once per request before
    scheduling (the scheduler itself is synchronous)."""

    def __init__(self) -> None:
        self.keys: tuple[bytes, ...] = ()
        self.blocks = 0

    def prefix_len(self, keys: Sequence[Any]) -> int:
        return self.blocks if tuple(keys) == self.keys else 0


class VllmConductor(Conductor):
    """Algorithm 1 with each prefill instance's own calibrated cost model."""

    def __init__(self, *, costs: dict[InstanceId, PolyCostModel], **kw: Any) -> None:
        super().__init__(**kw)
        self.costs = costs

    def plan(self, inst: PrefillInstance, req: Request, queue_s: float, local_blocks: int,
             fetch_blocks: int) -> PrefillPlan:
        bt = req.block_tokens
        cost = self.costs.get(inst.id, self.cost)
        cached = min((local_blocks + fetch_blocks) * bt, req.prompt_tokens - 1)
        return PrefillPlan(instance=inst.id, local_blocks=local_blocks,
                           fetch_blocks=fetch_blocks, cached_tokens=cached, queue_s=queue_s,
                           transfer_s=0.0,  # store loads are inside the observed prefill
                           prefill_s=cost.prefill_s(req.prompt_tokens - cached, cached))


class VllmFront:
    """Schedules and forwards OpenAI completions (see the module docstring)."""

    def __init__(self, *, config: FrontConfig, store: StoreView,
                 prefill: Sequence[str] = (), decode: Sequence[str] = (),
                 colocated: Sequence[str] = (), metrics: FrontMetrics | None = None) -> None:
        if colocated and (prefill or decode):
            raise ValueError("--vllm cannot be combined with --vllm-prefill/--vllm-decode")
        if not colocated and not (prefill and decode):
            raise ValueError("need --vllm-prefill and --vllm-decode, or --vllm")
        self.config = config
        self.store = store
        self.metrics = metrics or FrontMetrics()
        self.http = httpx.AsyncClient(limits=httpx.Limits(max_connections=1024,
                                                          max_keepalive_connections=256))
        self.prefill = {InstanceId(u): VllmInstance(u, role="prefill", http=self.http)
                        for u in prefill}
        self.decode = {InstanceId(u): VllmInstance(u, role="decode", http=self.http)
                       for u in decode}
        self.colocated = {InstanceId(u): VllmInstance(u, role="colocated", http=self.http)
                          for u in colocated}
        self.model = ""
        self.max_model_len = 0
        self._ids = itertools.count(1)
        self._pool = _KnownPool()
        self._conductor: VllmConductor | None = None
        self._local: dict[InstanceId, LocalPrefixCache] = {
            iid: LocalPrefixCache(LOCAL_CACHE_BLOCKS) for iid in self.colocated}
        """Colocated mode: the blocks the front sent to each instance (resized at start to
        the instance's KV capacity)."""
        self._prompt_tokens_seen = 0
        self._requests_seen = 0

    @property
    def disaggregated(self) -> bool:
        return not self.colocated

    def instances(self) -> list[VllmInstance]:
        return [*self.prefill.values(), *self.decode.values(), *self.colocated.values()]

    def timeout(self) -> httpx.Timeout:
        t = self.config.upstream_timeout_s
        return httpx.Timeout(t, connect=self.config.connect_timeout_s)

    # ---- start-up --------------------------------------------------------------------

    async def start(self) -> None:
        """Reads every instance's model and block size; refuses a mismatch."""
        shapes = {i.url: await i.read_shape() for i in self.instances()}
        models = {s.model for s in shapes.values()}
        if len(models) != 1:
            raise ValueError(f"instances serve different models: "
                             f"{ {u: s.model for u, s in shapes.items()} }")
        self.model = models.pop()
        self.max_model_len = min(s.max_model_len for s in shapes.values())
        for url, s in shapes.items():
            if s.block_size is not None and s.block_size != self.config.block_tokens:
                raise ValueError(f"--block-tokens {self.config.block_tokens} but {url} runs "
                                 f"vLLM with block size {s.block_size}: they must be equal "
                                 f"(the store's keys are per block)")
        if self.disaggregated:
            costs = {iid: i.calibration.cost() for iid, i in self.prefill.items()}
            self._conductor = VllmConductor(
                costs=costs,
                prefill=[PrefillInstance(id=i, cache=LocalPrefixCache(LOCAL_CACHE_BLOCKS))
                         for i in self.prefill],
                decode=[DecodeInstance(id=i, kv_capacity_tokens=s.kv_tokens or (1 << 20))
                        for i, s in ((i, shapes[d.url]) for i, d in self.decode.items())],
                cost=self._shared_cost(), policy=self.config.policy,
                rejection=self.config.rejection, slo=self.config.slo, pool=self._pool)
        else:
            for iid, inst in self.colocated.items():
                kv = shapes[inst.url].kv_tokens
                blocks = kv // self.config.block_tokens if kv else LOCAL_CACHE_BLOCKS
                self._local[iid] = LocalPrefixCache(blocks)
        await self.poll_loads()

    async def check_namespace(self) -> None:
        """Runs a one-block-plus-one-token prompt on every instance that saves and checks
        the block reached the store under ``--kv-namespace``: a mismatch would make every
        request wait for blocks that never come."""
        savers = list(self.prefill.values()) or list(self.colocated.values())
        probe = [7 + (time.time_ns() + i) % 200 for i in range(self.config.block_tokens + 1)]
        keys = block_keys(probe, self.config.block_tokens, self.config.namespace)
        for inst in savers:
            await post_json(inst, "/v1/completions",
                            {"model": self.model, "prompt": probe, "max_tokens": 1},
                            self.timeout())
            try:
                await self.store.wait_durable(keys, timeout_s=min(
                    10.0, self.config.durable_timeout_s), namespace=self.config.namespace)
            except NotDurable as exc:
                raise ValueError(f"{inst.url}: a probe prompt's block is not in the store "
                                 f"under --kv-namespace {self.config.namespace!r} "
                                 f"(--block-tokens {self.config.block_tokens}): {exc}"
                                 ) from None
            probe = probe[1:] + probe[:1]
            keys = block_keys(probe, self.config.block_tokens, self.config.namespace)

    async def poll_loads(self) -> None:
        for inst in self.instances():
            try:
                await inst.read_load()
            except UpstreamError:
                inst.load = None  # unknown: the front's own in-flight count still counts

    async def close(self) -> None:
        await self.http.aclose()

    def _shared_cost(self) -> PolyCostModel:
        """The scheduler's decode-side model: the slowest decode instance's step time."""
        steps = [d.calibration.cost().d_fixed for d in self.decode.values()]
        base = next(iter(self.prefill.values())).calibration.cost()
        return PolyCostModel(kv_bytes_per_token=base.kv_bytes_per_token, p_fixed=base.p_fixed,
                             p_token=base.p_token, net_bytes_per_s=base.net_bytes_per_s,
                             d_fixed=max(steps))

    # ---- requests --------------------------------------------------------------------

    async def complete(self, body: dict[str, Any], *, route: str) -> Reply:
        """Answers one ``/v1/completions`` body (token-id prompt)."""
        t0 = time.monotonic()
        try:
            check_sampling(body)
            tokens = prompt_token_ids(body)
            out_tokens = max_tokens(body)
            if self.max_model_len and len(tokens) + out_tokens > self.max_model_len:
                raise BadRequest(f"prompt ({len(tokens)} tokens) + max_tokens ({out_tokens}) "
                                 f"> the instances' max_model_len {self.max_model_len}")
        except BadRequest as exc:
            self.metrics.requests.labels(route, "bad_request").inc()
            return JsonReply(status=400, body=_err(400, str(exc)))
        body = {**body, "prompt": tokens, "model": self.model}
        keys = block_keys(tokens, self.config.block_tokens, self.config.namespace)
        stored = await self.store.prefix_len(keys)
        self.metrics.prompt_tokens.inc(len(tokens))
        self.metrics.prefix_tokens.inc(stored * self.config.block_tokens)
        self._prompt_tokens_seen += len(tokens)
        self._requests_seen += 1
        try:
            if self.disaggregated:
                return await self._disaggregated(body, route, tokens, keys, stored,
                                                 out_tokens, t0)
            return await self._colocated(body, route, tokens, keys, stored, out_tokens, t0)
        except UpstreamError as exc:
            self.metrics.requests.labels(route, "upstream_error").inc()
            return JsonReply(status=exc.status, body=_err(exc.status, str(exc)))
        except NotDurable as exc:
            self.metrics.requests.labels(route, "not_durable").inc()
            return JsonReply(status=504, body=_err(504, str(exc)))

    def _reject(self, route: str, reason: str) -> JsonReply:
        self.metrics.requests.labels(route, "rejected").inc()
        self.metrics.rejections.labels(reason_label(reason)).inc()
        return JsonReply(status=429, body=_err(429, f"request rejected: {reason}",
                                               reason=reason))

    def _mean_prompt(self) -> float:
        return self._prompt_tokens_seen / max(1, self._requests_seen)

    async def _disaggregated(self, body: dict[str, Any], route: str, tokens: list[int],
                             keys: list[BlockKey], stored: int, out_tokens: int, t0: float
                             ) -> Reply:
        c = self._conductor
        assert c is not None
        now = time.monotonic()
        for iid, inst in self.prefill.items():
            p = c.prefill_instance(iid)
            p.report_queue(now, max(p.queue_s(now),
                                    inst.queue_s(mean_prompt_tokens=self._mean_prompt())))
            c.costs[iid] = inst.calibration.cost()
        c.cost = self._shared_cost()
        self._pool.keys, self._pool.blocks = tuple(keys), stored
        rid = RequestId(next(self._ids))
        req = Request(id=rid, arrival_s=now, prompt_tokens=len(tokens),
                      output_tokens=out_tokens, block_keys=tuple(keys),
                      block_tokens=self.config.block_tokens)
        decision = c.schedule(req, now)
        if not decision.accepted:
            assert decision.reason is not None
            return self._reject(route, decision.reason)
        assert decision.prefill is not None and decision.decode is not None
        pinst, dinst = self.prefill[decision.prefill], self.decode[decision.decode]
        forgotten = False
        try:
            if keys:
                self.metrics.chosen.labels("prefill", pinst.id).inc()
                pre = {**body, "max_tokens": 1, "stream": False}
                pre.pop("stream_options", None)
                pre.pop("min_tokens", None)
                pinst.in_flight += 1
                tp = time.monotonic()
                try:
                    await post_json(pinst, "/v1/completions", pre, self.timeout())
                finally:
                    pinst.in_flight -= 1
                pinst.calibration.observe_prefill(
                    computed_tokens=len(tokens) - (decision.plan.cached_tokens
                                                   if decision.plan else 0),
                    seconds=time.monotonic() - tp)
                c.prefill_done(rid, time.monotonic())
                waited = await self.store.wait_durable(
                    keys, timeout_s=self.config.durable_timeout_s,
                    namespace=self.config.namespace)
                self.metrics.durability_wait.observe(waited)
            else:
                c.prefill_done(rid, time.monotonic())
            reason = c.decode_arrival(rid, time.monotonic(), prompt_tokens=len(tokens),
                                      output_tokens=out_tokens)
            if reason is not None:
                forgotten = True
                return self._reject(route, reason)
            d = c.decode_of(rid)
            d.start(rid, len(tokens), out_tokens, out_tokens)
        except BaseException:
            if not forgotten:
                c.forget(rid)
            raise
        self.metrics.chosen.labels("decode", dinst.id).inc()

        def done() -> None:
            d.finish(rid)
            c.forget(rid)

        return await self._forward(dinst, body, route, t0, done, out_tokens)

    async def _colocated(self, body: dict[str, Any], route: str, tokens: list[int],
                         keys: list[BlockKey], stored: int, out_tokens: int, t0: float
                         ) -> Reply:
        est, iid = self.choose_colocated(keys, stored, len(tokens))
        if self.config.rejection != "none" and est > self.config.slo.ttft_s:
            return self._reject(route, f"TTFT {est:.2f} s > SLO {self.config.slo.ttft_s:.2f} s")
        inst = self.colocated[iid]
        self._local[iid].use(keys)
        self.metrics.chosen.labels("colocated", inst.id).inc()
        return await self._forward(inst, body, route, t0, lambda: None, out_tokens,
                                   prefill_tokens=len(tokens) - min(
                                       stored * self.config.block_tokens, len(tokens) - 1))

    def choose_colocated(self, keys: Sequence[bytes], stored: int, prompt_tokens: int
                         ) -> tuple[float, InstanceId]:
        """The colocated instance with the lowest estimated TTFT and that estimate: its
        queue plus the prefill of what neither its own prefix cache (what the front sent
        there) nor the store (``stored`` leading blocks) holds. Ties go to the first."""
        best: tuple[float, InstanceId] | None = None
        for iid, inst in self.colocated.items():
            local = self._local[iid].prefix_len(keys)
            cached = min(max(local, stored) * self.config.block_tokens, prompt_tokens - 1)
            est = (inst.queue_s(mean_prompt_tokens=self._mean_prompt())
                   + inst.calibration.cost().prefill_s(prompt_tokens - cached, cached))
            if best is None or est < best[0]:
                best = (est, iid)
        assert best is not None
        return best

    async def _forward(self, inst: VllmInstance, body: dict[str, Any], route: str, t0: float,
                       done: Any, out_tokens: int, prefill_tokens: int = 0) -> Reply:
        """Sends ``body`` to ``inst``; calls ``done`` exactly once when the request is over
        (answered, failed, or cancelled by the client)."""
        inst.in_flight += 1
        if not body.get("stream"):
            ts = time.monotonic()
            try:
                answer = await post_json(inst, "/v1/completions", body, self.timeout())
            finally:
                inst.in_flight -= 1
                done()
            elapsed = time.monotonic() - ts
            n = int((answer.get("usage") or {}).get("completion_tokens") or 0)
            if n > 1:
                inst.calibration.observe_decode(tokens=n, seconds=elapsed)
            self.metrics.requests.labels(route, "ok").inc()
            self.metrics.e2e.observe(time.monotonic() - t0)
            return JsonReply(status=200, body=answer)
        try:
            stream = await open_stream(inst, "/v1/completions", body, self.timeout())
        except BaseException:
            inst.in_flight -= 1
            done()
            raise
        state = _StreamState()

        async def close() -> None:
            if state.closed:
                return
            state.closed = True
            inst.in_flight -= 1
            done()
            self.metrics.requests.labels(route, state.outcome).inc()
            if state.outcome == "ok":
                end = time.monotonic()
                self.metrics.e2e.observe(end - t0)
                if state.first is not None and state.events > 3:  # first token, [DONE]
                    inst.calibration.observe_decode(tokens=state.events - 2,
                                                    seconds=end - state.first)
            # Closing the upstream response drops the connection, so vLLM aborts the
            # request: a client that went away cancels its upstream request. Shielded: a
            # cancelled task's awaits are cancelled again (anyio), which would skip it.
            with anyio.CancelScope(shield=True):
                await stream.response.aclose()

        return StreamReply(chunks=self._pass_through(stream, t0, state, close,
                                                     prefill_tokens), close=close)

    async def _pass_through(self, stream: OpenStream, t0: float, state: _StreamState,
                            close: Callable[[], Awaitable[None]], prefill_tokens: int
                            ) -> AsyncIterator[bytes]:
        inst = stream.inst
        try:
            async for chunk in stream.chunks():
                if state.first is None:
                    state.first = time.monotonic()
                    self.metrics.ttft.observe(state.first - t0)
                    if prefill_tokens:
                        inst.calibration.observe_prefill(computed_tokens=prefill_tokens,
                                                         seconds=state.first - t0)
                state.events += chunk.count(b"data: ")
                yield chunk
            state.outcome = "ok"
        except (httpx.HTTPError, UpstreamError) as exc:
            state.outcome = "upstream_error"
            yield sse_error(f"{inst.role} instance {inst.url} failed mid-stream: "
                            f"{type(exc).__name__}: {exc}")
        finally:
            await close()

    def status(self) -> dict[str, Any]:
        return {
            "mode": "disaggregated" if self.disaggregated else "colocated",
            "model": self.model, "namespace": self.config.namespace,
            "block_tokens": self.config.block_tokens,
            "instances": {i.url: {"role": i.role, "in_flight": i.in_flight,
                                  "load": None if i.load is None else {
                                      "running": i.load.running, "waiting": i.load.waiting,
                                      "kv_usage": i.load.kv_usage},
                                  "calibration": i.calibration.snapshot()}
                          for i in self.instances()},
        }


@dataclass(slots=True)
class _StreamState:
    outcome: str = "cancelled"
    first: float | None = None
    events: int = 0
    closed: bool = False


def _err(status: int, message: str, *, reason: str | None = None) -> dict[str, Any]:
    from conductor.front.openai_api import error_body

    return error_body(status, message, reason=reason)
