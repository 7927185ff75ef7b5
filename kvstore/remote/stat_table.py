"""The per-tier table of ``kvstore stat`` (and of the demo): one row per tier, sizes
readable, then the node's counters. Apart from the CLI so the demos share it."""

from __future__ import annotations

from kvstore.core.sizes import format_size

STAT_COLUMNS = ("capacity", "used", "blocks", "hits", "misses", "evictions", "demotions",
                "promotions", "checksum_failures")
_OWN_LINES = frozenset({"prefetch_blocks", "prefetch_bytes_in_flight"})
"""Node items printed on a line of their own, not again in the ``node:`` line."""


def format_stat_table(stats: dict) -> str:
    extra = sorted({k for t in stats["tiers"].values() for k in t}
                   - set(STAT_COLUMNS) - {"name"})
    cols = ["tier", *STAT_COLUMNS, *extra]
    rows = []
    for name, t in stats["tiers"].items():
        row = [name]
        for col in cols[1:]:
            v = t.get(col)  # a tenant's view has fewer columns (kvstore.auth.tenancy)
            row.append("" if v is None else format_size(v) if col in ("capacity", "used")
                       else str(v))
        rows.append(row)
    widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(cols)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(cols, widths, strict=True))]
    lines += ["  ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) for r in rows]
    node = ", ".join(f"{k}={v}" for k, v in sorted(stats["node"].items())
                     if k not in _OWN_LINES)
    return "\n".join([*lines, *_retained_line(stats["node"]), *_prefetch_line(stats["node"]),
                      f"node: {node}"])


def _retained_line(node: dict) -> list[str]:
    """``retained: N blocks, SIZE of CAP`` when the node reports retention."""
    if "retained_blocks" not in node:
        return []
    cap = node.get("retained_cap_bytes")
    of = f" of {format_size(int(cap))} allowed" if cap is not None else ""
    return [f"retained: {node['retained_blocks']} blocks, "
            f"{format_size(int(node['retained_bytes']))}{of}, "
            f"{node.get('retention_denied', 0)} refused"]


def _prefetch_line(node: dict) -> list[str]:
    """``prefetched: N present, N promoted, ... ; SIZE in flight`` when the node reports
    prefetches (``kvstore.core.prefetch``)."""
    blocks = node.get("prefetch_blocks")
    if blocks is None:
        return []
    counts = ", ".join(f"{n} {outcome}" for outcome, n in blocks.items())
    return [f"prefetched: {counts}; "
            f"{format_size(int(node.get('prefetch_bytes_in_flight', 0)))} in flight"]
