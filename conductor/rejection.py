"""Overload handling: when the Conductor rejects a request, and what decode load it sees.

Mooncake (FAST'25, section 6) rejects requests it cannot serve within the SLOs,
and the point is *when*: a request rejected by its decode instance after its
prefill ran has wasted that prefill. Definitions used here (and in the tests):

A decode instance is *overloaded for a request* when, with the request added to
its batch, either its KV memory would not hold every reservation (prompt +
expected output per request) or the predicted step time — the request's TBT —
``decode_step_s(batch + 1, context + prompt)`` exceeds the TBT SLO.

* ``none``: never reject. Decode instances queue what does not fit.
* ``baseline``: admission on the prefill side only (Algorithm 1: reject at arrival
  iff the best estimated TTFT exceeds the TTFT SLO). When the KV cache reaches the
  decode instance it rejects the request if it is overloaded then, wasting the
  prefill.
* ``load``: load-based early rejection. At arrival, additionally reject if every
  decode instance is overloaded for the request under its *current* load (its
  batch plus the requests already waiting at it). Requests that still reach an
  overloaded decode instance are rejected there, as in ``baseline``.
* ``predictive``: prediction-based early rejection. As ``load``, but the decode
  load is predicted for the moment the request would reach decode (now + its
  estimated TTFT + the KV transfer): the current batch minus the requests
  predicted to finish by then (remaining tokens x the current step time), plus
  the accepted requests predicted to arrive by then and not finish before it.

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

from conductor.costs import CostModel
from conductor.state import DecodeInstance
from conductor.types import RequestId


@dataclass(slots=True, kw_only=True, frozen=True)
class DecodeLoad:
    """A decode instance's batch as seen at some moment."""

    batch: int
    context_tokens: int
    reserved_tokens: int


class LoadView(Protocol):
    """How the Conductor sees a decode instance's load for a new request."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             exclude: RequestId | None = None) -> DecodeLoad:
        """The load the request would meet; it reaches ``d`` at ``at_s >= now``."""
        ...


class CurrentLoad:
    """The batch now plus the requests already waiting at the instance (ready <= now)."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             exclude: RequestId | None = None) -> DecodeLoad:
        batch = len(d.active)
        ctx = d.context_tokens
        res = d.reserved_tokens
        for rid, inc in d.incoming.items():
            if inc.ready_s <= now and rid != exclude:
                batch += 1
                ctx += inc.prompt_tokens
                res += inc.prompt_tokens + inc.output_tokens
        return DecodeLoad(batch=batch, context_tokens=ctx, reserved_tokens=res)


class PredictedLoad:
    """The load predicted at ``at_s``: requests finish after their remaining tokens at
    the current step time; accepted requests arrive at their estimated ready time."""

    def load(self, d: DecodeInstance, *, now: float, at_s: float, cost: CostModel,
             exclude: RequestId | None = None) -> DecodeLoad:
        step = cost.decode_step_s(max(1, len(d.active)), d.context_tokens)
        horizon = max(0.0, at_s - now)
        elapsed = horizon / step if step > 0 else float("inf")
        steps_now = d.steps
        batch = ctx = res = 0
        for slot in d.active.values():
            remaining = slot.finish_step - steps_now
            if remaining <= elapsed:
                continue
            batch += 1
            ctx += slot.prompt_tokens + (steps_now - slot.start_step) + int(elapsed)
            res += slot.reserved_tokens
        for rid, inc in d.incoming.items():
            if rid == exclude or inc.ready_s > at_s:
                continue
            ran = (at_s - max(inc.ready_s, now)) / step if step > 0 else float("inf")
            if inc.output_tokens - 1 <= ran:
                continue
            batch += 1
            ctx += inc.prompt_tokens + int(ran)
            res += inc.prompt_tokens + inc.output_tokens
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
