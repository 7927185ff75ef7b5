"""Per-request outcomes of a simulated run and their summary.

Definitions (the CLI's JSON contract uses these names):

* TTFT = first token time - arrival; the first token comes out of prefill.
* TBT = mean gap between a request's output tokens:
  ``(finish - first token) / (output_tokens - 1)``; 0 for a one-token output.
* A request *meets the SLOs* if it was served with TTFT <= SLO and TBT <= SLO;
  rejected requests never do. ``slo_attainment`` = meeting / all requests.
* Effective request capacity (``effective_requests``) = requests meeting the SLOs.
* Latency percentiles are over served requests only (rejected ones have none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from conductor.types import InstanceId, RequestId, Slo


@dataclass(slots=True, kw_only=True)
class RequestRecord:
    """What happened to one request. Rejected iff ``rejected`` is set (the reason);
    ``rejected_late`` marks a rejection by the decode instance after prefill ran."""

    id: RequestId
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    cached_tokens: int = 0
    prefill: InstanceId | None = None
    decode: InstanceId | None = None
    est_ttft_s: float | None = None
    first_token_s: float | None = None
    finish_s: float | None = None
    rejected: str | None = None
    rejected_late: bool = False

    @property
    def served(self) -> bool:
        return self.rejected is None and self.finish_s is not None

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tbt_s(self) -> float | None:
        if self.finish_s is None or self.first_token_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def meets(self, slo: Slo) -> bool:
        if not self.served:
            return False
        ttft, tbt = self.ttft_s, self.tbt_s
        assert ttft is not None and tbt is not None
        return ttft <= slo.ttft_s and tbt <= slo.tbt_s


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def summarize(records: Sequence[RequestRecord], slo: Slo, *, duration_s: float | None = None
              ) -> dict[str, Any]:
    """The run's figures as a JSON-able dict (seconds, fractions, counts)."""
    served = [r for r in records if r.served]
    ttft = np.array([r.ttft_s for r in served], dtype=float)
    tbt = np.array([r.tbt_s for r in served if r.output_tokens > 1], dtype=float)
    n = len(records)
    meeting = sum(1 for r in served if r.meets(slo))
    rejected = [r for r in records if r.rejected is not None]
    prompt = sum(r.prompt_tokens for r in records if r.prefill is not None
                 and (r.rejected is None or r.rejected_late))
    cached = sum(r.cached_tokens for r in records if r.prefill is not None
                 and (r.rejected is None or r.rejected_late))
    out: dict[str, Any] = {
        "requests": n,
        "served": len(served),
        "rejected": len(rejected),
        "rejected_early": sum(1 for r in rejected if not r.rejected_late),
        "rejected_late": sum(1 for r in rejected if r.rejected_late),
        "avg_ttft_s": float(ttft.mean()) if ttft.size else None,
        "p50_ttft_s": _pct(ttft, 50),
        "p90_ttft_s": _pct(ttft, 90),
        "p99_ttft_s": _pct(ttft, 99),
        "avg_tbt_s": float(tbt.mean()) if tbt.size else None,
        "p50_tbt_s": _pct(tbt, 50),
        "p90_tbt_s": _pct(tbt, 90),
        "p99_tbt_s": _pct(tbt, 99),
        "slo_attainment": meeting / n if n else 0.0,
        "effective_requests": meeting,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_slo_s": slo.ttft_s,
        "tbt_slo_s": slo.tbt_s,
    }
    if duration_s:
        out["effective_rps"] = meeting / duration_s
    return out
