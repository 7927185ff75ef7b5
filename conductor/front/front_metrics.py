"""Prometheus metrics of the Conductor's OpenAI front (``GET /metrics``).

Names (all prefixed ``conductor_``):

* ``requests_total{route, outcome}``: outcome is ``ok``, ``rejected``, ``bad_request``,
  ``upstream_error``, ``not_durable`` or ``cancelled``;
* ``prefix_tokens_found_total``: prompt tokens the store held when a request arrived
  (whole blocks), ``prompt_tokens_total``: prompt tokens seen;
* ``instance_chosen_total{role, instance}``: role ``prefill``, ``decode`` or
  ``colocated``;
* ``rejections_total{reason}``: reason ``ttft_slo``, ``tbt_slo``, ``decode_kv_full`` or
  ``other`` (the full sentence goes to the client, the label stays low-cardinality);
* ``ttft_seconds`` (streamed requests: until the first token reached the front) and
  ``e2e_seconds`` (until the last byte) histograms;
* ``durability_wait_seconds``: from the prefill's answer until every prompt block was
  in the store (disaggregated mode), and ``durability_waits_total{via}``: those waits by
  how the front learnt of the saves, ``events`` (the nodes' KV events) or ``polling``;
* ``save_waits_total{outcome}``: colocated requests held until a prefix another instance
  was computing reached the store (``conductor.front.colocated_routing``): ``loaded`` (it
  did, and the request loaded it) or ``timed_out`` (it went on and computed the rest);
* ``session_requests_total{outcome}``: requests naming a session (``X-Session-Affinity``)
  by where they went: ``new`` (no instance known for it), ``kept`` (its previous
  request's instance) or ``moved`` (elsewhere: that instance would have missed the SLO).
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


def reason_label(reason: str) -> str:
    """A rejection sentence's low-cardinality label."""
    if reason.startswith("TTFT"):
        return "ttft_slo"
    if "TBT" in reason:
        return "tbt_slo"
    if "KV cache full" in reason:
        return "decode_kv_full"
    return "other"


class FrontMetrics:
    """One registry per front (tests run several in a process)."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.requests = Counter("conductor_requests", "requests by route and outcome",
                                ["route", "outcome"], registry=r)
        self.prefix_tokens = Counter("conductor_prefix_tokens_found",
                                     "prompt tokens found in the store on arrival",
                                     registry=r)
        self.prompt_tokens = Counter("conductor_prompt_tokens", "prompt tokens seen",
                                     registry=r)
        self.chosen = Counter("conductor_instance_chosen", "requests sent per instance",
                              ["role", "instance"], registry=r)
        self.rejections = Counter("conductor_rejections", "rejected requests by reason",
                                  ["reason"], registry=r)
        self.ttft = Histogram("conductor_ttft_seconds", "time to first token (streamed)",
                              buckets=_BUCKETS, registry=r)
        self.e2e = Histogram("conductor_e2e_seconds", "end-to-end latency",
                             buckets=_BUCKETS, registry=r)
        self.durability_wait = Histogram("conductor_durability_wait_seconds",
                                         "prefill answer -> all prompt blocks stored",
                                         buckets=_BUCKETS, registry=r)

        self.durability_waits = Counter("conductor_durability_waits",
                                        "durability waits by how saves were learnt of",
                                        ["via"], registry=r)

        self.save_waits = Counter("conductor_save_waits",
                                  "requests held for another instance's save, by outcome",
                                  ["outcome"], registry=r)
        self.sessions = Counter("conductor_session_requests",
                                "requests naming a session, by where they went",
                                ["outcome"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
