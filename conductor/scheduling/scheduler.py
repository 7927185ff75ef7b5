"""The Conductor: Mooncake's KV-cache-centric global scheduler (FAST'25 Algorithm 1).

``Conductor.schedule(request, now)`` does, for one arriving request:

1. look up the request's block keys: for every prefill instance the prefix it
   holds locally, and the prefix the global pool holds;
2. estimate per instance TTFT = queue time + transfer time of the blocks it would
   fetch + prefill time of the tokens it would compute (``CostModel``); the
   policy picks the instance and plan (``conductor.scheduling.policies``);
3. predict every decode instance's load when the request would reach it and its
   TBT with the request admitted, and pick the best decode instance (output
   lengths are not known at arrival: every request is assumed to generate
   ``expected_output_tokens``, see ``conductor.scheduling.rejection``);
4. reject if the mode says the SLOs cannot be met (``conductor.scheduling.rejection``);
   otherwise commit: append the work to the prefill queue, record the request's
   blocks in that instance's cache (they will be there once it runs: computed or
   fetched), and announce the request to the decode instance.

The environment reports back with ``prefill_done`` (corrects the queue estimate)
and ``decode_arrival`` (the decode-side check of ``baseline``/``load``/
``predictive``); it updates ``DecodeInstance`` batches itself (start, step,
finish). The Conductor never reads a clock: ``now`` is always passed in.
"""

from __future__ import annotations

from collections.abc import Sequence

from conductor.scheduling.costs import CostModel
from conductor.scheduling.policies import Candidate, PrefillPolicy, make_policy
from conductor.scheduling.rejection import (
    CurrentLoad,
    DecodeLoad,
    PredictedLoad,
    RejectionMode,
    make_rejection,
    overload_reason,
)
from conductor.scheduling.state import DecodeInstance, GlobalCache, PoolIndex, PrefillInstance
from conductor.scheduling.types import Decision, InstanceId, PrefillPlan, Request, RequestId, Slo


