"""``kvstore``: run a node, move blocks, read stats, run benchmarks.

Every failure a user can cause ends in one line on stderr and a non-zero exit,
never a traceback: 1 for an operation that failed (or a miss), 2 for bad usage.
"""

from __future__ import annotations

import argparse
import enum
import gc
import json
import os
import signal
import sys
import threading
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from benchmarks import cli as bench_cli
from benchmarks.cli import BENCHMARKS as BENCHMARKS
from kvstore.core.errors import KVStoreError
from kvstore.core.keys import parse_key
from kvstore.core.sizes import format_size, parse_size
from kvstore.remote.stat_table import STAT_COLUMNS as STAT_COLUMNS
from kvstore.remote.stat_table import format_stat_table
from replication import cluster_cli

if TYPE_CHECKING:
    from kvstore.node.config import NodeConfig
    from kvstore.node.kv_events import KVEventPublisher
    from kvstore.node.semantics import Node

DEFAULT_ADDR = "127.0.0.1:7600"


class CliError(Exception):
    """A failure to report in one line."""


def _retain(text: str) -> float:
    from kvstore.core.retention import check_retain_s

    try:
        return check_retain_s(float(text))
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).replace("retain_s", "--retain")) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvstore", description="A tiered KV-cache block store.")
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")

    s = sub.add_parser("serve", help="run a store node in the foreground")
    s.add_argument("--config", help="TOML file with any of the options below")
    s.add_argument("--listen", help="gRPC address HOST:PORT (default 127.0.0.1:7600)")
    s.add_argument("--data-port", type=int, help="transfer channel TCP port (default: any free)")
    s.add_argument("--dram-bytes", type=_size, help="DRAM tier size, e.g. 1GiB (default 1GiB)")
    s.add_argument("--block-bytes", type=_size, metavar="SIZE",
                   help="the block size the tier index's memory is planned for: at full "
                   "occupancy each tier holds its size / SIZE blocks, whose metadata must "
                   "fit in memory beside the tiers, or the node refuses to start "
                   "(default 64KiB)")
    s.add_argument("--hbm-bytes", type=_size, help="HBM tier size on a torch device")
    s.add_argument("--hbm-device", help="torch device of the HBM tier (default: cuda if present)")
    s.add_argument("--ssd-path", help="SSD tier file or block device (default: none)")
    s.add_argument("--ssd-bytes", type=_size, help="SSD tier size, e.g. 1TiB")
    s.add_argument("--ssd-io", choices=["auto", "uring", "python"],
                   help="SSD I/O: io_uring or a thread pool (default auto)")
    s.add_argument("--allow-index-rebuild", action="store_const", const=True,
                   help="if the SSD index is damaged, rebuild it from the blocks on the SSD "
                   "(a scan of the whole region) instead of refusing to start")
    s.add_argument("--policy", choices=["lru", "lfu", "prefix"], help="eviction policy")
    s.add_argument("--high-watermark", type=float, help="evict when use passes this fraction")
    s.add_argument("--max-retained-fraction", type=float, metavar="F",
                   help="most of the node's capacity (and of a tenant's quota) puts with "
                        "retain_s may hold (0..1, default 0.5)")
    s.add_argument("--max-prefetch-bytes", type=_size, metavar="SIZE",
                   help="most bytes of blocks the node's prefetches may have on the move at "
                        "once; past it a prefetch answers busy (default 256MiB)")
    s.add_argument("--low-watermark", type=float, help="evict down to this fraction")
    s.add_argument("--no-prefault", dest="prefault", action="store_const", const=False,
                   help="do not touch the DRAM region's pages at start")
    s.add_argument("--no-shm", dest="shm", action="store_const", const=False,
                   help="do not offer same-host shared memory to clients")
    s.add_argument("--grpc-workers", type=int, help="gRPC handler threads (default 16)")
    s.add_argument("--max-request-bytes", type=_size, metavar="SIZE",
                   help="bytes of gRPC requests the node holds at once; past it a call gets "
                        "RESOURCE_EXHAUSTED (default: a quarter of --dram-bytes, from 64MiB "
                        "to 1GiB)")
    s.add_argument("--drain-timeout", type=float,
                   help="seconds to let in-flight requests finish on SIGTERM (default 10)")
    s.add_argument("--read-lease-timeout", type=float, metavar="S",
                   help="seconds a client's read lease or unfinished put may pin space while "
                   "its bytes stall; then it is released (default 30)")
    s.add_argument("--log-level", choices=["debug", "info", "warning", "error"],
                   help="least severe records logged (default info)")
    s.add_argument("--log-format", choices=["text", "json"],
                   help="log lines as text, or one JSON object per line (default text)")
    s.add_argument("--metrics-listen", metavar="HOST:PORT",
                   help="serve Prometheus metrics at http://HOST:PORT/metrics (default: off)")
    s.add_argument("--kv-events-endpoint", metavar="tcp://HOST:PORT",
                   help="publish KV events (vLLM's format, ZeroMQ PUB) there (default: off)")
    s.add_argument("--kv-events-replay-endpoint", metavar="tcp://HOST:PORT",
                   help="answer KV event replay and snapshot requests there (ZeroMQ ROUTER)")
    s.add_argument("--kv-events-secret-key", metavar="FILE",
                   help="serve KV events over CURVE with this secret key (a .key_secret file "
                   "of 'kvstore kv-events keygen'); needs --kv-events-client-keys")
    s.add_argument("--kv-events-client-keys", metavar="PATH",
                   help="CURVE public keys of the subscribers admitted: a .key file, or a "
                   "directory of them")
    t = s.add_argument_group("security (see kvstore/auth/security.py)")
    t.add_argument("--tls-cert", help="server certificate (PEM): TLS on gRPC and the channel")
    t.add_argument("--tls-key", help="the certificate's private key (PEM)")
    t.add_argument("--tls-ca", help="CA bundle that client and peer certificates chain to")
    t.add_argument("--tls-client-auth", action="store_const", const=True,
                   help="require client certificates (mutual TLS; needs --tls-ca)")
    t.add_argument("--auth-file", help="TOML of tenants and bearer tokens; every call must "
                   "then carry a token")
    t.add_argument("--peer-token-file", help="file holding the token this node presents to "
                   "its peers (a cluster-role token in their auth files)")
    t.add_argument("--insecure", action="store_const", const=True,
                   help="allow plaintext on a non-loopback --listen address, and KV events "
                   "without CURVE keys on a non-loopback endpoint")
    c = s.add_argument_group("cluster (with --etcd)")
    c.add_argument("--etcd", help="join the cluster whose etcd is at HOST:PORT")
    c.add_argument("--etcd-ca", help="reach etcd over TLS: CA of etcd's certificate")
    c.add_argument("--etcd-cert", help="client certificate for etcd (mutual TLS)")
    c.add_argument("--etcd-key", help="the etcd client certificate's key")
    c.add_argument("--node-id", help="this node's name in the cluster (default: its address)")
    c.add_argument("--zone", help="failure zone; replicas go to distinct zones first")
    c.add_argument("--advertise", help="address peers and clients use (default: --listen)")
    c.add_argument("--lease-ttl", type=int, help="seconds before etcd drops a silent node "
                   "(default 10)")
    c.add_argument("--replicas", type=int, help="copies the cluster keeps of each block: what "
                   "repair keeps, and the most a tenant's put may ask for (default 2)")
    c.add_argument("--repair-bytes-per-s", type=_size,
                   help="repair bandwidth cap, e.g. 100MiB (default 100MiB)")
    c.add_argument("--repair-interval", type=float,
                   help="seconds between periodic repair passes (default 30)")
    c.add_argument("--members", metavar="HOST:PORT,...",
                   help="static peers: with etcd's view, the only addresses this node sends "
                   "blocks (and its peer token) to when asked to replicate")

    def client_args(sp: argparse.ArgumentParser) -> None:
        sp.add_argument("--addr", default=DEFAULT_ADDR, help=f"node address (default "
                        f"{DEFAULT_ADDR})")
        sp.add_argument("--transport", default="auto", choices=["auto", "grpc", "tcp", "shm"])
        sp.add_argument("--timeout", type=float, default=30.0, help="seconds per call")
        sp.add_argument("--token-file", help="bearer token for a node with tenants "
                        "(default: $KVSTORE_TOKEN)")
        sp.add_argument("--tls-ca", help="CA bundle to verify the node (turns TLS on)")
        sp.add_argument("--tls-cert", help="client certificate, for mutual TLS")
        sp.add_argument("--tls-key", help="the client certificate's key")
        sp.add_argument("--etcd", help="talk to the whole cluster at this etcd HOST:PORT "
                        "instead of one node")
        sp.add_argument("--replicas", type=int, default=2,
                        help="with --etcd: copies per put (default 2)")
        sp.add_argument("--write-quorum", type=int,
                        help="with --etcd: copies to wait for (default: --replicas)")

    s = sub.add_parser("put", help="store a file's bytes under a key")
    client_args(s)
    s.add_argument("key", help="32 hex characters")
    s.add_argument("file", help="file to store ('-' for stdin)")
    s.add_argument("--parent", help="parent key in the prefix chain (hex)")
    s.add_argument("--pin", action="store_true", help="never evict this block")
    s.add_argument("--retain", type=_retain, metavar="S",
                   help="keep the block in the cache S seconds after its last put or read "
                        "(0 < S <= 604800; see docs/node.md, Retention)")

    s = sub.add_parser("get", help="fetch a key's bytes")
    client_args(s)
    s.add_argument("key", help="32 hex characters")
    s.add_argument("-o", "--output", help="file to write (default: stdout)")

    s = sub.add_parser("rm", help="remove keys")
    client_args(s)
    s.add_argument("keys", nargs="+", help="32 hex characters each")

    s = sub.add_parser("prefetch", help="bring blocks up to a memory tier ahead of their use "
                       "(docs/node.md, Prefetch)")
    client_args(s)
    s.add_argument("keys", nargs="+", help="32 hex characters each")
    s.add_argument("--tier", default="dram", help="memory tier: dram (default) or hbm")
    s.add_argument("--wait", action="store_true",
                   help="answer once the moves are done (promoted) instead of planned (queued)")
    s.add_argument("--json", action="store_true",
                   help='print a JSON list of {"key": HEX, "outcome": ...} instead of lines')

    s = sub.add_parser("retain", help="keep stored blocks for some seconds, or release them "
                       "(0) to ordinary eviction (docs/node.md, Retaining stored blocks)")
    client_args(s)
    s.add_argument("keys", nargs="+", help="32 hex characters each")
    s.add_argument("--seconds", type=float, required=True, metavar="S",
                   help="keep each block S seconds after its last put or read; 0 releases")
    s.add_argument("--json", action="store_true",
                   help='print a JSON list of {"key": HEX, "outcome": ...} instead of lines')

    s = sub.add_parser("drain", help="a cluster node leaves, hands its blocks to their new "
                       "owners, then stops (rolling upgrades)")
    client_args(s)
    s.set_defaults(timeout=3600.0)  # a hand-off moves data at the repair rate

    s = sub.add_parser("stat", help="capacity, use and counters per tier")
    client_args(s)
    s.add_argument("--json", action="store_true", help="print JSON instead of a table")

    s = sub.add_parser("health", help="exit 0 if the node answers SERVING (a container probe)")
    s.add_argument("--addr", default=DEFAULT_ADDR, help=f"node address (default {DEFAULT_ADDR})")
    s.add_argument("--timeout", type=float, default=5.0, help="seconds to wait (default 5)")
    s.add_argument("--service", default="",
                   help="grpc.health.v1 service name (default '': the whole node)")
    s.add_argument("--tls-ca", help="CA bundle to verify a node that serves TLS")
    s.add_argument("--tls-cert", help="client certificate, for a node that requires one")
    s.add_argument("--tls-key", help="the client certificate's key")

    cluster_cli.add_parser(sub)

    s = sub.add_parser("kv-events", help="KV event tools: make CURVE keys")
    kv = s.add_subparsers(dest="kv_events_command", required=True, metavar="ACTION")
    k = kv.add_parser("keygen", help="write a CURVE key pair: DIR/NAME.key (public) and "
                      "DIR/NAME.key_secret (mode 0600)")
    k.add_argument("dir", help="directory for the two files (created if missing)")
    k.add_argument("--name", default="kv-events",
                   help="base name of the files (default kv-events)")

    s = sub.add_parser("demo", help="store: one node caching prompt prefixes; serving: "
                       "prefill/decode workers and the Conductor on the store")
    s.add_argument("which", nargs="?", choices=["store", "serving"], default="store")
    s.add_argument("args", nargs=argparse.REMAINDER, help="options of that demo")

    bench_cli.add_parser(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return COMMANDS[args.command](args)
    except (CliError, KVStoreError, ValueError) as exc:
        print(f"kvstore {args.command}: error: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"kvstore {args.command}: error: {exc.strerror or exc}"
              f"{': ' + exc.filename if getattr(exc, 'filename', None) else ''}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


# ---- serve ---------------------------------------------------------------------------------

def cmd_serve(args: argparse.Namespace) -> int:
    from kvstore.core.logs import announce
    from kvstore.core.logs import setup as setup_logging
    from kvstore.node.config import load_config
    from kvstore.node.memory_dump import install_from_env as install_memory_dumps
    from kvstore.node.metrics import NodeMetrics
    from kvstore.node.semantics import Node, NodeSettings
    from kvstore.server import NodeServer

    overrides = {k: getattr(args, k) for k in (
        "log_format", "metrics_listen", "kv_events_endpoint", "kv_events_replay_endpoint",
        "kv_events_secret_key", "kv_events_client_keys",
        "listen", "data_port", "dram_bytes", "block_bytes", "policy", "high_watermark",
        "low_watermark",
        "prefault", "shm", "grpc_workers", "max_request_bytes", "drain_timeout",
        "read_lease_timeout", "log_level",
        "hbm_bytes", "max_retained_fraction", "max_prefetch_bytes", "allow_index_rebuild",
        "hbm_device", "ssd_path", "ssd_bytes", "ssd_io", "etcd", "node_id", "zone", "advertise",
        "lease_ttl", "replicas", "repair_bytes_per_s", "repair_interval", "members", "tls_cert",
        "tls_key",
        "tls_ca", "tls_client_auth", "auth_file", "peer_token_file", "insecure", "etcd_ca",
        "etcd_cert", "etcd_key")}
    cfg = load_config(args.config, overrides)
    setup_logging(cfg.log_level, cfg.log_format)
    fmt = cfg.log_format
    stop = threading.Event()

    def on_signal(*_: object) -> None:
        if not stop.is_set():
            stop.set()
            _exit_watchdog(cfg.drain_timeout + STOP_MARGIN_S, fmt)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, on_signal)
    install_memory_dumps()  # SIGUSR2 dumps, only with KVSTORE_TRACEMALLOC_DIR set
    node = Node(NodeSettings(dram_bytes=cfg.dram_bytes, block_bytes=cfg.block_bytes,
                             policy=cfg.policy,
                             high_watermark=cfg.high_watermark, low_watermark=cfg.low_watermark,
                             prefault=cfg.prefault, hbm_bytes=cfg.hbm_bytes,
                             hbm_device=cfg.hbm_device or None, ssd_path=cfg.ssd_path or None,
                             ssd_bytes=cfg.ssd_bytes, ssd_io=cfg.ssd_io,
                             allow_index_rebuild=cfg.allow_index_rebuild,
                             max_retained_fraction=cfg.max_retained_fraction,
                             max_prefetch_bytes=cfg.max_prefetch_bytes))
    exporter = events = None
    try:
        events = _start_kv_events(cfg, node)
        metrics = NodeMetrics(node) if cfg.metrics_listen else None
        server = NodeServer(node, listen=cfg.listen, data_port=cfg.data_port,
                            grpc_workers=cfg.grpc_workers, enable_shm=cfg.shm,
                            **_security(cfg), metrics=metrics, members=cfg.member_addrs(),
                            read_lease_timeout=cfg.read_lease_timeout,
                            max_request_bytes=cfg.max_request_bytes or None)
        if metrics is not None:
            exporter = _start_exporter(metrics, cfg.metrics_listen, server)
    except BaseException:
        if events is not None:
            events.close()
        node.close()
        raise
    server.start()
    role = None
    if not cfg.etcd and cfg.member_addrs():
        _forward_in_static_cluster(cfg, server, fmt)
    if cfg.etcd:
        try:
            role = _join_cluster(cfg, node, server)
        except BaseException:
            server.stop(grace=0)
            node.close()
            raise
    host, port = server.addresses.channel
    tiers = [f"dram {format_size(cfg.dram_bytes)}"]
    info = node.stats()["node"]
    if cfg.hbm_bytes:
        tiers.insert(0, f"hbm {format_size(cfg.hbm_bytes)} on {info.get('hbm_device')}")
    if cfg.ssd_path:
        tiers.append(f"ssd {format_size(cfg.ssd_bytes)} at {cfg.ssd_path} "
                     f"({info.get('ssd_io')} I/O, {info.get('recovered_blocks', 0)} blocks "
                     f"recovered)")
    if exporter is not None:
        announce(f"kvstore: metrics on {exporter.url}", fmt=fmt)
    # What start-up built (recovered blocks' index entries included) lives as long as the
    # node: frozen out of the collector, a full collection does not walk it again.
    gc.freeze()
    node.add_stat_source(lambda: {"gc_frozen_objects": gc.get_freeze_count()})
    announce(f"kvstore: tier index: at most {info['index_budget']}", fmt=fmt)
    announce(f"kvstore: serving on {server.addresses.grpc} (channel {host}:{port}, "
             f"{', '.join(tiers)}, policy {cfg.policy})", fmt=fmt)
    if role is not None:
        announce(f"kvstore: joined cluster {cfg.etcd} as {role.member.node_id}", fmt=fmt)
        role.watch_view(lambda n: announce(f"kvstore: cluster view: {n} members", fmt=fmt))

        def drain_and_stop() -> dict[str, float]:
            server.health.enter_graceful_shutdown()  # readiness drops as the node leaves
            try:
                return role.drain()
            finally:
                stop.set()  # the reply goes out first: stop() waits for in-flight calls

        server.servicer.drain_handler = drain_and_stop
    while not stop.wait(0.5):
        pass
    if role is not None:
        role.leave()  # first, so clients stop sending new work here
    drained = server.stop(grace=cfg.drain_timeout)
    if exporter is not None:
        exporter.stop()  # before close: a scrape reads the node
    if events is not None:
        events.close()
    node.close()
    announce("kvstore: stopped" + ("" if drained else " (some requests did not finish in time)"),
             fmt=fmt)
    return 0


def _start_kv_events(cfg: NodeConfig, node: Node) -> KVEventPublisher | None:
    """The KV event publisher of ``--kv-events-endpoint`` (kvstore/node/kv_events.py), or None."""
    if not cfg.kv_events_endpoint:
        return None
    from kvstore.core.logs import announce

    try:
        from kvstore.node.kv_events import KVEventPublisher, KVEventSettings
    except ImportError as exc:
        raise CliError(f"--kv-events-endpoint needs the events extra (pip install "
                       f"'kvstore[events]'): {exc}") from None
    try:
        pub = KVEventPublisher(node, KVEventSettings(
            endpoint=cfg.kv_events_endpoint, replay_endpoint=cfg.kv_events_replay_endpoint,
            secret_key=cfg.kv_events_secret_key, client_keys=cfg.kv_events_client_keys,
            insecure=cfg.insecure))
    except ValueError as exc:
        raise CliError(str(exc)) from None
    replay = f" (replay {pub.replay_endpoint})" if pub.replay_endpoint else ""
    curve = ", CURVE" if cfg.kv_events_secret_key else ""
    announce(f"kvstore: KV events on {pub.endpoint}{replay}{curve}", fmt=cfg.log_format)
    return pub


STOP_MARGIN_S = 5.0
"""SIGTERM ends the node within --drain-timeout plus this, whatever is still running."""


def _exit_watchdog(after_s: float, fmt: str) -> None:
    """Ends the process ``after_s`` seconds from now if it has not exited by then: a
    thread stuck in a peer call or a stalled client must not keep a stopping node alive."""
    import os

    from kvstore.core.logs import announce

    def expire() -> None:
        announce(f"kvstore: stopped (forced after {after_s:g}s: some work did not end)",
                 fmt=fmt)
        os._exit(0)

    timer = threading.Timer(after_s, expire)
    timer.daemon = True
    timer.start()


def _security(cfg: Any) -> dict[str, Any]:
    """NodeServer's security arguments from the config (files read and checked here)."""
    from kvstore.auth.security import ServerTls, TenantRegistry

    tls = (ServerTls(cert=cfg.tls_cert, key=cfg.tls_key, ca=cfg.tls_ca or None,
                     client_auth=cfg.tls_client_auth) if cfg.tls_cert else None)
    auth = TenantRegistry.load(cfg.auth_file) if cfg.auth_file else None
    return {"tls": tls, "auth": auth, "insecure": cfg.insecure,
            "peer_token": _read_token(cfg.peer_token_file) if cfg.peer_token_file else None}


def _etcd_tls(cfg: Any) -> Any:
    from kvstore.auth.security import ClientTls

    if not (cfg.etcd_ca or cfg.etcd_cert):
        return None
    return ClientTls(ca=cfg.etcd_ca or None, cert=cfg.etcd_cert or None,
                     key=cfg.etcd_key or None)


def _read_token(path: str) -> str:
    try:
        token = Path(path).read_text().strip()
    except OSError as exc:
        raise CliError(f"cannot read token file {path}: {exc.strerror}") from None
    if not token:
        raise CliError(f"token file {path} is empty")
    return token


def _start_exporter(metrics: Any, listen: str, server: Any) -> Any:
    """The /metrics endpoint; on failure (a bad or busy address) ``server`` is stopped."""
    from kvstore.node.metrics import MetricsExporter

    try:
        return MetricsExporter(metrics, listen)
    except BaseException:
        server.stop(grace=0)
        raise


def _forward_in_static_cluster(cfg: Any, server: Any, fmt: str) -> None:
    """A node of a static cluster (``--members``, no etcd) forwards replicated puts by the
    same list its clients rank (``members=``, ``kvstore_members``: node id = address). Only
    when the list names this node as clients reach it: otherwise it would rank itself as
    another node, and a copy it forwarded to itself would count twice."""
    from kvstore.core.logs import announce
    from replication.membership import StaticMembership
    from replication.placement.rendezvous import Member, NodeId

    me, addrs = cfg.advertise or server.addresses.grpc, cfg.member_addrs()
    if me not in addrs:
        announce(f"kvstore: --members does not list this node ({me}): replicated puts take "
                 f"the two-trip path (put, then Replicate, which needs a cluster-role token)",
                 fmt=fmt)
        return
    server.forwarder.attach(
        StaticMembership([Member(node_id=NodeId(a), addr=a) for a in dict.fromkeys(addrs)]), me,
        replicas=cfg.replicas)


def _join_cluster(cfg: Any, node: Any, server: Any) -> Any:
    from replication.cluster_node import ClusterRole, ClusterSettings

    addr = cfg.advertise or server.addresses.grpc
    capacity = sum(int(t["capacity"]) for t in node.stats()["tiers"].values())
    role = ClusterRole(node, server.peers, ClusterSettings(
        etcd=cfg.etcd, node_id=cfg.node_id or addr, addr=addr, zone=cfg.zone,
        weight=max(capacity / (1 << 30), 1e-6), lease_ttl=cfg.lease_ttl, replicas=cfg.replicas,
        repair_bytes_per_s=cfg.repair_bytes_per_s, repair_interval_s=cfg.repair_interval,
        etcd_tls=_etcd_tls(cfg)), forwarder=server.forwarder)
    server.known_members.follow(
        lambda: [m.addr for m in role.membership.members()],
        wait=lambda ready, timeout: role.membership.wait_for(lambda _: ready(), timeout))
    role.join()
    return role


# ---- client commands -----------------------------------------------------------------------

def _client(args: argparse.Namespace) -> Any:
    from kvstore.auth.security import ClientTls
    from kvstore.client import Client

    token = _read_token(args.token_file) if args.token_file else os.environ.get("KVSTORE_TOKEN")
    tls = (ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
           if args.tls_ca or args.tls_cert else None)
    common: dict[str, Any] = {"transport": args.transport, "timeout": args.timeout,
                              "token": token or None, "tls": tls}
    if args.etcd:
        return Client(etcd=args.etcd, replicas=args.replicas, write_quorum=args.write_quorum,
                      **common)
    return Client(args.addr, **common)


def cmd_put(args: argparse.Namespace) -> int:
    key = parse_key(args.key)
    parent = parse_key(args.parent) if args.parent else None
    if args.file == "-":
        data = sys.stdin.buffer.read()
    else:
        with open(args.file, "rb") as f:
            data = f.read()
    with _client(args) as c:
        stored = c.put(key, data, parent=parent, pin=args.pin, retain_s=args.retain)
    kept = f", retain {args.retain:g} s" if args.retain else ""
    print(f"{'stored' if stored else 'exists'} {key.hex()} ({len(data)} bytes{kept})")
    return 0


def cmd_get(args: argparse.Namespace) -> int:
    key = parse_key(args.key)
    with _client(args) as c:
        value = c.get(key)
    if value is None:
        raise CliError(f"key {key.hex()} not found")
    if args.output:
        with open(args.output, "wb") as f:
            f.write(value)
    else:
        sys.stdout.buffer.write(value)
        sys.stdout.buffer.flush()
    return 0


def cmd_rm(args: argparse.Namespace) -> int:
    keys = [parse_key(k) for k in args.keys]
    missing = 0
    with _client(args) as c:
        for key in keys:
            removed = c.remove(key)
            missing += not removed
            print(f"{'removed' if removed else 'absent'} {key.hex()}")
    return 1 if missing else 0


def _print_outcomes(keys: Sequence[bytes], outcomes: Sequence[enum.Enum], *,
                    as_json: bool) -> None:
    """``OUTCOME KEY`` per key, or a JSON list of ``{"key", "outcome"}``, in key order."""
    if as_json:
        print(json.dumps([{"key": k.hex(), "outcome": o.value}
                          for k, o in zip(keys, outcomes, strict=True)], indent=2))
    else:
        for k, o in zip(keys, outcomes, strict=True):
            print(f"{o.value} {k.hex()}")


def cmd_prefetch(args: argparse.Namespace) -> int:
    """One line per key, ``OUTCOME KEY``; exit 1 unless every key is (or is on its way) up:
    present, queued or promoted."""
    from kvstore.core.prefetch import PrefetchOutcome

    keys = [parse_key(k) for k in args.keys]
    with _client(args) as c:
        outcomes = c.prefetch(keys, args.tier, wait=args.wait)
    _print_outcomes(keys, outcomes, as_json=args.json)
    up = {PrefetchOutcome.PRESENT, PrefetchOutcome.QUEUED, PrefetchOutcome.PROMOTED}
    return 0 if all(o in up for o in outcomes) else 1


def cmd_retain(args: argparse.Namespace) -> int:
    """One line per key, ``OUTCOME KEY``; exit 1 unless every key was retained (released,
    with ``--seconds 0``)."""
    keys = [parse_key(k) for k in args.keys]
    with _client(args) as c:
        outcomes = c.retain(keys, args.seconds)
    _print_outcomes(keys, outcomes, as_json=args.json)
    return 0 if all(o in ("retained", "released") for o in outcomes) else 1


def cmd_stat(args: argparse.Namespace) -> int:
    with _client(args) as c:
        stats = c.stats()
    if args.json:
        print(json.dumps(stats, indent=2, sort_keys=True))
        return 0
    if args.etcd:  # one table per node
        print("\n\n".join(f"== {nid}\n" + (format_stat_table(st) if "tiers" in st
                                               else f"error: {st['error']}")
                          for nid, st in stats.items()))
        return 0
    print(format_stat_table(stats))
    return 0


def cmd_health(args: argparse.Namespace) -> int:
    """One grpc.health.v1 Check: exit 0 on SERVING, else one line and exit 1."""
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    host, _, port = args.addr.rpartition(":")
    if not host or not port.isdigit():
        raise CliError(f"address must be HOST:PORT, got {args.addr!r}")
    if not args.timeout > 0:
        raise CliError(f"--timeout must be positive, got {args.timeout}")
    from kvstore.auth.security import ClientTls

    tls = (ClientTls(ca=args.tls_ca, cert=args.tls_cert, key=args.tls_key)
           if args.tls_ca or args.tls_cert else None)
    channel = (grpc.secure_channel(args.addr, tls.grpc_credentials()) if tls
               else grpc.insecure_channel(args.addr))
    with channel:
        try:
            reply = health_pb2_grpc.HealthStub(channel).Check(  # type: ignore[attr-defined]  # the stub omits the generated method
                health_pb2.HealthCheckRequest(service=args.service), timeout=args.timeout)
        except grpc.RpcError as exc:
            call: Any = exc  # a failed unary call is also a grpc.Call
            details = " ".join(str(call.details() or "").split())
            if call.code() == grpc.StatusCode.NOT_FOUND:
                details = f"no health status for service {args.service!r}"
            raise CliError(f"{args.addr}: {call.code().name}: {details}") from None
    status = health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status)
    if reply.status != health_pb2.HealthCheckResponse.SERVING:
        raise CliError(f"{args.addr} is {status}")
    print(f"{args.addr} {status}")
    return 0


