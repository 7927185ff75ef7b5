"""``kvstore cluster up | down | status``: a local cluster's lifecycle and a live view.

``add_parser`` and ``run`` register the command into the ``kvstore`` CLI (``kvstore/cli.py``).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from pathlib import Path
from typing import Any

from kvstore.core.errors import KVStoreError
from kvstore.core.sizes import format_size
from replication.local_cluster import ClusterError, LocalCluster

STATUS_COLUMNS = ("node", "addr", "zone", "health", "capacity", "used", "blocks",
                  "repair_backlog")


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("cluster", help="start, stop or inspect a cluster")
    csub = p.add_subparsers(dest="cluster_command", required=True, metavar="ACTION")
    up = csub.add_parser("up", help="start etcd and N nodes on loopback")
    up.add_argument("-n", type=int, default=3, help="number of nodes (default 3)")
    up.add_argument("--dir", required=True, help="directory for logs, etcd data and "
                    "cluster.json")
    up.add_argument("--dram-bytes", default="256MiB", help="DRAM tier per node (default 256MiB)")
    up.add_argument("--replicas", type=int, default=2, help="copies repair keeps (default 2)")
    up.add_argument("--lease-ttl", type=int, default=10, help="membership lease seconds")
    up.add_argument("--zones", default="", help="comma-separated zones, assigned round-robin")
    up.add_argument("--serve-args", default="", help="more `kvstore serve` flags, one string")
    up.add_argument("--json", action="store_true", help="print cluster.json instead of a table")
    down = csub.add_parser("down", help="stop the processes `up` started in DIR")
    down.add_argument("--dir", required=True)
    st = csub.add_parser("status", help="live nodes with capacity, use and health")
    st.add_argument("--etcd", required=True, help="HOST:PORT of the cluster's etcd")
    st.add_argument("--json", action="store_true", help="print JSON instead of a table")
    st.add_argument("--token-file", help="bearer token for nodes with tenants "
                    "(default: $KVSTORE_TOKEN)")
    st.add_argument("--tls-ca", help="CA bundle to verify nodes that serve TLS")
    st.add_argument("--etcd-ca", help="reach etcd over TLS: CA of etcd's certificate")
    st.add_argument("--etcd-cert", help="client certificate for etcd")
    st.add_argument("--etcd-key", help="the etcd client certificate's key")
    st.add_argument("--watch", action="store_true",
                    help="first wait until the total repair backlog is 0, with a progress "
                         "bar on stderr when it is a terminal")
    st.add_argument("--interval", type=float, default=1.0,
                    help="seconds between polls with --watch (default 1)")


def run(args: argparse.Namespace) -> int:
    try:
        return {"up": _up, "down": _down, "status": _status}[args.cluster_command](args)
    except ClusterError as exc:
        raise KVStoreError(str(exc)) from None


def _up(args: argparse.Namespace) -> int:
    node_args = ["--dram-bytes", args.dram_bytes, "--replicas", str(args.replicas),
                 "--lease-ttl", str(args.lease_ttl), *shlex.split(args.serve_args)]
    zones = [z for z in args.zones.split(",") if z]
    cluster = LocalCluster.up(args.dir, args.n, node_args=node_args, zones=zones)
    manifest = (cluster.dir / "cluster.json").read_text()
    if args.json:
        print(manifest, end="")
        return 0
    print(f"etcd   {cluster.etcd}  (pid {cluster.etcd_pid})")
    for r in cluster.nodes:
        print(f"{r.id:<6} {r.addr}  (pid {r.pid})")
    print(f"wrote {cluster.dir / 'cluster.json'}; stop with: kvstore cluster down --dir "
          f"{args.dir}")
    return 0


def _down(args: argparse.Namespace) -> int:
    stopped = LocalCluster.load(args.dir).down()
    print(f"stopped {', '.join(stopped) if stopped else 'nothing (no process was running)'}")
    return 0


def credentials(args: argparse.Namespace) -> dict[str, Any]:
    """Token and TLS settings for ``cluster_status`` from the flags (and $KVSTORE_TOKEN)."""
    from kvstore.auth.security import ClientTls

    token = (Path(args.token_file).read_text().strip() if args.token_file
             else os.environ.get("KVSTORE_TOKEN")) or None
    etcd_tls = (ClientTls(ca=args.etcd_ca, cert=args.etcd_cert, key=args.etcd_key)
                if args.etcd_ca or args.etcd_cert else None)
    return {"token": token, "tls": ClientTls(ca=args.tls_ca) if args.tls_ca else None,
            "etcd_tls": etcd_tls}


def cluster_status(etcd: str, *, token: str | None = None, tls: Any = None,
                   etcd_tls: Any = None) -> list[dict[str, Any]]:
    """One row per live member: its registration and what its Stats RPC says."""
    from replication.cluster_client import ClusterClient
    from replication.membership.etcd import EtcdMembership

    with EtcdMembership(etcd, tls=etcd_tls) as membership:
        members = membership.members()
        if not members:
            return []
        with ClusterClient(membership=membership, node_timeout=3.0, token=token,
                           tls=tls) as client:
            stats = client.stats()
    rows = []
    for m in members:
        s = stats.get(m.node_id, {"error": "no answer"})
        row: dict[str, Any] = {"node": m.node_id, "addr": m.addr, "zone": m.zone,
                               "weight": m.weight}
        if "error" in s:
            row |= {"health": "unreachable", "error": s["error"]}
        else:
            tiers = s["tiers"].values()
            node = s["node"]
            row |= {"health": "draining" if node.get("draining") else "ok",
                    "capacity": sum(t.get("capacity", 0) for t in tiers),
                    "used": sum(t.get("used", 0) for t in tiers),
                    "blocks": sum(t.get("blocks", 0) for t in tiers),
                    "repair_backlog": node.get("repair_backlog", 0),
                    "etcd_connected": node.get("etcd_connected"),
                    "tiers": {n: {"capacity": t.get("capacity"), "used": t.get("used"),
                                  "blocks": t.get("blocks")} for n, t in s["tiers"].items()}}
        rows.append(row)
    return rows


def _status(args: argparse.Namespace) -> int:
    creds = credentials(args)
    if args.watch:
        watch_repair(args.etcd, interval=args.interval, **creds)
    rows = cluster_status(args.etcd, **creds)
    if args.json:
        print(json.dumps({"etcd": args.etcd, "nodes": rows}, indent=2))
        return 0
    if not rows:
        print(f"no live nodes registered in {args.etcd}")
        return 1
    table = [[_cell(r, c) for c in STATUS_COLUMNS] for r in rows]
    widths = [max(len(c), *(len(t[i]) for t in table)) for i, c in enumerate(STATUS_COLUMNS)]
    print("  ".join(c.ljust(w) for c, w in zip(STATUS_COLUMNS, widths, strict=True)))
    for t in table:
        print("  ".join(v.ljust(w) for v, w in zip(t, widths, strict=True)))
    return 0 if all(r["health"] == "ok" for r in rows) else 1


def watch_repair(etcd: str, *, interval: float = 1.0, **creds: Any) -> None:
    """Returns once the live nodes' repair backlogs add up to 0, polling every ``interval`` s.

    The bar (stderr, only when it is a terminal) counts blocks repaired out of the
    highest total backlog seen, which grows if a new membership change adds work.
    A backlog is what each node's last repair pass had left to check, so right after
    a change, before any pass started, it can already read 0.
    """
    if interval <= 0:
        raise KVStoreError(f"--interval must be positive, got {interval}")
    bar: Any = None
    high = 0
    try:
        while True:
            backlog = sum(int(r.get("repair_backlog", 0))
                          for r in cluster_status(etcd, **creds))
            high = max(high, backlog)
            if bar is None:
                bar = _progress_bar(high)
            if bar is not None:
                bar.total = high
                bar.n = high - backlog
                bar.set_postfix_str(f"{backlog} left", refresh=False)
                bar.refresh()
            if backlog == 0:
                return
            time.sleep(interval)
    finally:
        if bar is not None:
            bar.close()


def _progress_bar(total: int) -> Any:
    """A tqdm bar on stderr (disabled unless stderr is a terminal), or None without tqdm:
    the bar is optional (the bench extra installs it); the wait is not."""
    try:
        from tqdm import tqdm
    except ImportError:
        return None
    return tqdm(total=total, desc="repair backlog", unit="block", file=sys.stderr, disable=None)


def _cell(row: dict[str, Any], col: str) -> str:
    v = row.get(col, "")
    if col in ("capacity", "used") and isinstance(v, int):
        return format_size(v)
    return str(v)