class Conductor:
    """Schedules requests onto (prefill, decode) instance pairs; see the module docstring.

    Invariant: every accepted request is in exactly one decode instance's
    ``incoming`` until the environment starts it there or drops it.
    """

    def __init__(self, *, prefill: Sequence[PrefillInstance], decode: Sequence[DecodeInstance],
                 cost: CostModel, policy: PrefillPolicy | str = "global-cache-aware",
                 rejection: RejectionMode | str = "none", slo: Slo | None = None,
                 pool: GlobalCache | None = None, seed: int = 0,
                 mean_output_tokens: float | None = None) -> None:
        if not prefill or not decode:
            raise ValueError("need at least one prefill and one decode instance")
        ids = [p.id for p in prefill] + [d.id for d in decode]
        if len(set(ids)) != len(ids):
            raise ValueError("instance ids must be unique")
        self.prefill = list(prefill)
        self.decode = list(decode)
        self._decode_by_id = {d.id: d for d in self.decode}
        self._prefill_by_id = {p.id: p for p in self.prefill}
        self.cost = cost
        self.policy = make_policy(policy, seed) if isinstance(policy, str) else policy
        self.rejection = make_rejection(rejection) if isinstance(rejection, str) else rejection
        self.slo = slo if slo is not None else Slo()
        if pool is None:
            pool = next((p.cache.pool for p in self.prefill if p.cache.pool is not None),
                        PoolIndex())
        self.pool: GlobalCache = pool
        self._kv_bytes = cost.kv_bytes_per_token
        self._predicted = PredictedLoad()
        if mean_output_tokens is not None and mean_output_tokens < 1:
            raise ValueError("mean_output_tokens must be >= 1")
        self.mean_output_tokens = mean_output_tokens
        """Fixed expected output length; None: the running mean of the requests seen."""
        self._seen_output_tokens = 0
        self._seen_requests = 0
        self._where: dict[RequestId, tuple[InstanceId, InstanceId]] = {}

    # ---- step 1-2: prefill plans ---------------------------------------------------------

    def plan(self, inst: PrefillInstance, req: Request, queue_s: float, local_blocks: int,
             fetch_blocks: int) -> PrefillPlan:
        """Estimated cost of ``inst`` reusing ``local_blocks`` and fetching ``fetch_blocks``.

        Cached tokens are capped at ``prompt_tokens - 1``: the last prompt token is
        always computed, since its logits give the first output token.
        """
        bt = req.block_tokens
        cached = min((local_blocks + fetch_blocks) * bt, req.prompt_tokens - 1)
        return PrefillPlan(
            instance=inst.id, local_blocks=local_blocks, fetch_blocks=fetch_blocks,
            cached_tokens=cached, queue_s=queue_s,
            transfer_s=self.cost.transfer_s(fetch_blocks * bt * self._kv_bytes),
            prefill_s=self.cost.prefill_s(req.prompt_tokens - cached, cached))

    def candidates(self, req: Request, now: float) -> list[Candidate]:
        keys = req.block_keys
        pool_blocks = self.pool.prefix_len(keys) if self.policy.may_fetch else 0
        out = []
        for inst in self.prefill:
            q = inst.queue_s(now)
            local_blocks = inst.cache.prefix_len(keys)
            local = self.plan(inst, req, q, local_blocks, 0)
            fetch = (self.plan(inst, req, q, local_blocks, pool_blocks - local_blocks)
                     if pool_blocks > local_blocks else local)
            out.append(Candidate(queue_s=q, local=local, fetch=fetch))
        return out

    # ---- step 3: decode ------------------------------------------------------------------

    def expected_output_tokens(self) -> int:
        """The output length assumed for every request in decode-load predictions (the
        paper's uniform decode time, in tokens): ``mean_output_tokens`` if fixed, else
        the mean ``output_tokens`` of the requests scheduled so far (the current one
        included), rounded; at least 1."""
        if self.mean_output_tokens is not None:
            return max(1, round(self.mean_output_tokens))
        if not self._seen_requests:
            return 1
        return max(1, round(self._seen_output_tokens / self._seen_requests))

    def kv_ready_s(self, req: Request, now: float, ttft_s: float) -> float:
        """When the request's KV cache is estimated to reach its decode instance."""
        return now + ttft_s + self.cost.transfer_s(req.prompt_tokens * self._kv_bytes)

    def choose_decode(self, req: Request, now: float, at_s: float
                      ) -> tuple[DecodeInstance, float, str | None]:
        """The decode instance for ``req`` (reaching decode at ``at_s``), its predicted
        TBT, and why the rejection mode's arrival view finds it overloaded (None if
        it does not, or if the mode does not check at arrival)."""
        out = self.expected_output_tokens()
        best: tuple[bool, float] | None = None
        chosen = self.decode[0]
        chosen_tbt = 0.0
        for d in self.decode:
            load = self._predicted.load(d, now=now, at_s=at_s, cost=self.cost,
                                        output_tokens=out)
            tbt, reason = self._check(d, load, req.prompt_tokens, out)
            key = (reason is not None, tbt)
            if best is None or key < best:
                best, chosen, chosen_tbt = key, d, tbt
        view = self.rejection.arrival_view
        if view is None:
            return chosen, chosen_tbt, None
        load = view.load(chosen, now=now, at_s=at_s, cost=self.cost, output_tokens=out)
        tbt, reason = self._check(chosen, load, req.prompt_tokens, out)
        return chosen, tbt, reason

    def _check(self, d: DecodeInstance, load: DecodeLoad, prompt_tokens: int,
               output_tokens: int) -> tuple[float, str | None]:
        """The request's TBT on ``d`` under ``load``, and why ``d`` is overloaded for it."""
        tbt = self.cost.decode_step_s(load.batch + 1, load.context_tokens + prompt_tokens)
        return tbt, overload_reason(load, prompt_tokens=prompt_tokens,
                                    output_tokens=output_tokens,
                                    capacity_tokens=d.kv_capacity_tokens, tbt_s=tbt,
                                    tbt_slo_s=self.slo.tbt_s)

    # ---- the decision --------------------------------------------------------------------

    def observe(self, req: Request) -> None:
        """Count ``req`` in the running mean output length (``schedule`` does it for every
        request; a wrapper that rejects a request without scheduling it calls it so the
        mean still covers every request seen)."""
        self._seen_output_tokens += req.output_tokens
        self._seen_requests += 1

    def schedule(self, req: Request, now: float) -> Decision:
        """Choose a (prefill, decode) pair for ``req`` at time ``now``, or reject it."""
        if req.id in self._where:
            raise ValueError(f"request {req.id} is already scheduled")
        self.observe(req)
        plan = self.policy.choose(req, self.candidates(req, now))
        at_s = self.kv_ready_s(req, now, plan.ttft_s)
        d, tbt, overload = self.choose_decode(req, now, at_s)
        mode = self.rejection
        reason: str | None = None
        if mode.ttft_check and plan.ttft_s > self.slo.ttft_s:
            reason = f"TTFT {plan.ttft_s:.2f} s > SLO {self.slo.ttft_s:.2f} s"
        elif overload is not None:
            reason = overload
        if reason is not None:
            return Decision(request_id=req.id, reason=reason, plan=plan, decode=d.id,
                            est_ttft_s=plan.ttft_s, est_tbt_s=tbt)
        inst = self._prefill_by_id[plan.instance]
        inst.enqueue(req.id, now, plan.work_s)
        inst.cache.use(req.block_keys)
        d.expect(req.id, at_s, req.prompt_tokens, req.output_tokens)
        self._where[req.id] = (inst.id, d.id)
        return Decision(request_id=req.id, reason=None, plan=plan, decode=d.id,
                        est_ttft_s=plan.ttft_s, est_tbt_s=tbt)

    # ---- feedback from the environment ---------------------------------------------------

    def prefill_done(self, rid: RequestId, now: float) -> None:
        """The request's prefill finished at ``now`` (its first token is out)."""
        p, _ = self._where[rid]
        self._prefill_by_id[p].complete(rid, now)

    def decode_arrival(self, rid: RequestId, now: float, *, prompt_tokens: int,
                       output_tokens: int) -> str | None:
        """The request's KV cache reached its decode instance at ``now``.

        Returns why the decode instance rejects it (modes with ``decode_check``), or
        None if it may join the batch (it stays in ``incoming`` until started).
        A rejected request is forgotten.
        """
        _, did = self._where[rid]
        d = self._decode_by_id[did]
        if d.incoming.get(rid) is not None:
            d.incoming[rid].ready_s = now
        if not self.rejection.decode_check:
            return None
        # The decode instance checks with the request's real size and the real sizes of
        # the requests waiting at it: it is the one reserving their memory.
        load = CurrentLoad().load(d, now=now, at_s=now, cost=self.cost, exclude=rid)
        _, reason = self._check(d, load, prompt_tokens, output_tokens)
        if reason is not None:
            self.forget(rid)
        return reason

    def forget(self, rid: RequestId) -> None:
        """The request is done with the Conductor (rejected late, finished, or needs no
        decode): drop it from its decode instance's ``incoming``."""
        where = self._where.pop(rid, None)
        if where is not None:
            self._decode_by_id[where[1]].drop(rid)

    def decode_of(self, rid: RequestId) -> DecodeInstance:
        return self._decode_by_id[self._where[rid][1]]

    def prefill_instance(self, iid: InstanceId) -> PrefillInstance:
        """The prefill instance ``iid`` (KeyError if there is none): a live front feeds
        it the queue it measures."""
        return self._prefill_by_id[iid]