def cmd_drain(args: argparse.Namespace) -> int:
    if args.etcd:
        raise CliError("drain names one node: give --addr, not --etcd")
    with _client(args) as c:
        reply = c.drain()
    print(f"drained {args.addr}: {reply.blocks} blocks; {reply.copies} copies made on their "
          f"owners ({format_size(reply.bytes_copied)}) in {reply.seconds:.1f}s; the node is "
          f"stopping")
    return 0


def cmd_kv_events(args: argparse.Namespace) -> int:
    """``kvstore kv-events keygen DIR``: a CURVE key pair for a node or a subscriber."""
    try:
        from kvstore.auth.curve import write_keypair

        public, secret = write_keypair(args.dir, args.name)
    except ImportError as exc:
        raise CliError(f"CURVE keys need the events extra (pip install 'kvstore[events]'): "
                       f"{exc}") from None
    except FileExistsError as exc:
        raise CliError(str(exc)) from None
    print(f"public key {public} (hand it out: a node's to its subscribers, a subscriber's "
          f"to --kv-events-client-keys)")
    print(f"secret key {secret} (keep it: --kv-events-secret-key, or a subscriber's "
          f"secret_key)")
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    if args.which == "serving":
        try:
            from conductor.demo import main as serving_demo
        except ImportError as exc:
            raise CliError(f"the serving demo needs the torch extra (pip install "
                           f"'kvstore[torch]'): {exc}") from None
        return int(serving_demo(args.args) or 0)
    from kvstore.demo import main as store_demo

    return int(store_demo(args.args) or 0)


COMMANDS = {
    "demo": cmd_demo,
    "drain": cmd_drain,
    "cluster": cluster_cli.run,
    "serve": cmd_serve,
    "put": cmd_put,
    "get": cmd_get,
    "rm": cmd_rm,
    "prefetch": cmd_prefetch,
    "retain": cmd_retain,
    "stat": cmd_stat,
    "bench": bench_cli.run,
    "health": cmd_health,
    "kv-events": cmd_kv_events,
}
