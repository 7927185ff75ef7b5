"""Per-request outcomes of a simulated run and their summary.

Definitions (the CLI's JSON contract uses these names):

* TTFT = first token time - arrival; the first token comes out of prefill.
* Token intervals: the ``output_tokens - 1`` gaps between a request's consecutive
  output tokens, the first one from the first token (end of prefill) to the first
  decoded token. The simulators record every token's time and keep two statistics:
* TBT (``tbt_s``, ``avg_tbt_s`` / ``p90_tbt_s`` in the summary) = mean interval:
  ``(finish - first token) / (output_tokens - 1)``; 0 for a one-token output.
* Tail TBT (``tail_tbt_s``) = FAST'25 section 5.1's TBT, "the average of the longest
  10% of the token arrival intervals": the mean of the longest
  ``k = max(1, ceil(n / 10))`` of the request's ``n`` intervals (``tail_k``), so
  1-10 intervals -> the longest one, 11-20 -> the mean of the two longest, ...;
  0 for a one-token output (no interval).
* A request *meets the SLOs* if it was served with TTFT <= SLO and TBT <= SLO, TBT
  being the tail TBT (``TAIL_MEAN``, the default) or the mean (``MEAN``, for
  comparison with earlier figures); rejected requests never do.
  ``slo_attainment`` = meeting / all requests.
* Effective request capacity (``effective_requests``) = requests meeting the SLOs.
* Latency percentiles are over served requests only (rejected ones have none).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from conductor.scheduling.types import InstanceId, RequestId, Slo

TAIL_MEAN: Final = "tail-mean"
"""TBT statistic: mean of the longest 10% of a request's token intervals (FAST'25 5.1)."""
MEAN: Final = "mean"
"""TBT statistic: mean token interval (this simulator's definition before issue 16)."""
TBT_STATISTICS: Final = (TAIL_MEAN, MEAN)
TBT_DEFINITIONS: Final = {
    TAIL_MEAN: "tail-mean: mean of the longest max(1, ceil(n/10)) of a request's n token "
               "intervals (FAST'25 section 5.1)",
    MEAN: "mean: (last token - first token) / (output tokens - 1)",
}


def tail_k(n_intervals: int) -> int:
    """How many of ``n_intervals`` intervals the tail mean averages: ``max(1, ceil(n/10))``
    for ``n >= 1`` (0 for none), in integers: ``ceil(0.1 * 30)`` would be 4, since
    ``0.1 * 30`` is 3.0000000000000004 in floating point."""
    if n_intervals < 0:
        raise ValueError("n_intervals must be >= 0")
    return (n_intervals + 9) // 10


def tail_mean_s(intervals: Sequence[float] | np.ndarray) -> float:
    """The mean of the longest ``tail_k(len(intervals))`` intervals; 0.0 for none."""
    gaps = np.asarray(intervals, dtype=float)
    n = gaps.size
    if n == 0:
        return 0.0
    k = tail_k(n)
    top = np.partition(gaps, n - k)[n - k:] if k < n else gaps
    return float(top.sum() / k)


def token_interval_stats(first_token_s: float, token_times: Sequence[float]
                         ) -> tuple[float, float]:
    """``(tail mean, longest)`` of the intervals of a request whose first token came at
    ``first_token_s`` and whose decoded tokens came at ``token_times`` (ascending)."""
    if not token_times:
        return 0.0, 0.0
    gaps = np.diff(np.asarray(token_times, dtype=float), prepend=first_token_s)
    return tail_mean_s(gaps), float(gaps.max())


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
    tail_tbt_s: float | None = None
    """Tail-mean TBT, set by the simulator when the request finishes (``tail_mean_s``)."""
    max_tbt_s: float | None = None
    """Longest token interval, set with ``tail_tbt_s``."""

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

    def tbt_for(self, statistic: str) -> float | None:
        """The request's TBT under ``statistic`` (``TAIL_MEAN`` or ``MEAN``)."""
        if statistic == MEAN:
            return self.tbt_s
        if statistic != TAIL_MEAN:
            raise ValueError(f"unknown TBT statistic {statistic!r} (known: "
                             f"{', '.join(TBT_STATISTICS)})")
        if self.finish_s is None or self.first_token_s is None:
            return None
        if self.output_tokens <= 1:
            return 0.0
        if self.tail_tbt_s is None:
            raise ValueError(f"request {self.id}: no token times recorded for the tail TBT")
        return self.tail_tbt_s

    def meets(self, slo: Slo, tbt_statistic: str = TAIL_MEAN) -> bool:
        if not self.served:
            return False
        ttft, tbt = self.ttft_s, self.tbt_for(tbt_statistic)
        assert ttft is not None and tbt is not None
        return ttft <= slo.ttft_s and tbt <= slo.tbt_s


def _pct(values: np.ndarray, q: float) -> float | None:
    return float(np.percentile(values, q)) if values.size else None


def summarize(records: Sequence[RequestRecord], slo: Slo, *, duration_s: float | None = None,
              tbt_statistic: str = TAIL_MEAN) -> dict[str, Any]:
    """The run's figures as a JSON-able dict (seconds, fractions, counts). The SLO check
    uses ``tbt_statistic``; ``tail_tbt_s`` / ``p90_tail_tbt_s`` are the mean / p90 over
    served multi-token requests of their tail TBT (None where not recorded)."""
    served = [r for r in records if r.served]
    ttft = np.array([r.ttft_s for r in served], dtype=float)
    multi = [r for r in served if r.output_tokens > 1]
    tbt = np.array([r.tbt_s for r in multi], dtype=float)
    tails = [r.tail_tbt_s for r in multi]
    tail = (np.array(tails, dtype=float) if all(t is not None for t in tails)
            else np.array([], dtype=float))
    n = len(records)
    meeting = sum(1 for r in served if r.meets(slo, tbt_statistic))
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
        "tail_tbt_s": float(tail.mean()) if tail.size else None,
        "p90_tail_tbt_s": _pct(tail, 90),
        "p99_tail_tbt_s": _pct(tail, 99),
        "tbt_slo_statistic": tbt_statistic,
        "slo_attainment": meeting / n if n else 0.0,
        "effective_requests": meeting,
        "cache_hit_ratio": cached / prompt if prompt else 0.0,
        "ttft_slo_s": slo.ttft_s,
        "tbt_slo_s": slo.tbt_s,
    }
    if duration_s:
        out["effective_rps"] = meeting / duration_s
    return out
