"""What ``python -m benchmarks.sessions`` reports: per turn and per run, from the records
the driver keeps, and the on/off comparison of one backend.

* **prefix hit rate** of a turn: the share of its previous context (the previous turn's
  prompt and answer, the part of this turn's prompt that a cache could hold) that was
  served from the store or the instance's own cache: ``min(cached, previous) /
  previous``, summed over the turn's requests (turn 0 has no previous context: none);
* **TTFT** p50 / p90 per turn and over the run (turns after the first: turn 0 is cold
  in every mode; over all turns too);
* **promoted ahead of use**: the node's settled prefetch outcomes (``prefetch_blocks`` in
  its stats), and **bytes retained over time**: the node's ``retained_bytes`` sampled
  through the run, with each tier's bytes in use.

Ratios are off / on for times (above 1: sessions on is faster) and on - off for hit rates.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from benchmarks.stats import Panel, format_table, percentile, plot_panels, ratio

HIT_TARGET = 0.95
"""Share of each turn's previous context the issue asks to be served from the store."""
P90_TARGET = 1.5
"""TTFT p90 off / on the issue asks for."""


@dataclass(slots=True, kw_only=True)
class TurnRecord:
    session: str
    turn: int
    prompt_tokens: int
    prev_context: int
    """Tokens of the previous turn's prompt and answer (0 for turn 0)."""
    cached_tokens: int | None
    """Prompt tokens served from a cache (None: the backend did not say)."""
    ttft_s: float | None
    ok: bool
    sent_s: float
    status: int = 200

    def hit_tokens(self) -> int | None:
        if self.cached_tokens is None:
            return None
        return min(self.cached_tokens, self.prev_context)


@dataclass(slots=True, kw_only=True)
class Sample:
    """The node's state at ``t_s`` seconds into a run."""

    t_s: float
    retained_bytes: int
    tier_bytes: dict[str, int] = field(default_factory=dict)
    prefetch_blocks: dict[str, int] = field(default_factory=dict)
    tier_evictions: dict[str, int] = field(default_factory=dict)
    """Blocks each tier evicted so far (the last tier's left the node)."""
    retention_denied: int = 0
    """Retention asks the node refused so far (its retained bytes at their cap)."""


def _pcts(ttfts: Sequence[float]) -> tuple[float | None, float | None]:
    if not ttfts:
        return None, None
    return percentile(ttfts, 50), percentile(ttfts, 90)


def _hit(records: Sequence[TurnRecord]) -> tuple[float | None, float | None]:
    """(summed hit share, lowest single request's share) over requests with a previous
    context and a known cached count."""
    known = [r for r in records if r.ok and r.prev_context > 0 and r.cached_tokens is not None]
    if not known:
        return None, None
    hits = [r.hit_tokens() or 0 for r in known]
    total = sum(r.prev_context for r in known)
    return sum(hits) / total, min(h / r.prev_context for h, r in zip(hits, known, strict=True))


def per_turn(records: Sequence[TurnRecord]) -> list[dict[str, Any]]:
    """One row per turn index, in order."""
    rows = []
    for t in sorted({r.turn for r in records}):
        rs = [r for r in records if r.turn == t]
        ok = [r for r in rs if r.ok]
        p50, p90 = _pcts([r.ttft_s for r in ok if r.ttft_s is not None])
        hit, low = _hit(rs)
        rows.append({"turn": t, "requests": len(rs), "ok": len(ok),
                     "prompt_tokens_mean": sum(r.prompt_tokens for r in rs) / len(rs),
                     "hit_rate": hit, "min_hit": low, "ttft_p50_s": p50, "ttft_p90_s": p90})
    return rows


def overall(records: Sequence[TurnRecord]) -> dict[str, Any]:
    """The run's figures: TTFT and hit rates over turns >= 1, and TTFT over all turns."""
    later = [r for r in records if r.turn > 0]
    ok_later = [r for r in later if r.ok]
    p50, p90 = _pcts([r.ttft_s for r in ok_later if r.ttft_s is not None])
    a50, a90 = _pcts([r.ttft_s for r in records if r.ok and r.ttft_s is not None])
    hit, low = _hit(later)
    known = [r for r in ok_later if r.cached_tokens is not None and r.prev_context > 0]
    at_target = sum(1 for r in known
                    if (r.hit_tokens() or 0) >= HIT_TARGET * r.prev_context)
    return {"requests": len(records), "ok": sum(1 for r in records if r.ok),
            "ttft_p50_s": p50, "ttft_p90_s": p90, "ttft_p50_all_s": a50, "ttft_p90_all_s": a90,
            "hit_rate": hit, "min_hit": low,
            "share_at_hit_target": at_target / len(known) if known else None}


