"""Prometheus metrics of a node (``kvstore serve --metrics-listen HOST:PORT``).

Two kinds, both declared once in ``METRICS`` (the exporter, the reference in
docs/metrics.md and the Grafana dashboard's test all read that table):

* Store counters and gauges (tiers, node, cluster repair) are read from
  ``Node.stats()`` at scrape time by ``NodeCollector``: the node's counters are
  the only bookkeeping, so a scrape and ``kvstore stat`` can never disagree.
  Cluster families are always declared; they have samples only on a node that
  joined a cluster (``--etcd``).
* Request latencies are measured where requests are served: gRPC calls by
  ``RequestInterceptor`` (a ``grpc.ServerInterceptor``), transfer-channel ops by
  ``NodeMetrics.timed_channel_op`` around each op's handler. A request is
  observed once, after its handler finished (for channel ops: after the reply
  was sent), so a client may see a reply a moment before its observation.

The interceptor also gives every gRPC call its request id (``kvstore.core.logs``):
it logs failed calls with it and returns it in the trailing metadata of every
failed call, where the client picks it up. It never maps errors to status
codes: ``_rpc`` in ``kvstore/server.py`` stays the one place that does.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import grpc
from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    InfoMetricFamily,
    Metric,
)
from prometheus_client.exposition import generate_latest, start_http_server

from kvstore.core.errors import KVStoreError
from kvstore.core.logs import REQUEST_ID_HEADER, accept_request_id, request_scope

if TYPE_CHECKING:
    from kvstore.node.semantics import Node

log = logging.getLogger("kvstore.requests")

LATENCY_BUCKETS = (0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
                   0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
"""Seconds. A DRAM hit over the channel takes tens of microseconds, a large batch over gRPC
or an SSD read milliseconds: the buckets span both."""


@dataclass(frozen=True, slots=True, kw_only=True)
class MetricSpec:
    """One metric family as exposed: ``name`` is the exposed name (counters end in
    ``_total``, the info metric in ``_info``); ``stat`` is the ``Node.stats()`` key it
    is read from ("" for request metrics, measured rather than read)."""

    name: str
    type: str  # "counter" | "gauge" | "histogram" | "info"
    labels: tuple[str, ...]
    help: str
    stat: str = ""


def _tier(name: str, kind: str, stat: str, text: str) -> MetricSpec:
    return MetricSpec(name=name, type=kind, labels=("tier",), help=text, stat=stat)


TIER_METRICS: tuple[MetricSpec, ...] = (
    _tier("kvstore_tier_capacity_bytes", "gauge", "capacity", "Bytes the tier can hold."),
    _tier("kvstore_tier_used_bytes", "gauge", "used", "Bytes allocated in the tier."),
    _tier("kvstore_tier_blocks", "gauge", "blocks", "Blocks stored in the tier."),
    _tier("kvstore_tier_hits_total", "counter", "hits",
          "Block reads served from the tier (each key of a batch counts)."),
    _tier("kvstore_tier_misses_total", "counter", "misses",
          "Block reads that found no block (counted on the landing tier)."),
    _tier("kvstore_tier_puts_total", "counter", "puts",
          "Blocks stored by puts (on the landing tier; a put of an existing key is not one)."),
    _tier("kvstore_tier_bytes_in_total", "counter", "bytes_in", "Bytes stored by puts."),
    _tier("kvstore_tier_bytes_out_total", "counter", "bytes_out", "Bytes of blocks read (hits)."),
    _tier("kvstore_tier_evictions_total", "counter", "evictions",
          "Blocks dropped from the tier to make room."),
    _tier("kvstore_tier_demotions_total", "counter", "demotions",
          "Blocks moved from this tier to the next one down."),
    _tier("kvstore_tier_promotions_total", "counter", "promotions",
          "Blocks moved into this tier from the one below."),
    _tier("kvstore_tier_checksum_failures_total", "counter", "checksum_failures",
          "Blocks whose bytes failed their checksum (reported missing, never returned)."),
)

NODE_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="kvstore_gets_total", type="counter", labels=(),
               help="Block reads: hits on every tier plus misses (each key of a batch counts)."),
    MetricSpec(name="kvstore_puts_total", type="counter", labels=(),
               help="Blocks stored by puts, all tiers."),
    MetricSpec(name="kvstore_node_draining", type="gauge", labels=(), stat="draining",
               help="1 while the node refuses new requests (SIGTERM received), else 0."),
    MetricSpec(name="kvstore_node_in_flight_requests", type="gauge", labels=(), stat="in_flight",
               help="Requests being served (gRPC calls and channel ops)."),
    MetricSpec(name="kvstore_node_pending_promotions", type="gauge", labels=(),
               stat="pending_promotions", help="Blocks waiting to move one tier up."),
    MetricSpec(name="kvstore_node_uptime_seconds", type="gauge", labels=(), stat="uptime_s",
               help="Seconds since the node started."),
    MetricSpec(name="kvstore_retained_blocks", type="gauge", labels=(), stat="retained_blocks",
               help="Blocks kept by a put's retain_s whose retention has not ended."),
    MetricSpec(name="kvstore_retained_bytes", type="gauge", labels=(), stat="retained_bytes",
               help="Bytes of the retained blocks."),
    MetricSpec(name="kvstore_retained_cap_bytes", type="gauge", labels=(),
               stat="retained_cap_bytes",
               help="Most bytes retention may hold (--max-retained-fraction of capacity)."),
    MetricSpec(name="kvstore_retention_denied_total", type="counter", labels=(),
               stat="retention_denied",
               help="Puts stored without the retention they asked for (over a cap)."),
    MetricSpec(name="kvstore_prefetch_blocks_total", type="counter", labels=("outcome",),
               stat="prefetch_blocks",
               help="Blocks prefetch calls named, by final outcome (present, promoted, "
                    "missing, no_room, busy, undone); a queued block counts when its move "
                    "ends."),
    MetricSpec(name="kvstore_prefetch_bytes_in_flight", type="gauge", labels=(),
               stat="prefetch_bytes_in_flight",
               help="Bytes of blocks prefetches planned and have not finished moving "
                    "(at most --max-prefetch-bytes)."),
    MetricSpec(name="kvstore_ssd_index_rebuilds_total", type="counter", labels=(),
               stat="ssd_index_rebuilds",
               help="SSD indexes found damaged at start and rebuilt from the blocks on the SSD "
                    "(--allow-index-rebuild); a node with a damaged index and without the "
                    "flag does not start."),
    MetricSpec(name="kvstore_ssd_rebuilt_blocks", type="gauge", labels=(),
               stat="ssd_rebuilt_blocks",
               help="Blocks the SSD index rebuild at start found intact and serves "
                    "(0 without a rebuild)."),
    MetricSpec(name="kvstore_ssd_rebuild_dropped_blocks", type="gauge", labels=(),
               stat="ssd_rebuild_dropped_blocks",
               help="Blocks the SSD index rebuild at start found torn, corrupt or superseded "
                    "by a newer copy: not served."),
    MetricSpec(name="kvstore_grpc_request_bytes_held", type="gauge", labels=(),
               stat="request_bytes_held",
               help="Bytes of gRPC request messages being served, counted against "
                    "--max-request-bytes."),
    MetricSpec(name="kvstore_grpc_request_bytes_limit", type="gauge", labels=(),
               stat="request_bytes_limit",
               help="The node's --max-request-bytes: most bytes of gRPC requests it holds."),
    MetricSpec(name="kvstore_grpc_requests_refused_for_memory_total", type="counter",
               labels=(), stat="requests_refused_for_memory",
               help="gRPC calls refused with RESOURCE_EXHAUSTED: their message would have "
                    "passed --max-request-bytes."),
    MetricSpec(name="kvstore_node_info", type="info",
               labels=("policy", "node_id", "zone", "hbm_device", "ssd_io"),
               help="Constant 1; the labels describe the node (empty when not applicable)."),
)

CLUSTER_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="kvstore_repair_backlog_blocks", type="gauge", labels=(),
               stat="repair_backlog",
               help="Blocks the running repair pass has yet to check (0 between passes)."),
    MetricSpec(name="kvstore_repaired_blocks_total", type="counter", labels=(),
               stat="repaired_blocks", help="Blocks repair copied from this node to an owner."),
    MetricSpec(name="kvstore_repaired_bytes_total", type="counter", labels=(),
               stat="repaired_bytes", help="Bytes repair copied from this node."),
    MetricSpec(name="kvstore_repair_failures_total", type="counter", labels=(),
               stat="repair_failures", help="Repair copies that failed (retried next pass)."),
    MetricSpec(name="kvstore_repair_passes_total", type="counter", labels=(),
               stat="repair_passes", help="Repair passes run."),
    MetricSpec(name="kvstore_cluster_members", type="gauge", labels=(), stat="cluster_members",
               help="Live members this node sees in etcd."),
    MetricSpec(name="kvstore_etcd_connected", type="gauge", labels=(), stat="etcd_connected",
               help="1 while the node's etcd session is up, else 0."),
)

REQUEST_METRICS: tuple[MetricSpec, ...] = (
    MetricSpec(name="kvstore_grpc_request_duration_seconds", type="histogram",
               labels=("method",), help="Time a gRPC call spent in its handler."),
    MetricSpec(name="kvstore_grpc_requests_total", type="counter", labels=("method", "code"),
               help="gRPC calls by method and status code."),
    MetricSpec(name="kvstore_channel_request_duration_seconds", type="histogram",
               labels=("op",), help="Time a transfer-channel op took, its payload and reply "
                                    "included."),
    MetricSpec(name="kvstore_channel_requests_total", type="counter", labels=("op", "code"),
               help="Transfer-channel ops by op and outcome (OK or a status code name)."),
)

METRICS: tuple[MetricSpec, ...] = TIER_METRICS + NODE_METRICS + CLUSTER_METRICS + REQUEST_METRICS
"""Every kvstore_* family the exporter exposes. The standard ``process_*`` families of
prometheus_client (CPU, memory, open files) are exposed too."""

_BY_NAME = {m.name: m for m in METRICS}


def _family(spec: MetricSpec) -> Metric:
    return _info_family(spec) if spec.type == "info" else _number_family(spec)


def _number_family(spec: MetricSpec) -> CounterMetricFamily | GaugeMetricFamily:
    if spec.type == "counter":
        return CounterMetricFamily(spec.name, spec.help, labels=spec.labels)
    if spec.type == "gauge":
        return GaugeMetricFamily(spec.name, spec.help, labels=spec.labels)
    raise ValueError(f"{spec.name}: a {spec.type} is not read from stats")


def _info_family(spec: MetricSpec) -> InfoMetricFamily:
    return InfoMetricFamily(spec.name.removesuffix("_info"), spec.help, labels=())


class NodeCollector:
    """Reads ``node.stats()`` once per scrape and turns it into the families above."""

    def __init__(self, node: Node) -> None:
        self._node = node

    def describe(self) -> Iterable[Metric]:
        return [_family(s) for s in TIER_METRICS + NODE_METRICS + CLUSTER_METRICS]

    def collect(self) -> Iterator[Metric]:
        stats = self._node.stats()
        tiers: dict[str, dict[str, Any]] = stats["tiers"]
        for spec in TIER_METRICS:
            family = _number_family(spec)
            for name, t in tiers.items():
                family.add_metric([name], float(t.get(spec.stat, 0)))
            yield family
        node: dict[str, Any] = stats["node"]
        derived = {"kvstore_gets_total": sum(t.get("hits", 0) + t.get("misses", 0)
                                             for t in tiers.values()),
                   "kvstore_puts_total": sum(t.get("puts", 0) for t in tiers.values())}
        for spec in NODE_METRICS + CLUSTER_METRICS:
            if spec.type == "info":
                info = _info_family(spec)
                info.add_metric([], {k: str(node.get(k, "")) for k in spec.labels})
                yield info
                continue
            family = _number_family(spec)
            if spec.name in derived:
                family.add_metric([], float(derived[spec.name]))
            elif spec.stat in node:  # cluster keys exist only on a node in a cluster
                stat = node[spec.stat]
                if spec.labels:  # a mapping: one sample per item, its key the label
                    for label, n in sorted(stat.items()):
                        family.add_metric([label], float(n))
                else:
                    family.add_metric([], float(stat))
            yield family


class NodeMetrics:
    """The registry of one node: its stats collector, request metrics and process metrics.

    Thread-safe: gRPC worker and channel threads observe concurrently
    (prometheus_client's metrics lock per child).
    """

    def __init__(self, node: Node) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(NodeCollector(node))
        ProcessCollector(registry=self.registry)
        requests = CollectorRegistry(auto_describe=True)
        self.registry.register(_WithoutCreated(requests))

        def spec(name: str) -> dict[str, Any]:
            s = _BY_NAME[name]
            return {"name": s.name, "documentation": s.help, "labelnames": s.labels,
                    "registry": requests}

        self.grpc_seconds = Histogram(**spec("kvstore_grpc_request_duration_seconds"),
                                      buckets=LATENCY_BUCKETS)
        self.grpc_calls = Counter(**spec("kvstore_grpc_requests_total"))
        self.channel_seconds = Histogram(**spec("kvstore_channel_request_duration_seconds"),
                                         buckets=LATENCY_BUCKETS)
        self.channel_ops = Counter(**spec("kvstore_channel_requests_total"))

    def observe_grpc(self, method: str, code: grpc.StatusCode, seconds: float) -> None:
        self.grpc_seconds.labels(method).observe(seconds)
        self.grpc_calls.labels(method, code.name).inc()

    def timed_channel_op(self, op: str, handler: Callable[[int, bytes], None]
                         ) -> Callable[[int, bytes], None]:
        """``handler`` observed under ``op``; the outcome is ``OK``, the KVStoreError's code
        name, or ``UNKNOWN`` (the connection broke mid-op)."""
        seconds = self.channel_seconds.labels(op)
        ok = self.channel_ops.labels(op, "OK")
        ops = self.channel_ops

        def timed(count: int, meta: bytes) -> None:
            started = time.perf_counter()
            try:
                handler(count, meta)
            except BaseException as exc:
                error = getattr(exc, "error", exc)  # the channel's _Abandon wraps one
                code = error.code.name if isinstance(error, KVStoreError) else "UNKNOWN"
                ops.labels(op, code).inc()
                raise
            else:
                ok.inc()
            finally:
                seconds.observe(time.perf_counter() - started)

        return timed

    def render(self) -> bytes:
        """The exposition text a scrape returns."""
        return generate_latest(self.registry)


class _WithoutCreated:
    """``source``'s families minus their ``*_created`` samples.

    prometheus_client adds a creation timestamp series to every counter and
    histogram child; it doubles the series count and no dashboard here uses it.
    Filtering here, rather than with its process-wide switch, leaves other
    registries in the process as they are.
    """

    def __init__(self, source: CollectorRegistry) -> None:
        self._source = source

    def collect(self) -> Iterator[Metric]:
        for family in self._source.collect():
            family.samples = [s for s in family.samples if not s.name.endswith("_created")]
            yield family


class RequestInterceptor(grpc.ServerInterceptor):
    """Request ids, latency and failure logs for every unary gRPC call.

    Per call: the id from the client's ``x-request-id`` metadata (if sane) or a new
    one; the handler runs in ``request_scope(id)``; if it fails, the id goes into the
    call's trailing metadata and a log line names method, status code, details and
    id (INTERNAL errors are logged, with their traceback, by ``_rpc``). With
    ``metrics``, the handler's time is observed under its method name.
    """

    def __init__(self, metrics: NodeMetrics | None = None) -> None:
        self._metrics = metrics
        self._wrapped: dict[str, grpc.RpcMethodHandler] = {}  # races only duplicate work

    def intercept_service(self, continuation: Callable[[grpc.HandlerCallDetails], Any],
                          handler_call_details: grpc.HandlerCallDetails) -> Any:
        full_name: str = handler_call_details.method
        wrapped = self._wrapped.get(full_name)
        if wrapped is not None:
            return wrapped
        handler = continuation(handler_call_details)
        if handler is None or handler.unary_unary is None:
            return handler
        wrapped = grpc.unary_unary_rpc_method_handler(
            self._wrap(full_name.rpartition("/")[2], handler.unary_unary),
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer)
        self._wrapped[full_name] = wrapped
        return wrapped

    def _wrap(self, method: str, behavior: Callable[[Any, grpc.ServicerContext], Any]
              ) -> Callable[[Any, grpc.ServicerContext], Any]:
        metrics = self._metrics

        def handle(request: Any, context: grpc.ServicerContext) -> Any:
            rid = accept_request_id(next((v for k, v in context.invocation_metadata()
                                          if k == REQUEST_ID_HEADER), None))
            started = time.perf_counter()
            code = grpc.StatusCode.OK
            with request_scope(rid):
                try:
                    return behavior(request, context)
                except BaseException:
                    code = context.code() or grpc.StatusCode.UNKNOWN  # type: ignore[attr-defined]  # grpc has code() since 1.38; its stub lacks it
                    # Beside what the handler set (an error's reason), not instead of it.
                    context.set_trailing_metadata(
                        (*(context.trailing_metadata() or ()), (REQUEST_ID_HEADER, rid)))
                    _log_failure(method, code, context, rid)
                    raise
                finally:
                    if metrics is not None:
                        metrics.observe_grpc(method, code, time.perf_counter() - started)

        return handle


def _log_failure(method: str, code: grpc.StatusCode, context: grpc.ServicerContext,
                 rid: str) -> None:
    extra = {"request_id": rid, "method": method, "code": code.name}
    if context.code() is None:  # type: ignore[attr-defined]  # grpc has code() since 1.38; its stub lacks it
        log.exception("%s failed outside the error mapping", method, extra=extra)
    elif code is not grpc.StatusCode.INTERNAL:  # _rpc logged it with its traceback
        details = context.details() or b""  # type: ignore[attr-defined]  # as code(): the stub lacks details()
        text = details.decode("utf-8", "replace") if isinstance(details, bytes) else details
        log.info("%s failed: %s: %s", method, code.name, text, extra=extra)


class MetricsExporter:
    """Serves ``/metrics`` over HTTP on ``listen`` (``HOST:PORT``; port 0 picks a free one).

    A daemon thread answers scrapes; ``stop`` closes the socket and joins it.
    """

    def __init__(self, metrics: NodeMetrics, listen: str) -> None:
        host, port = split_listen(listen)
        try:
            self._server, self._thread = start_http_server(port, addr=host,
                                                           registry=metrics.registry)
        except OSError as exc:  # a busy port or an unknown host: say which address
            raise OSError(exc.errno, f"cannot serve metrics on {listen}: "
                                     f"{exc.strerror or exc}") from None
        bound = self._server.server_address
        host_bound = str(bound[0])  # a str for an IP socket; the stub allows bytes too
        shown = f"[{host_bound}]" if ":" in host_bound else host_bound
        self.address = f"{shown}:{bound[1]}"
        """``HOST:PORT`` actually bound."""
        self._stopped = threading.Event()

    @property
    def url(self) -> str:
        return f"http://{self.address}/metrics"

    def stop(self) -> None:
        if self._stopped.is_set():
            return
        self._stopped.set()
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(timeout=5)


def split_listen(listen: str) -> tuple[str, int]:
    """``(host, port)`` of ``HOST:PORT`` (IPv6 hosts in brackets); ValueError otherwise."""
    host, _, port = listen.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"metrics address must be HOST:PORT, got {listen!r}")
    return host, int(port)
