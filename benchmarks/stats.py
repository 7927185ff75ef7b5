"""Statistics, tables, JSON and plots shared by the benchmarks.

Nothing here knows about kvstore: the api, tier, trace and cluster benchmarks
all reduce their samples with the same definitions, so their figures compare.

Definitions (exact, so that tests can pin them down):

* ``percentile(xs, q)``: linear interpolation between closest ranks (numpy's
  default "linear" method): rank ``h = (n - 1) * q / 100``, result
  ``x[floor(h)] + (h - floor(h)) * (x[floor(h) + 1] - x[floor(h)])`` on sorted data.
* ``median(xs)`` is ``percentile(xs, 50)``.
* ``ratio(a, b)`` is ``a / b``, or None when either side is missing or ``b`` is
  not positive: a ratio against a failed or empty cell is unknown, not infinite.
* ``paired_median_ratio(a, b)``: the median of the per-round ratios ``a[i] / b[i]``.
  Pairing rounds that ran side by side cancels most of the machine's drift.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# ---- reductions ----------------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0..100) by linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("percentile of no samples")
    if not 0.0 <= q <= 100.0:
        raise ValueError(f"percentile q must be within [0, 100], got {q}")
    xs = sorted(samples)
    h = (len(xs) - 1) * q / 100.0
    lo = math.floor(h)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (h - lo) * (xs[hi] - xs[lo])


def median(samples: Sequence[float]) -> float:
    return percentile(samples, 50.0)


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when a side is missing or ``b <= 0`` (the comparison is unknown)."""
    if a is None or b is None or b <= 0 or math.isnan(a) or math.isnan(b):
        return None
    return a / b


def paired_median_ratio(a: Sequence[float | None], b: Sequence[float | None]) -> float | None:
    """Median of ``a[i] / b[i]`` over the rounds where both are known; None if none are."""
    if len(a) != len(b):
        raise ValueError(f"paired ratio of {len(a)} and {len(b)} rounds")
    rs = [r for x, y in zip(a, b, strict=True) if (r := ratio(x, y)) is not None]
    return median(rs) if rs else None


def verdict(value: float | None, threshold: float) -> str:
    """``"pass"`` if ``value >= threshold``, ``"miss"`` if below, ``"n/a"`` if unknown."""
    if value is None:
        return "n/a"
    return "pass" if value >= threshold else "miss"


@dataclass(slots=True)
class Round:
    """One timed stretch of a cell: ``ops`` operations of ``nbytes`` each took ``seconds``."""

    ops: int
    seconds: float
    nbytes: int

    @property
    def ops_per_s(self) -> float:
        return self.ops / self.seconds if self.seconds > 0 else float("nan")

    @property
    def gbps(self) -> float:
        """Decimal GB/s (1e9 bytes), as network and memory bandwidth are quoted."""
        return self.ops_per_s * self.nbytes / 1e9


@dataclass(slots=True)
class CellStats:
    """Per-op latencies of one cell over several rounds, reduced to medians."""

    nbytes: int
    rounds: list[Round] = field(default_factory=list)
    latencies: list[float] = field(default_factory=list)  # seconds, all rounds pooled
    cpu_ms_per_mib: list[float] = field(default_factory=list)  # per round, when measured

    def add_round(self, latencies: Sequence[float], cpu_s: float | None = None) -> None:
        """``cpu_s``: CPU seconds both ends spent on the round (None: not measured)."""
        # A round's throughput is its ops over the time they took (not over loop
        # overhead), so a single slow op lowers it as it would for a real caller.
        self.rounds.append(Round(len(latencies), float(sum(latencies)), self.nbytes))
        self.latencies.extend(latencies)
        moved = len(latencies) * self.nbytes / (1 << 20)
        if cpu_s is not None and moved > 0:
            self.cpu_ms_per_mib.append(cpu_s * 1e3 / moved)

    def round_ops_per_s(self) -> list[float]:
        return [r.ops_per_s for r in self.rounds]

    def summary(self) -> dict[str, Any]:
        """Median over rounds of ops/s and GB/s; p50/p99 over all latencies pooled."""
        if not self.rounds or not self.latencies:
            return {"nbytes": self.nbytes, "n": 0, "rounds": 0, "ops_per_s": None,
                    "gbps": None, "p50_ms": None, "p99_ms": None}
        ops = median(self.round_ops_per_s())
        return {
            "nbytes": self.nbytes,
            "n": len(self.latencies),
            "rounds": len(self.rounds),
            "ops_per_s": ops,
            "gbps": ops * self.nbytes / 1e9,
            "p50_ms": percentile(self.latencies, 50) * 1e3,
            "p99_ms": percentile(self.latencies, 99) * 1e3,
            "round_ops_per_s": self.round_ops_per_s(),
            **({"cpu_ms_per_mib": median(self.cpu_ms_per_mib),
                "round_cpu_ms_per_mib": list(self.cpu_ms_per_mib)}
               if self.cpu_ms_per_mib else {}),
        }