def node_summary(samples: Sequence[Sample]) -> dict[str, Any]:
    """Peak and last retained bytes, and the prefetch outcomes at the end."""
    if not samples:
        return {"retained_peak_bytes": None, "retained_last_bytes": None,
                "prefetch_blocks": {}, "promoted_ahead": None, "tier_evictions": {},
                "retention_denied": None}
    last = samples[-1]
    return {"retained_peak_bytes": max(s.retained_bytes for s in samples),
            "retained_last_bytes": last.retained_bytes,
            "tier_evictions": dict(last.tier_evictions),
            "retention_denied": last.retention_denied,
            "prefetch_blocks": dict(last.prefetch_blocks),
            "promoted_ahead": last.prefetch_blocks.get("promoted", 0)
            + last.prefetch_blocks.get("queued", 0)}


def compare(on: Mapping[str, Any], off: Mapping[str, Any]) -> dict[str, Any]:
    """Off / on for TTFT (above 1: on is faster), and whether the issue's targets hold
    (p90 off / on >= ``P90_TARGET``; on's lowest per-request hit share >= ``HIT_TARGET``)."""
    p90 = ratio(off["ttft_p90_s"], on["ttft_p90_s"])
    p50 = ratio(off["ttft_p50_s"], on["ttft_p50_s"])
    hit_on, hit_off = on["hit_rate"], off["hit_rate"]
    return {"ttft_p90_off_over_on": p90, "ttft_p50_off_over_on": p50,
            "hit_rate_on_minus_off": (None if hit_on is None or hit_off is None
                                      else hit_on - hit_off),
            "p90_target_met": None if p90 is None else p90 >= P90_TARGET,
            "hit_target_met": (None if on["min_hit"] is None
                               else on["min_hit"] >= HIT_TARGET)}


def run_result(records: Sequence[TurnRecord], samples: Sequence[Sample]) -> dict[str, Any]:
    return {"overall": overall(records), "turns": per_turn(records),
            "node": node_summary(samples),
            "records": [asdict(r) for r in records],
            "samples": [asdict(s) for s in samples]}


def _pct(x: float | None) -> str | None:
    return None if x is None else f"{100 * x:.1f}%"


def _ms(x: float | None) -> float | None:
    return None if x is None else 1e3 * x


def turn_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per (mode, turn): hit rate and TTFT."""
    rows: list[list[object]] = []
    for mode, r in results.items():
        for t in r["turns"]:
            rows.append([mode, t["turn"], f"{t['ok']}/{t['requests']}",
                         round(t["prompt_tokens_mean"]), _pct(t["hit_rate"]),
                         _pct(t["min_hit"]), _ms(t["ttft_p50_s"]), _ms(t["ttft_p90_s"])])
    return format_table(["mode", "turn", "ok", "prompt", "hit", "min hit", "TTFT p50 ms",
                         "p90 ms"], rows, align="lrrrrrrr")


def summary_table(results: Mapping[str, Mapping[str, Any]]) -> str:
    """One row per mode: the run's figures and the node's."""
    rows: list[list[object]] = []
    for mode, r in results.items():
        o, n = r["overall"], r["node"]
        peak = n["retained_peak_bytes"]
        evicted = list(n["tier_evictions"].values())
        rows.append([mode, f"{o['ok']}/{o['requests']}", _pct(o["hit_rate"]),
                     _pct(o["min_hit"]), _ms(o["ttft_p50_s"]), _ms(o["ttft_p90_s"]),
                     _ms(o["ttft_p90_all_s"]), n["promoted_ahead"],
                     None if peak is None else f"{peak / 2**20:.1f}",
                     evicted[-1] if evicted else None, n["retention_denied"]])
    return format_table(["mode", "ok", "hit (turns>0)", "min hit", "TTFT p50 ms", "p90 ms",
                         "p90 all turns ms", "promoted ahead", "retained peak MiB",
                         "dropped blocks", "retain denied"], rows)


def plot(path: Path, results: Mapping[str, Mapping[str, Any]], title: str) -> Path:
    """Per turn: hit rate and TTFT p90 of each mode; over time: retained bytes."""
    turns = sorted({t["turn"] for r in results.values() for t in r["turns"]})

    def by_turn(r: Mapping[str, Any], key: str) -> list[float | None]:
        got = {t["turn"]: t[key] for t in r["turns"]}
        return [got.get(t) for t in turns]

    hit = Panel(title="prefix hit rate per turn", x=turns, xlabel="turn",
                ylabel="share of previous context from cache",
                series={m: by_turn(r, "hit_rate") for m, r in results.items()},
                hlines={"target 95%": HIT_TARGET})
    p90 = Panel(title="TTFT p90 per turn", x=turns, xlabel="turn", ylabel="s",
                series={m: by_turn(r, "ttft_p90_s") for m, r in results.items()})
    panels = [hit, p90]
    for mode, r in results.items():
        xs = [s["t_s"] for s in r["samples"]]
        if not xs:
            continue
        series: dict[str, Sequence[float | None]] = {
            "retained": [s["retained_bytes"] / 2**20 for s in r["samples"]]}
        for tier in sorted({k for s in r["samples"] for k in s["tier_bytes"]}):
            series[f"{tier} used"] = [s["tier_bytes"].get(tier, 0) / 2**20
                                      for s in r["samples"]]
        panels.append(Panel(title=f"{mode}: node bytes over time", x=xs, xlabel="s",
                            ylabel="MiB", series=series))
    return plot_panels(path, panels, title=title)
