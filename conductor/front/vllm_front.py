"""The Conductor in front of vLLM instances: where each request runs, and in what order.

At start (``start``, ``conductor.front.vllm_startup``) the front learns from the
instances the served model, the connectors' namespace and block size (the keys it
computes are theirs) and whether they tokenize text themselves.

Disaggregated (``--vllm-prefill`` / ``--vllm-decode``), per request:

1. block keys of the prompt's token ids (``kvstore.block_keys`` with the learnt
   namespace and block size, no ``extra``: prompts without LoRA or cache salt; a text or
   chat request's ids come from an instance's own ``/tokenize``), one ``prefix_match``
   on the store, each instance's load (its ``/metrics``, polled), and the scheduler
   (``VllmConductor``, Algorithm 1 with per-instance calibrated costs, preferring the
   session's instance when it meets the SLO) picks a (prefill, decode) pair or rejects
   (HTTP 429);
2. the prefill instance runs the client's request with ``max_tokens=1``, on the same
   route (completions or chat), so it computes the very tokens the decode instance will;
3. the front waits until every full block of the prompt is in the store (see
   ``conductor.front.store_view``: woken by the nodes' KV events, or polled; bounded by
   ``durable_timeout_s``; HTTP 504 if not);
4. the decode instance (``kv_consumer``) gets the client's request, its
   ``kv_transfer_params`` telling the connector that every full block is stored
   (``kvstore_stored_blocks``, so it does not ask the store again); its answer, streamed
   or not, is passed through as it comes.

A prompt shorter than one block has nothing to hand over: it goes straight to decode.

Colocated (``--vllm``): the instance with the lowest estimated TTFT
(``conductor.front.colocated_routing``: queue + prefill of the tokens neither its own
prefix cache nor the store holds, or, when another instance is computing a longer prefix
of the prompt, the wait for that prefix's save; the session's instance when it meets the
SLO); the request goes there with the store's answer in ``kv_transfer_params``
(``kvstore_stored_blocks``: the instance's connector takes it instead of a lookup of its
own), after the save it waits for if any. The prefill instance of a disaggregated pair
gets the same.

An instance's own refusal of a request (its 4xx) reaches the client verbatim.

Runs on one asyncio loop: the scheduler's state is touched only from the loop, so it
needs no lock; store calls run in threads, instance calls are async.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any

import anyio
import httpx

from conductor.front.colocated_routing import (
    ColocatedChoice,
    ColocatedRouter,
    ComputingPrefixes,
)
from conductor.front.disaggregated_plan import KnownPool
from conductor.front.disaggregated_plan import VllmConductor as VllmConductor  # re-exported
from conductor.front.front_metrics import FrontMetrics, reason_label
from conductor.front.kv_room import KvRoom
from conductor.front.openai_api import (
    DEFAULT_MAX_TOKENS,
    BadRequest,
    InstanceAnswer,
    OpenStream,
    check_sampling,
    choices,
    open_stream,
    output_tokens,
    post_json,
    prefill_body,
    prompt_token_ids,
    sse_error,
    with_retention,
    with_stored,
)
from conductor.front.replies import JsonReply as JsonReply  # re-exported
from conductor.front.replies import Reply as Reply  # re-exported
from conductor.front.replies import StreamReply as StreamReply  # re-exported
from conductor.front.session_cache import SessionCache
from conductor.front.sessions import PreferSession as PreferSession  # re-exported
from conductor.front.sessions import SessionAffinity
from conductor.front.store_view import NotDurable, StoreView
from conductor.front.vllm_instances import (
    Calibration,
    UpstreamError,
    VllmInstance,
)
from conductor.front.vllm_startup import learn
from conductor.scheduling.costs import PolyCostModel
from conductor.scheduling.policies import make_policy
from conductor.scheduling.state import DecodeInstance, LocalPrefixCache, PrefillInstance
from conductor.scheduling.types import InstanceId, Request, RequestId, Slo
from kvstore.core.keys import BlockKey, block_keys
from kvstore.integrations.vllm.ranks import shard_chains

LOCAL_CACHE_BLOCKS = 4096
EVENTS_LIVE_S = 3.0
"""How long after the start-up probe the first KV event may take before the front polls."""
TOKENIZE_CHAT_FIELDS = ("messages", "add_generation_prompt", "continue_final_message",
                        "add_special_tokens", "chat_template", "chat_template_kwargs",
                        "tools", "mm_processor_kwargs", "media_io_kwargs", "model")
"""What of a chat request vLLM's ``/tokenize`` needs to render the prompt the chat route
will (its chat template options)."""


ROUTES = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
"""The instance path of each route the front schedules."""


@dataclass(slots=True, kw_only=True, frozen=True)
class FrontConfig:
    namespace: str = ""
    """The connectors' namespace; "": learn it from the instances (``--kv-namespace``)."""
    block_tokens: int = 0
    """vLLM's block size; 0: learn it from the instances (``--block-tokens``)."""
    slo: Slo
    policy: str = "global-cache-aware"
    rejection: str = "predictive"
    upstream_timeout_s: float = 600.0
    connect_timeout_s: float = 5.0
    durable_timeout_s: float = 30.0
    session_ttl_s: float = 600.0
    """How long the front remembers a session's instance (routing affinity)."""
    max_sessions: int = 100_000
    session_retain_s: float = 0.0
    """``--session-ttl``: how long a session's blocks stay retained in the store after its
    last turn (``conductor.front.session_cache``); 0: sessions keep no cache."""


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
        # One calibration for the colocated instances: they serve one model (checked at
        # start), and a per-instance estimate went stale on the instance it had made look
        # slow, since nothing was sent there to correct it (0 of 48 misses in a run).
        shared = Calibration()
        for inst in self.colocated.values():
            inst.calibration = shared
        self.model = ""
        self.max_model_len = 0
        self.namespace = config.namespace
        """The connectors' namespace (learnt at ``start``, or the flag until then)."""
        self.block_tokens = config.block_tokens
        self.shards: tuple[str, ...] = ()
        """The connectors' shards (engines on several ranks): a block is stored when every
        shard of it is (learnt at ``start``)."""
        self.instances_tokenize = False
        """The instances tokenize text: text and chat requests are forwarded unchanged."""
        self.models_body: dict[str, Any] = {}
        """An instance's ``/v1/models`` answer (``max_model_len``: the smallest)."""
        self.sessions = SessionAffinity(max_sessions=config.max_sessions,
                                        ttl_s=config.session_ttl_s)
        self.session_cache = SessionCache(store.store, ttl_s=config.session_retain_s,
                                          max_sessions=config.max_sessions)
        self._session_work: set[asyncio.Future[None]] = set()
        self._prefer: PreferSession | None = None
        self._next_tokenizer = itertools.count()
        self._ids = itertools.count(1)
        self._pool = KnownPool()
        self._conductor: VllmConductor | None = None
        self._local: dict[InstanceId, LocalPrefixCache] = {
            iid: LocalPrefixCache(LOCAL_CACHE_BLOCKS) for iid in self.colocated}
        """Colocated mode: the blocks the front sent to each instance (resized at start to
        the instance's KV capacity)."""
        self._computing = ComputingPrefixes()
        self._router: ColocatedRouter | None = None
        """Built once the block size is known (``set_block_tokens``): from the config, or
        learnt from the instances at ``start``."""
        if config.block_tokens:
            self.set_block_tokens(config.block_tokens)
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
        """Learns the model, namespace and block size from the instances and checks they
        agree (``conductor.front.vllm_startup``), then builds the scheduler."""
        got = await learn(self.instances(), namespace=self.config.namespace,
                          block_tokens=self.config.block_tokens)
        self.model, self.max_model_len = got.model, got.max_model_len
        self.namespace = got.namespace
        self.set_block_tokens(got.block_tokens)
        self.shards = got.shards
        self.instances_tokenize = got.instances_tokenize
        first = self.instances()[0]
        models = (await first.http.get(first.url + "/v1/models", timeout=10.0)).json()
        for m in models.get("data") or []:
            if isinstance(m, dict) and m.get("id") == self.model:
                m["max_model_len"] = self.max_model_len
        self.models_body = models
        shapes = got.shapes
        if self.disaggregated:
            costs = {iid: i.calibration.cost() for iid, i in self.prefill.items()}
            self._prefer = PreferSession(make_policy(self.config.policy),
                                         self.config.slo.ttft_s)
            self._conductor = VllmConductor(
                costs=costs,
                prefill=[PrefillInstance(id=i, cache=LocalPrefixCache(LOCAL_CACHE_BLOCKS))
                         for i in self.prefill],
                decode=[DecodeInstance(id=i, kv_capacity_tokens=s.kv_tokens or (1 << 20))
                        for i, s in ((i, shapes[d.url]) for i, d in self.decode.items())],
                cost=self._shared_cost(), policy=self._prefer,
                rejection=self.config.rejection, slo=self.config.slo, pool=self._pool)
        else:
            for iid, inst in self.colocated.items():
                kv = shapes[inst.url].kv_tokens
                inst.kv_room = (KvRoom(capacity_tokens=kv, block_tokens=self.block_tokens)
                                if kv else None)
                self._local[iid] = LocalPrefixCache(
                    inst.kv_room.capacity_blocks if inst.kv_room else LOCAL_CACHE_BLOCKS)
        await self.poll_loads()

    def set_block_tokens(self, block_tokens: int) -> None:
        """Tokens per block (configured, or learnt from the instances), and the colocated
        router that counts stored blocks in tokens by it."""
        self.block_tokens = block_tokens
        self._router = ColocatedRouter(instances=self.colocated, local=self._local,
                                       computing=self._computing, block_tokens=block_tokens)

    def stored_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """The keys the store holds the blocks ``keys`` under: every shard's (engines on
        several ranks), else ``keys`` themselves."""
        return [k for chain in shard_chains(keys, self.shards) for k in chain]

    def session_keys(self, keys: Sequence[bytes]) -> list[bytes]:
        """``stored_keys`` block by block (every shard's key of block 0, then of block 1, ...),
        so that a session's turns still share a prefix of this list when engines have
        several ranks."""
        return [k for block in zip(*shard_chains(keys, self.shards), strict=True) for k in block]

    async def check_namespace(self) -> None:
        """Runs a one-block-plus-one-token prompt on every instance that saves and checks
        the block reached the store under the learnt namespace: the whole path (the
        connector's keys, its saves, the front's store) works before the first client's
        request relies on it."""
        savers = list(self.prefill.values()) or list(self.colocated.values())
        probe = [7 + (time.time_ns() + i) % 200 for i in range(self.block_tokens + 1)]
        keys = block_keys(probe, self.block_tokens, self.namespace)
        for inst in savers:
            await post_json(inst, "/v1/completions",
                            {"model": self.model, "prompt": probe, "max_tokens": 1},
                            self.timeout())
            try:
                await self.store.wait_durable(self.stored_keys(keys), timeout_s=min(
                    10.0, self.config.durable_timeout_s), namespace=self.namespace)
            except NotDurable as exc:
                raise ValueError(f"{inst.url}: a probe prompt's block is not in the store "
                                 f"under namespace {self.namespace!r} (block "
                                 f"{self.block_tokens}): is the Conductor's --store / "
                                 f"--etcd the connectors' store? {exc}") from None
            probe = probe[1:] + probe[:1]
            keys = block_keys(probe, self.block_tokens, self.namespace)

    async def check_events(self, within_s: float = EVENTS_LIVE_S) -> None:
        """After the probe (whose saves the nodes announce): when no KV event arrived, the
        subscription does not reach the nodes (an endpoint bound where the front cannot
        connect): the durability wait polls instead, said on stdout."""
        events = self.store.events
        if events is None:
            return
        deadline = time.monotonic() + within_s
        while events.batches == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        if events.batches == 0:
            print(f"conductor: no KV events arrived from {events.describe()} within "
                  f"{within_s:g} s of the probe's saves: durability by polling the store",
                  flush=True)
            self.store.use_events(None)
            events.close()

    async def poll_loads(self) -> None:
        for inst in self.instances():
            try:
                await inst.read_load()
            except UpstreamError:
                inst.load = None  # unknown: the front's own in-flight count still counts

    async def close(self) -> None:
        await self.sessions_settled()
        await self.http.aclose()

    # ---- sessions --------------------------------------------------------------------

    def _session_arrival(self, session: str | None, keys: list[BlockKey]
                         ) -> asyncio.Future[int] | None:
        """Starts the prefetch of a session's last turn's blocks (``SessionCache.arrive``)
        beside the request's own store lookup; never waited for by the request."""
        if session is None or not self.session_cache.enabled:
            return None
        return asyncio.ensure_future(asyncio.to_thread(self.session_cache.arrive, session,
                                                       self.session_keys(keys)))

    def _turn_over(self, job: _Job) -> None:
        """The request reached an instance and is over: its session's blocks are retained
        in the background (``_end_turn``)."""
        if job.session is None or not self.session_cache.enabled:
            return
        work = asyncio.ensure_future(self._end_turn(job))
        self._session_work.add(work)
        work.add_done_callback(self._session_work.discard)

    async def _end_turn(self, job: _Job) -> None:
        if job.arrival is not None:
            with contextlib.suppress(Exception):
                await job.arrival
        if self.colocated and job.keys and not job.retained:
            # The connector saves as the request runs and may finish after it: the blocks
            # to retain must be stored first (disaggregated, the decode already waited).
            # Not when it saved them retained (``with_retention``): this retain refreshes.
            with contextlib.suppress(NotDurable):
                await self.store.wait_durable(self.stored_keys(job.keys), timeout_s=min(
                    10.0, self.config.durable_timeout_s), namespace=self.namespace)
        await asyncio.to_thread(self.session_cache.end_turn, job.session,
                                self.session_keys(job.keys))

    async def sessions_settled(self) -> None:
        """Returns once every turn's session work started so far is done."""
        while self._session_work:
            await asyncio.gather(*list(self._session_work), return_exceptions=True)

    async def sweep_sessions(self) -> int:
        """Releases sessions idle past ``--session-ttl`` (``SessionCache.sweep``)."""
        if not self.session_cache.enabled:
            return 0
        return await asyncio.to_thread(self.session_cache.sweep)

    async def delete_session(self, session: str) -> bool:
        """``DELETE /v1/sessions/{id}``: forgets its instance and releases its blocks;
        False if neither was known."""
        await self.sessions_settled()  # a turn that just ended is part of the session
        routed = self.sessions.forget(session)
        kept = await asyncio.to_thread(self.session_cache.delete, session)
        return routed or kept

    def _shared_cost(self) -> PolyCostModel:
        """The scheduler's decode-side model: the slowest decode instance's step time."""
        steps = [d.calibration.cost().d_fixed for d in self.decode.values()]
        base = next(iter(self.prefill.values())).calibration.cost()
        return PolyCostModel(kv_bytes_per_token=base.kv_bytes_per_token, p_fixed=base.p_fixed,
                             p_token=base.p_token, net_bytes_per_s=base.net_bytes_per_s,
                             d_fixed=max(steps))

    # ---- requests --------------------------------------------------------------------

    async def tokenize(self, body: dict[str, Any], *, chat: bool) -> list[int]:
        """A text or chat request's prompt token ids, by an instance's own ``/tokenize``
        (the ids that instance computes: its tokenizer and chat template). Raises
        ``InstanceAnswer`` with the instance's refusal (the client's request was bad),
        ``UpstreamError`` when no instance answers."""
        if chat:
            ask = {k: body[k] for k in TOKENIZE_CHAT_FIELDS if k in body}
        else:
            ask = {k: body[k] for k in ("prompt", "add_special_tokens") if k in body}
        ask.setdefault("model", self.model)
        insts = list(self.prefill.values()) or list(self.colocated.values())
        inst = insts[next(self._next_tokenizer) % len(insts)]
        answer = await post_json(inst, "/tokenize", ask, self.timeout())
        tokens = answer.get("tokens")
        if not isinstance(tokens, list) or not tokens:
            raise InstanceAnswer(400, _err(400, "the prompt encodes to no tokens"))
        return [int(t) for t in tokens]

    async def complete(self, body: dict[str, Any], *, route: str,
                       tokens: list[int] | None = None, session: str | None = None,
                       path: str | None = None) -> Reply:
        """Answers one request of ``route`` (``completions`` or ``chat``, the metrics'
        label). ``tokens``: the prompt's token ids when the body's prompt is text or chat
        (``tokenize``); None for a token-id prompt. ``session``: the
        ``X-Session-Affinity`` hint. ``path``: the instances' route it goes to (default
        the route's own; a chat the front renders itself goes to completions)."""
        t0 = time.monotonic()
        path = path or ROUTES[route]
        chat = path == ROUTES["chat"]
        try:
            check_sampling(body)
            if tokens is None:
                tokens = prompt_token_ids(body)
                body = {**body, "prompt": tokens}
            asked = output_tokens(body, chat=chat)
            if (asked is not None and self.max_model_len
                    and len(tokens) + asked > self.max_model_len):
                raise BadRequest(f"prompt ({len(tokens)} tokens) + max_tokens ({asked}) "
                                 f"> the instances' max_model_len {self.max_model_len}")
            out_tokens = (asked or DEFAULT_MAX_TOKENS) * choices(body)
        except BadRequest as exc:
            self.metrics.requests.labels(route, "bad_request").inc()
            return JsonReply(status=400, body=_err(400, str(exc)))
        body = {"model": self.model, **body}
        keys = block_keys(tokens, self.block_tokens, self.namespace)
        arrival = self._session_arrival(session, keys)
        retained = False
        if session is not None and self.session_cache.enabled:
            body, retained = with_retention(body, self.session_cache.ttl_s)
        stored = await self.store.prefix_len(keys, self.shards)
        self.metrics.prompt_tokens.inc(len(tokens))
        self.metrics.prefix_tokens.inc(stored * self.block_tokens)
        self._prompt_tokens_seen += len(tokens)
        self._requests_seen += 1
        job = _Job(body=body, route=route, path=path, tokens=tokens, keys=keys, stored=stored,
                   out_tokens=out_tokens, t0=t0, session=session, arrival=arrival,
                   retained=retained)
        try:
            if self.disaggregated:
                return await self._disaggregated(job)
            return await self._colocated(job)
        except InstanceAnswer as exc:
            self.metrics.requests.labels(route, "bad_request").inc()
            return JsonReply(status=exc.status, body=exc.body)
        except UpstreamError as exc:
            self.metrics.requests.labels(route, "upstream_error").inc()
            return JsonReply(status=exc.status, body=_err(exc.status, str(exc)))
        except NotDurable as exc:
            self.metrics.requests.labels(route, "not_durable").inc()
            return JsonReply(status=504, body=_err(504, str(exc)))

    def _follow_session(self, session: str, known: InstanceId | None, went: InstanceId,
                        now: float) -> None:
        outcome = "new" if known is None else "kept" if went == known else "moved"
        self.metrics.sessions.labels(outcome).inc()
        self.sessions.remember(session, went, now)

    def _reject(self, route: str, reason: str) -> JsonReply:
        self.metrics.requests.labels(route, "rejected").inc()
        self.metrics.rejections.labels(reason_label(reason)).inc()
        return JsonReply(status=429, body=_err(429, f"request rejected: {reason}",
                                               reason=reason))

    def _mean_prompt(self) -> float:
        return self._prompt_tokens_seen / max(1, self._requests_seen)

    async def _disaggregated(self, job: _Job) -> Reply:
        body, route, tokens, keys = job.body, job.route, job.tokens, job.keys
        stored, out_tokens, session = job.stored, job.out_tokens, job.session
        c = self._conductor
        assert c is not None and self._prefer is not None
        now = time.monotonic()
        for iid, inst in self.prefill.items():
            p = c.prefill_instance(iid)
            p.report_queue(now, max(p.queue_s(now),
                                    inst.queue_s(mean_prompt_tokens=self._mean_prompt(),
                                                 now=now)))
            c.costs[iid] = inst.calibration.cost()
        c.cost = self._shared_cost()
        self._pool.keys, self._pool.blocks = tuple(keys), stored
        rid = RequestId(next(self._ids))
        req = Request(id=rid, arrival_s=now, prompt_tokens=len(tokens),
                      output_tokens=out_tokens, block_keys=tuple(keys),
                      block_tokens=self.block_tokens)
        self._prefer.preferred = (self.sessions.instance(session, now)
                                  if session is not None else None)
        decision = c.schedule(req, now)
        if not decision.accepted:
            assert decision.reason is not None
            return self._reject(route, decision.reason)
        assert decision.prefill is not None and decision.decode is not None
        pinst, dinst = self.prefill[decision.prefill], self.decode[decision.decode]
        if session is not None:
            self._follow_session(session, self._prefer.preferred, decision.prefill, now)
        forgotten = False
        try:
            if keys:
                self.metrics.chosen.labels("prefill", pinst.id).inc()
                pre = with_stored(prefill_body(body), stored)
                cached = decision.plan.cached_tokens if decision.plan else 0
                pending = pinst.start_prefill(len(tokens) - cached, cached=cached)
                tp = time.monotonic()
                try:
                    await post_json(pinst, job.path, pre, self.timeout())
                    pending.release(seconds=time.monotonic() - tp)
                finally:
                    pending.end()
                c.prefill_done(rid, time.monotonic())
                waited = await self.store.wait_durable(
                    self.stored_keys(keys), timeout_s=self.config.durable_timeout_s,
                    namespace=self.namespace)
                self.metrics.durability_wait.observe(waited)
                self.metrics.durability_waits.labels(self.store.waits_by).inc()
            else:
                c.prefill_done(rid, time.monotonic())
            reason = c.decode_arrival(rid, time.monotonic(), prompt_tokens=len(tokens),
                                      output_tokens=out_tokens)
            if reason is not None:
                forgotten = True
                return self._reject(route, reason)
            d = c.decode_of(rid)
            d.start(rid, len(tokens), out_tokens, out_tokens)
            # Every full block is stored now (step 3): the decode instance need not ask.
            job.body = with_stored(body, len(keys))
        except BaseException:
            if not forgotten:
                c.forget(rid)
            raise
        self.metrics.chosen.labels("decode", dinst.id).inc()

        def done() -> None:
            d.finish(rid)
            c.forget(rid)

        return await self._forward(dinst, job, done)

    async def _colocated(self, job: _Job) -> Reply:
        route, tokens, keys, stored, session = (job.route, job.tokens, job.keys, job.stored,
                                                job.session)
        now = time.monotonic()
        prefer = self.sessions.instance(session, now) if session is not None else None
        choice = self.choose_colocated(keys, stored, len(tokens), prefer=prefer, now=now,
                                       out_tokens=job.out_tokens)
        if self.config.rejection != "none" and choice.est_s > self.config.slo.ttft_s:
            return self._reject(
                route, f"TTFT {choice.est_s:.2f} s > SLO {self.config.slo.ttft_s:.2f} s")
        iid = choice.instance
        inst = self.colocated[iid]
        if session is not None:
            self._follow_session(session, prefer, iid, now)
        self._local[iid].use(keys)
        self.metrics.chosen.labels("colocated", inst.id).inc()
        ready = None
        if choice.await_blocks:
            def ready() -> Awaitable[None]:
                return self._await_saved(job, choice.await_blocks, choice.est_s)
        else:
            job.body = with_stored(job.body, stored)  # the instance need not ask the store
        computes = len(keys) * self.block_tokens > choice.cached_tokens
        return await self._forward(inst, job, lambda: None,
                                   prefill_tokens=len(tokens) - choice.cached_tokens,
                                   cached_tokens=choice.cached_tokens, ready=ready,
                                   computing_until=now + choice.est_s if computes else None,
                                   first_by=now + choice.est_s)

    async def _await_saved(self, job: _Job, blocks: int, est_s: float) -> None:
        """Holds ``job`` until its first ``blocks`` blocks, which another instance is
        computing, are durable in the store (``colocated_routing``); then the instance
        is told they are stored. Past twice the estimate (at least a second) it goes on
        with what the store held on arrival: the request computes the rest itself."""
        try:
            await self.store.wait_durable(self.stored_keys(job.keys[:blocks]),
                                          timeout_s=max(1.0, 2 * est_s),
                                          namespace=self.namespace)
        except NotDurable:
            self.metrics.save_waits.labels("timed_out").inc()
            job.body = with_stored(job.body, job.stored)
            return
        self.metrics.save_waits.labels("loaded").inc()
        job.body = with_stored(job.body, blocks)

    def choose_colocated(self, keys: Sequence[bytes], stored: int, prompt_tokens: int, *,
                         prefer: InstanceId | None = None, now: float | None = None,
                         out_tokens: int = 0) -> ColocatedChoice:
        """Where a colocated request runs (``conductor.front.colocated_routing``): the
        lowest estimated TTFT; ``prefer`` (a session's instance) when it meets the SLO."""
        if self._router is None:
            raise RuntimeError("the front has not learnt the block size yet (start it)")
        return self._router.choose(
            keys, stored, prompt_tokens, mean_prompt_tokens=self._mean_prompt(),
            now=time.monotonic() if now is None else now, out_tokens=out_tokens,
            prefer=prefer, prefer_within_s=self.config.slo.ttft_s)

    async def _forward(self, inst: VllmInstance, job: _Job, request_done: Callable[[], None],
                       prefill_tokens: int = 0, cached_tokens: int = 0,
                       ready: Callable[[], Awaitable[None]] | None = None,
                       computing_until: float | None = None,
                       first_by: float | None = None) -> Reply:
        """Sends the client's request to ``inst`` (once ``ready()`` is done, counted in the
        instance's queue meanwhile); calls ``request_done`` exactly once when the request
        is over (answered, failed, or cancelled by the client), and then ends its session's
        turn (``_turn_over``). ``computing_until``: the request computes blocks of its
        prompt, expected done then; other requests may wait for their save
        (``ComputingPrefixes``) until it is over. ``first_by``: its first token's expected
        time; its blocks count in the instance's KV room until it is over
        (``VllmInstance.start_prefill``)."""
        computing = (self._computing.add(InstanceId(inst.id), job.keys, computing_until)
                     if computing_until is not None else None)

        def done() -> None:
            if computing is not None:
                self._computing.discard(computing)
            request_done()
            self._turn_over(job)

        pending = inst.start_prefill(prefill_tokens, cached=cached_tokens, keys=job.keys,
                                     out_tokens=job.out_tokens, first_by=first_by)
        if ready is not None:
            try:
                await ready()
            except BaseException:
                pending.end()
                done()
                raise
        body, route, t0 = job.body, job.route, job.t0
        if not body.get("stream"):
            ts = time.monotonic()
            try:
                answer = await post_json(inst, job.path, body, self.timeout())
            finally:
                pending.end()
                done()
            elapsed = time.monotonic() - ts
            n = int((answer.get("usage") or {}).get("completion_tokens") or 0)
            if n > 1:
                inst.calibration.observe_decode(tokens=n, seconds=elapsed)
            self.metrics.requests.labels(route, "ok").inc()
            self.metrics.e2e.observe(time.monotonic() - t0)
            return JsonReply(status=200, body=answer)
        try:
            stream = await open_stream(inst, job.path, body, self.timeout())
        except BaseException:
            pending.end()
            done()
            raise
        state = _StreamState()

        async def close() -> None:
            if state.closed:
                return
            state.closed = True
            pending.end()
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

        def first_token(at: float) -> None:
            pending.release(seconds=at - t0)
            if computing is not None:
                self._computing.started(computing, at)

        return StreamReply(chunks=self._pass_through(stream, t0, state, close, first_token),
                           close=close)

    async def _pass_through(self, stream: OpenStream, t0: float, state: _StreamState,
                            close: Callable[[], Awaitable[None]],
                            first_token: Callable[[float], None]) -> AsyncIterator[bytes]:
        inst = stream.inst
        try:
            async for chunk in stream.chunks():
                if state.first is None:
                    state.first = time.monotonic()
                    self.metrics.ttft.observe(state.first - t0)
                    first_token(state.first)
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
            "model": self.model, "namespace": self.namespace,
            "block_tokens": self.block_tokens, "durability": self.store.waits_by,
            "text": "instances" if self.instances_tokenize else None,
            "sessions": len(self.sessions),
            "session_cache": self.session_cache.snapshot(),
            "instances": {i.url: {"role": i.role, "in_flight": i.in_flight,
                                  "load": None if i.load is None else {
                                      "running": i.load.running, "waiting": i.load.waiting,
                                      "kv_usage": i.load.kv_usage},
                                  "kv_room": None if i.kv_room is None else {
                                      "capacity_blocks": i.kv_room.capacity_blocks,
                                      "held_blocks": i.kv_room.held_blocks(),
                                      "requests": len(i.kv_room)},
                                  "calibration": i.calibration.snapshot()}
                          for i in self.instances()},
        }


@dataclass(slots=True, kw_only=True)
class _Job:
    """One request on its way through the front."""

    body: dict[str, Any]
    """What the instances get (the client's request; token-id prompts normalised)."""
    route: str
    path: str
    tokens: list[int]
    keys: list[BlockKey]
    stored: int
    """Leading blocks of ``keys`` the store held on arrival."""
    out_tokens: int
    """Expected output tokens (all ``n`` answers), for the scheduler."""
    t0: float
    session: str | None
    arrival: asyncio.Future[int] | None = None
    """The session's prefetch, started on arrival (``_session_arrival``)."""
    retained: bool = False
    """The instances save its blocks with the session's retention (``with_retention``)."""


@dataclass(slots=True)
class _StreamState:
    outcome: str = "cancelled"
    first: float | None = None
    events: int = 0
    closed: bool = False


def _err(status: int, message: str, *, reason: str | None = None) -> dict[str, Any]:
    from conductor.front.openai_api import error_body

    return error_body(status, message, reason=reason)
