"""Overload handling: when the Conductor rejects a request, and what decode load it sees.

Mooncake (FAST'25, section 7, "overload-oriented scheduling") rejects requests it
cannot serve within the SLOs, and the point is *when*: a request rejected by its
decode instance after its prefill ran has wasted that prefill. Definitions used
here (and in the tests):

**Load and overload.** The decode load a request meets is the batch it would join:
its size, its context tokens and its KV reservations (prompt + output per
request, reserved whole at admission; ``conductor.simulation.sim``). A decode instance is
*overloaded for a request* when, with the request added, either its KV memory
would not hold every reservation (KV utilisation > 1) or the predicted step time
— the request's TBT — ``decode_step_s(batch + 1, context + prompt)`` exceeds the
TBT SLO (the paper's load, predicted TBT / TBT SLO, > 1). Both thresholds are the
hardware's and the SLO's; nothing is tuned.

**What the Conductor knows.** It observes the current state of every instance
exactly: each decode batch (members, steps run, context, KV reserved) and the
requests it has accepted for it (prompt length, estimated KV arrival time). It
does *not* know how many tokens a request will generate: wherever a decision at
arrival needs an output length (the new request's reservation, requests not yet
in a batch, when a running request ends) it uses the system-level estimate
``expected_output_tokens`` — the mean output length, the paper's uniform decode
time ``t_d`` (``Conductor`` keeps it as the running mean of the requests seen so
far, or takes a fixed value). Only the decode instance itself, when the KV cache
arrives, checks with the request's real size (it is the one reserving memory).

**What counts as rejected.** Requests rejected at arrival (TTFT SLO or decode
overload) plus requests rejected by their decode instance after their prefill ran
(``rejected_late``); both count in ``rejected``.

The modes:

* ``none``: never reject. Decode instances queue what does not fit.
* ``baseline``: admission on the prefill side only (Algorithm 1: reject at arrival
  iff the best estimated TTFT exceeds the TTFT SLO). When the KV cache reaches the
  decode instance it rejects the request if it is overloaded then, wasting the
  prefill (the paper's baseline: the decode check happens after prefill).
* ``load``: early rejection. At arrival, additionally reject if the chosen decode
  instance is overloaded for the request under its *current* load: its batch now
  plus the requests whose KV cache is already waiting at it. Requests accepted for
  it but still in prefill or transfer are not load yet: that is the time lag the
  paper blames for the fluctuation of early rejection (a quiet decode instance
  admits a wave, the wave lands together after its prefills, the instance then
  rejects everything until it drains). Requests that still reach an overloaded
  decode instance are rejected there, as in ``baseline``.
* ``predictive``: early rejection based on prediction, the paper's system-level
  prediction. As ``load``, but the load is predicted for the moment ``t`` the
  request would reach decode (now + its estimated TTFT + the KV transfer), every
  request being assumed to decode for the same ``expected_output_tokens``: the
  current batch minus the requests that will have decoded that many tokens by
  ``t`` (at the current step time), plus the accepted requests whose KV cache is
  estimated to arrive by ``t`` and that will not have finished by then. No
  per-request output length is used (the paper's request-level prediction, which
  would need one, is left out as in the paper).

Every mode chooses the decode instance the same way, so that they differ only in
when they reject: the one with the smallest TBT under the *predicted* load among
those not overloaded under it (else the smallest TBT), ties to the lowest index.
(Choosing by current load sends every request of a burst to the instance that
looks empty now, and they all land on it together once their prefills end.) The
arrival check then applies the mode's own view to that instance.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from conductor.scheduling.costs import CostModel
from conductor.scheduling.state import DecodeInstance
from conductor.scheduling.types import RequestId


@dataclass(slots=True, kw_only=True, frozen=True)
class DecodeLoad:
    """A decode instance's batch as seen at some moment."""

    batch: int
    context_tokens: int
    reserved_tokens: int