# ---- formatting ----------------------------------------------------------------------------


def size_label(n: int) -> str:
    """Short binary-unit label for table rows: ``64 KiB``, ``1.5 MiB`` (no ``.0``)."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            v = n / (1 << shift)
            return f"{v:.0f} {unit}" if v == int(v) else f"{v:.1f} {unit}"
    return f"{n} B"


def format_number(x: float | None, digits: int = 2) -> str:
    """Fixed ``digits`` decimals below 1000, thousands separators above; ``-`` if unknown."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-"
    if abs(x) >= 1000:
        return f"{x:,.0f}"
    return f"{x:.{digits}f}"


def format_table(headers: Sequence[str], rows: Sequence[Sequence[object]], *,
                 align: str | None = None, sep: str = "  ") -> str:
    """A plain-text table: each column as wide as its widest cell.

    ``align`` has one letter per column, ``l`` or ``r``; by default the first
    column is left-aligned and the others right-aligned (labels, then figures).
    ``None`` cells print as ``-``; floats through ``format_number``.
    """
    ncol = len(headers)
    if align is None:
        align = "l" + "r" * (ncol - 1)
    if len(align) != ncol:
        raise ValueError(f"align has {len(align)} letters for {ncol} columns")
    cells = [[_cell(v) for v in row] for row in rows]
    for r in cells:
        if len(r) != ncol:
            raise ValueError(f"row of {len(r)} cells for {ncol} columns")
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(headers)]

    def line(values: Sequence[str]) -> str:
        parts = [v.ljust(w) if a == "l" else v.rjust(w)
                 for v, w, a in zip(values, widths, align, strict=True)]
        return sep.join(parts).rstrip()

    rule = sep.join("-" * w for w in widths)
    return "\n".join([line(list(headers)), rule, *(line(r) for r in cells)])


def _cell(v: object) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return format_number(v)
    return str(v)


# ---- output --------------------------------------------------------------------------------


def write_json(path: str | os.PathLike[str], obj: Any) -> Path:
    """Writes ``obj`` as indented JSON atomically (a reader never sees half a file)."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    tmp = p.with_name(p.name + ".tmp")
    text = json.dumps(_finite(obj), indent=1, default=_json_default, allow_nan=False)
    tmp.write_text(text + "\n")
    os.replace(tmp, p)
    return p


def _finite(o: Any) -> Any:
    """NaN and infinities as None: they are not JSON, and mean "unknown" in a result."""
    if isinstance(o, float):
        return o if math.isfinite(o) else None
    if isinstance(o, Mapping):
        return {str(k): _finite(v) for k, v in o.items()}
    if isinstance(o, list | tuple):
        return [_finite(v) for v in o]
    return o


def _json_default(o: object) -> Any:
    # NaN is not JSON; numpy scalars are not floats: both appear in benchmark results.
    if hasattr(o, "item"):
        return o.item()
    return str(o)


@dataclass(slots=True)
class Panel:
    """One subplot: ``kind`` "lines" (numeric x) or "bars" (categorical x, grouped)."""

    title: str
    x: Sequence[Any]
    series: Mapping[str, Sequence[float | None]]
    kind: str = "lines"
    xlabel: str = ""
    ylabel: str = ""
    logx: bool = False
    logy: bool = False
    xticklabels: Sequence[str] | None = None
    hlines: Mapping[str, float] = field(default_factory=dict)  # label -> value (a rule)
    horizontal: bool = False  # bars along y: room for long category labels
    height: float = 4.2  # inches; a row is as tall as its tallest panel


def plot_panels(path: str | os.PathLike[str], panels: Sequence[Panel], *, title: str = "",
                ncols: int = 2) -> Path:
    """Draws the panels in a grid and saves a PNG (Agg backend: no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(panels)
    ncols = max(1, min(ncols, n))
    nrows = math.ceil(n / ncols)
    heights = [max(p.height for p in panels[r * ncols : (r + 1) * ncols]) for r in range(nrows)]
    fig, axes = plt.subplots(nrows, ncols, figsize=(6.4 * ncols, sum(heights)), squeeze=False,
                             gridspec_kw={"height_ratios": heights})
    for ax, panel in zip(axes.flat, panels, strict=False):
        _draw(ax, panel)
    for ax in list(axes.flat)[n:]:
        ax.set_visible(False)
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _draw(ax: Any, panel: Panel) -> None:
    if panel.kind == "lines":
        for name, ys in panel.series.items():
            pts = [(x, y) for x, y in zip(panel.x, ys, strict=True) if y is not None]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", label=name)
        if panel.logx:
            ax.set_xscale("log", base=2)
        if panel.xticklabels is not None:
            ax.set_xticks(list(panel.x))
            ax.set_xticklabels(list(panel.xticklabels))
    elif panel.kind == "bars":
        names = list(panel.series)
        width = 0.8 / max(1, len(names))
        labels = list(panel.xticklabels or [str(x) for x in panel.x])
        for j, name in enumerate(names):
            pos = [i + (j - (len(names) - 1) / 2) * width for i in range(len(panel.x))]
            ys = [y if y is not None else 0.0 for y in panel.series[name]]
            if panel.horizontal:
                ax.barh(pos, ys, height=width, label=name)
            else:
                ax.bar(pos, ys, width=width, label=name)
        if panel.horizontal:
            ax.set_yticks(range(len(labels)))
            ax.set_yticklabels(labels, fontsize=7)
            ax.invert_yaxis()  # first category on top, as in the printed table
        else:
            ax.set_xticks(range(len(labels)))
            ax.set_xticklabels(labels, fontsize=7)
    else:
        raise ValueError(f"unknown panel kind {panel.kind!r}")
    for label, y in panel.hlines.items():
        if panel.horizontal:  # the value axis is x
            ax.axvline(y, linestyle="--", linewidth=1, color="grey")
            ax.annotate(label, (y, 1.0), xycoords=("data", "axes fraction"), fontsize=7,
                        va="bottom", color="grey")
        else:
            ax.axhline(y, linestyle="--", linewidth=1, color="grey")
            ax.annotate(label, (0.01, y), xycoords=("axes fraction", "data"), fontsize=7,
                        va="bottom", color="grey")
    if panel.logy:
        if panel.horizontal:
            ax.set_xscale("log")
        else:
            ax.set_yscale("log")
    ax.set_title(panel.title, fontsize=10)
    xlabel, ylabel = ((panel.ylabel, panel.xlabel) if panel.kind == "bars" and panel.horizontal
                      else (panel.xlabel, panel.ylabel))
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(True, alpha=0.3)
    if panel.series:
        ax.legend(fontsize=7)


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress(total: int, desc: str, unit: str = "step") -> Any:
    """A progress bar on stderr (tqdm; drawn only when stderr is a terminal), or a
    no-op bar when tqdm is not installed. ``update(n)`` and ``close()``."""
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc=desc, unit=unit, file=sys.stderr, disable=None, leave=False)