class LoadView(Protocol):
    """How the Conductor sees a decode instance's load for a new request."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             output_tokens: int | None = None, exclude: RequestId | None = None
             ) -> DecodeLoad:
        """The load a request reaching ``d`` at ``at_s >= now`` would meet.

        ``output_tokens``: the output length assumed for every request not yet in
        the batch (None: each request's own ``output_tokens``, as the decode
        instance sees it once the request is there).
        """
        ...


class CurrentLoad:
    """The batch now plus the requests already waiting at the instance (ready <= now)."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             output_tokens: int | None = None, exclude: RequestId | None = None
             ) -> DecodeLoad:
        batch = len(d.active)
        ctx = d.context_tokens
        res = d.reserved_tokens
        for rid, inc in d.incoming.items():
            if inc.ready_s <= now and rid != exclude:
                batch += 1
                ctx += inc.prompt_tokens
                out = inc.output_tokens if output_tokens is None else output_tokens
                res += inc.prompt_tokens + out
        return DecodeLoad(batch=batch, context_tokens=ctx, reserved_tokens=res)


class PredictedLoad:
    """The load predicted at ``at_s`` under the uniform-decode assumption: every request
    decodes ``output_tokens - 1`` steps after its first token (the paper's ``t_d``),
    steps last the current step time, accepted requests arrive at their estimated
    KV-ready time."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             output_tokens: int | None = None, exclude: RequestId | None = None
             ) -> DecodeLoad:
        if output_tokens is None:
            raise ValueError("the predicted load needs the expected output length")
        out = max(1, output_tokens)
        decode_steps = out - 1
        step = cost.decode_step_s(max(1, len(d.active)), d.context_tokens)
        horizon = max(0.0, at_s - now)
        elapsed = horizon / step if step > 0 else float("inf")
        steps_now = d.steps
        batch = ctx = res = 0
        for slot in d.active.values():
            ran = steps_now - slot.start_step
            if ran + elapsed >= decode_steps:
                continue  # will have decoded t_d by at_s: predicted gone
            batch += 1
            ctx += slot.prompt_tokens + ran + int(elapsed)
            res += slot.reserved_tokens
        for rid, inc in d.incoming.items():
            if rid == exclude or inc.ready_s > at_s:
                continue
            ran_f = (at_s - max(inc.ready_s, now)) / step if step > 0 else float("inf")
            if ran_f >= decode_steps:
                continue
            batch += 1
            ctx += inc.prompt_tokens + int(ran_f)
            res += inc.prompt_tokens + out
        return DecodeLoad(batch=batch, context_tokens=ctx, reserved_tokens=res)


@dataclass(slots=True, kw_only=True, frozen=True)
class RejectionMode:
    """One overload policy; see the module docstring for the four named ones."""

    name: str
    ttft_check: bool
    """Reject at arrival when the best estimated TTFT exceeds the SLO."""
    arrival_view: LoadView | None
    """Decode load checked at arrival; None: no decode check at arrival."""
    decode_check: bool
    """The decode instance rejects an overloaded request when its KV cache arrives."""


REJECTION_MODES: dict[str, RejectionMode] = {
    "none": RejectionMode(name="none", ttft_check=False, arrival_view=None, decode_check=False),
    "baseline": RejectionMode(name="baseline", ttft_check=True, arrival_view=None,
                              decode_check=True),
    "load": RejectionMode(name="load", ttft_check=True, arrival_view=CurrentLoad(),
                          decode_check=True),
    "predictive": RejectionMode(name="predictive", ttft_check=True,
                                arrival_view=PredictedLoad(), decode_check=True),
}


def make_rejection(name: str) -> RejectionMode:
    try:
        return REJECTION_MODES[name]
    except KeyError:
        raise ValueError(f"unknown rejection mode {name!r} "
                         f"(known: {', '.join(REJECTION_MODES)})") from None


def overload_reason(load: DecodeLoad, *, prompt_tokens: int, output_tokens: int,
                    capacity_tokens: int, tbt_s: float, tbt_slo_s: float) -> str | None:
    """Why a decode instance with ``load`` cannot take the request, or None if it can."""
    if load.reserved_tokens + prompt_tokens + output_tokens > capacity_tokens:
        return "decode KV cache full"
    if tbt_s > tbt_slo_s:
        return f"decode TBT {tbt_s * 1000:.0f} ms > SLO {tbt_slo_s * 1000:.0f} ms"
    return None
