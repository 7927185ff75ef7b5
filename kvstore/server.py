"""The store node's servers: the gRPC object API and the transfer channel, over one Node.

Every RPC passes through ``_rpc``, the one place where kvstore exceptions become
gRPC status codes; nothing a client sends can raise past it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import secrets
from collections.abc import Callable, Sequence
from concurrent import futures
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

import grpc
from google.protobuf.message import DecodeError
from grpc_health.v1 import health as grpc_health
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvstore.auth import tenancy
from kvstore.auth.security import (
    Principal,
    ServerTls,
    TenantRegistry,
    is_loopback,
    principal_of,
)
from kvstore.core.errors import REASON_HEADER, InvalidArgument, KVStoreError, Unavailable
from kvstore.core.prefetch import check_prefetch
from kvstore.core.retention import check_retain, retain_seconds
from kvstore.node.channel_server import ChannelServer
from kvstore.node.request_budget import RequestBudget, default_request_bytes, max_message_bytes
from kvstore.node.semantics import Node, check_key, check_keys, check_parent
from kvstore.proto import kvstore_pb2 as pb
from kvstore.proto import kvstore_pb2_grpc as pb_grpc
from kvstore.protocol import native_channel, wire
from kvstore.protocol.grpc_options import MAX_MESSAGE_BYTES as MAX_MESSAGE_BYTES  # re-exported
from kvstore.protocol.grpc_options import host_id

if TYPE_CHECKING:
    from kvstore.node.metrics import NodeMetrics
    from replication.copies.replicator import Replicator

log = logging.getLogger("kvstore.server")

MAX_REPLY_VALUE_BYTES = MAX_MESSAGE_BYTES - (8 << 20)
"""Most value bytes one Get/BatchGet reply carries (the rest of a message is framing:
at most MAX_BATCH items of a few bytes each). A read past it is refused up front."""

DEFAULT_READ_LEASE_TIMEOUT = 30.0
"""Seconds (``--read-lease-timeout``) a stalled client may pin a read lease or a put."""

R = TypeVar("R")


def _rpc(method: Callable[..., R]) -> Callable[..., R]:
    @functools.wraps(method)
    def wrapper(self: KVStoreServicer, request: Any, context: grpc.ServicerContext) -> R:
        try:
            principal = self.authenticate(context)  # before anything about keys is read
            tenancy.check_role(principal, method, method.__name__)
            with self.node.request():
                return method(self, request, context, principal)
        except KVStoreError as exc:
            if exc.reason:  # additive: a client before reasons reads code and message
                context.set_trailing_metadata(((REASON_HEADER, exc.reason),))
            context.abort(exc.code, str(exc))
        except ValueError as exc:
            context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except Exception:
            log.exception("internal error in %s", method.__name__)
            context.abort(grpc.StatusCode.INTERNAL, f"internal error in {method.__name__}")
        raise AssertionError("unreachable: context.abort raises")

    return wrapper


class KVStoreServicer(pb_grpc.KVStoreServicer):
    """Every method gets the caller's ``Principal``; keys pass through ``principal.key``
    (a tenant's namespace salt) before the node sees them."""

    def __init__(self, node: Node,
                 channel_info: Callable[[str, Principal], pb.OpenChannelResponse],
                 replicator: Replicator | None = None,
                 auth: TenantRegistry | None = None) -> None:
        self.node = node
        self._channel_info = channel_info
        self._replicator = replicator
        self._auth = auth
        # Set by a node that joined a cluster: leaves, hands off, and stops the node.
        self.drain_handler: Callable[[], dict[str, float]] | None = None

    def authenticate(self, context: grpc.ServicerContext) -> Principal:
        return principal_of(self._auth, context.invocation_metadata())

    @_rpc
    def Put(self, request: pb.PutRequest, context: grpc.ServicerContext, p: Principal
            ) -> pb.PutResponse:
        stored = self.node.put(p.key(check_key(request.key)), memoryview(request.value),
                               parent=p.parent(check_parent(request.parent)), pin=request.pin,
                               owner=p.owner, quota=p.quota, retain_s=request.retain_s)
        return pb.PutResponse(stored=stored)

    @_rpc
    def Get(self, request: pb.GetRequest, context: grpc.ServicerContext, p: Principal
            ) -> pb.GetResponse:
        key = p.key(check_key(request.key))
        tenancy.check_reply_bytes(self.node.block_sizes([key]), MAX_REPLY_VALUE_BYTES, "Get")
        value = self.node.get(key)
        return pb.GetResponse(found=False) if value is None else pb.GetResponse(found=True,
                                                                                 value=value)

    @_rpc
    def Remove(self, request: pb.RemoveRequest, context: grpc.ServicerContext, p: Principal
               ) -> pb.RemoveResponse:
        return pb.RemoveResponse(removed=self.node.remove(p.key(check_key(request.key))))

    @_rpc
    def Exists(self, request: pb.ExistsRequest, context: grpc.ServicerContext, p: Principal
               ) -> pb.ExistsResponse:
        return pb.ExistsResponse(exists=self.node.exists(p.keys(check_keys(request.keys))))

    @_rpc
    def PrefixMatch(self, request: pb.PrefixMatchRequest, context: grpc.ServicerContext,
                    p: Principal) -> pb.PrefixMatchResponse:
        return pb.PrefixMatchResponse(
            matched=self.node.prefix_match(p.keys(check_keys(request.keys))))

    @_rpc
    def BatchPut(self, request: pb.BatchPutRequest, context: grpc.ServicerContext,
                 p: Principal) -> pb.BatchPutResponse:
        items = [(check_key(i.key), check_parent(i.parent), i) for i in request.items]
        check_keys([k for k, _, _ in items])
        for i in request.items:  # refuse a bad retain_s before any item is stored
            retain_seconds(i.retain_s)
        stored = [self.node.put(p.key(k), memoryview(i.value), parent=p.parent(par), pin=i.pin,
                                owner=p.owner, quota=p.quota, retain_s=i.retain_s)
                  for k, par, i in items]
        return pb.BatchPutResponse(stored=stored)

    @_rpc
    def BatchGet(self, request: pb.BatchGetRequest, context: grpc.ServicerContext,
                 p: Principal) -> pb.BatchGetResponse:
        keys = p.keys(check_keys(request.keys))
        # Checked twice: on sizes first (a cheap refusal), then on the leases themselves.
        tenancy.check_reply_bytes(self.node.block_sizes(keys), MAX_REPLY_VALUE_BYTES,
                                  "BatchGet")
        with self.node.reading_many(keys, max_bytes=MAX_REPLY_VALUE_BYTES) as views:
            items = [pb.GetResponse(found=False) if v is None else
                     pb.GetResponse(found=True, value=bytes(v)) for v in views]
        return pb.BatchGetResponse(items=items)

    @_rpc
    def Stats(self, request: pb.StatsRequest, context: grpc.ServicerContext, p: Principal
              ) -> pb.StatsResponse:
        stats = tenancy.stats_view(p, self.node.stats())
        tiers = [
            pb.TierStats(name=name, counters={k: v for k, v in t.items() if isinstance(v, int)})
            for name, t in stats["tiers"].items()
        ]
        node = {k: json.dumps(v) for k, v in stats["node"].items()}
        return pb.StatsResponse(tiers=tiers, node=node)

    @_rpc
    def Locate(self, request: pb.LocateRequest, context: grpc.ServicerContext, p: Principal
               ) -> pb.LocateResponse:
        tiers = self.node.locate(p.keys(check_keys(request.keys)))
        return pb.LocateResponse(tiers=[t or "" for t in tiers])

    @_rpc
    def Prefetch(self, request: pb.PrefetchRequest, context: grpc.ServicerContext,
                 p: Principal) -> pb.PrefetchResponse:
        # Salted like every call: a tenant names, and so moves, only its own blocks.
        raw, tier = check_prefetch(request.keys, request.tier)
        outcomes = self.node.prefetch(p.keys(raw), tier, wait=request.wait)
        return pb.PrefetchResponse(outcomes=[o.value for o in outcomes])

    @_rpc
    def Retain(self, request: pb.RetainRequest, context: grpc.ServicerContext, p: Principal
               ) -> pb.RetainResponse:
        # Salted like every call, and charged to the caller as a put's retention is.
        raw, seconds = check_retain(request.keys, request.retain_s)
        outcomes = self.node.retain(p.keys(raw), seconds, owner=p.owner, quota=p.quota)
        return pb.RetainResponse(outcomes=[o.value for o in outcomes])

    @_rpc
    @tenancy.cluster_only
    def Replicate(self, request: pb.ReplicateRequest, context: grpc.ServicerContext,
                  p: Principal) -> pb.ReplicateResponse:
        if self._replicator is None:
            raise Unavailable("this node does not replicate")
        raw = check_keys(request.keys)
        stored = p.keys(raw)
        orders = [list(o.index) for o in request.orders] if request.orders else None
        out = self._replicator.replicate(stored, list(request.targets),
                                         copies=request.copies or 1,
                                         write_quorum=request.write_quorum or 1, orders=orders)
        back = dict(zip(stored, raw, strict=True))  # report the keys as the caller named them
        return pb.ReplicateResponse(copies=out.copies, missing=[back[k] for k in out.missing],
                                    stored_on=out.stored_on, failed=out.failed)

    @_rpc
    @tenancy.cluster_only
    def Drain(self, request: pb.DrainRequest, context: grpc.ServicerContext, p: Principal
              ) -> pb.DrainResponse:
        if self.drain_handler is None:
            raise InvalidArgument("this node is not in a cluster: there is no one to hand its "
                                  "blocks to (stop it with SIGTERM)")
        out = self.drain_handler()
        return pb.DrainResponse(blocks=int(out["blocks"]), copies=int(out["copies"]),
                                bytes_copied=int(out["bytes_copied"]), seconds=out["seconds"])

    @_rpc
    def OpenChannel(self, request: pb.OpenChannelRequest, context: grpc.ServicerContext,
                    p: Principal) -> pb.OpenChannelResponse:
        return self._channel_info(request.client_host_id, p)


def decoding_handlers(servicer: KVStoreServicer, budget: RequestBudget | None = None
                      ) -> grpc.GenericRpcHandler:
    """The service's handlers, decoding requests themselves.

    With gRPC's own deserializer an undecodable body fails before any handler
    runs and the client sees INTERNAL; here it is INVALID_ARGUMENT, as promised.
    ``budget``: each message holds its bytes of it while its call is served, from before
    it is decoded (``kvstore.node.request_budget``); past it, RESOURCE_EXHAUSTED.
    """
    service = pb.DESCRIPTOR.services_by_name["KVStore"]
    handlers: dict[str, grpc.RpcMethodHandler[Any, Any]] = {}
    for method in service.methods:
        request_cls = getattr(pb, method.input_type.name)
        response_cls = getattr(pb, method.output_type.name)
        impl = getattr(servicer, method.name)

        def handle(raw: bytes, context: grpc.ServicerContext, impl: Any = impl,
                   request_cls: Any = request_cls, name: str = method.name) -> Any:
            with contextlib.ExitStack() as held:
                if budget is not None:
                    try:
                        held.enter_context(budget.hold(len(raw), name))
                    except KVStoreError as exc:
                        context.abort(exc.code, str(exc))
                try:
                    request = request_cls.FromString(raw)
                except DecodeError as exc:
                    context.abort(grpc.StatusCode.INVALID_ARGUMENT,
                                  f"malformed {request_cls.__name__}: {exc}")
                return impl(request, context)

        handlers[method.name] = grpc.unary_unary_rpc_method_handler(
            handle, request_deserializer=None, response_serializer=response_cls.SerializeToString)
    return grpc.method_handlers_generic_handler(service.full_name, handlers)


HEALTH_SERVICES = ("", pb.DESCRIPTOR.services_by_name["KVStore"].full_name)
"""Names the standard health service answers for: the whole server and kvstore.v1.KVStore."""


class NodeHealth(grpc_health.HealthServicer):
    """``grpc.health.v1.Health``: SERVING while the node serves, NOT_SERVING once it drains.

    Check reads ``node.draining`` on every call, whoever started the drain; Watch
    streams hear of it when ``NodeServer.stop`` begins. Kubernetes' native gRPC
    probe and ``kvstore health`` both call Check.
    """

    def __init__(self, node: Node) -> None:
        super().__init__()
        self._node = node
        for service in HEALTH_SERVICES:
            self.set(service, health_pb2.HealthCheckResponse.SERVING)

    def Check(self, request: Any, context: grpc.ServicerContext) -> Any:
        if request.service in HEALTH_SERVICES and self._node.draining:
            return health_pb2.HealthCheckResponse(status=health_pb2.HealthCheckResponse.NOT_SERVING)
        return super().Check(request, context)


@dataclass(slots=True, kw_only=True)
class ServerAddresses:
    grpc: str
    channel: tuple[str, int]
    unix_path: str


class NodeServer:
    """A Node served over gRPC and the transfer channel; ``stop`` drains first."""

    def __init__(self, node: Node, *, listen: str, data_port: int = 0, grpc_workers: int = 16,
                 enable_shm: bool = True, peer_timeout: float = 10.0,
                 tls: ServerTls | None = None, auth: TenantRegistry | None = None,
                 peer_token: str | None = None, insecure: bool = False,
                 metrics: NodeMetrics | None = None, members: Sequence[str] = (),
                 read_lease_timeout: float | None = DEFAULT_READ_LEASE_TIMEOUT,
                 max_request_bytes: int | None = None) -> None:
        """``tls``/``auth``: see ``kvstore.auth.security``. ``peer_token`` is what this node
        presents to its peers (a cluster-role token) when it replicates or repairs.
        Without ``tls`` only a loopback ``listen`` is accepted, unless ``insecure``.
        ``members``: the static list of peer addresses this node may send blocks to (a
        cluster node adds its etcd view with ``known_members.follow``); no one else.
        ``read_lease_timeout``: seconds a client's read lease or unfinished put may pin
        space while its bytes do not flow (see ``kvstore.node.channel_server``).
        ``max_request_bytes``: the bytes of gRPC requests the node holds at once (None:
        derived from the DRAM tier, ``kvstore.node.request_budget``)."""
        from kvstore.node.metrics import RequestInterceptor  # clients need not import prometheus
        from replication.copies.forwarder import Forwarder  # replication builds on the client: late
        from replication.copies.peers import KnownMembers, PeerPool
        from replication.copies.replicator import Replicator

        self.node = node
        host, _, port = listen.rpartition(":")
        if not host or not port.isdigit():
            raise InvalidArgument(f"listen address must be HOST:PORT, got {listen!r}")
        host = host.strip("[]")
        if tls is None and not insecure and not is_loopback(host):
            raise InvalidArgument(f"refusing to listen on {listen} without TLS: give --tls-cert "
                                  f"and --tls-key, or --insecure to accept plaintext")
        if read_lease_timeout is not None and read_lease_timeout < wire.MIN_LEASE_TIMEOUT:
            raise InvalidArgument(f"read lease timeout must be >= {wire.MIN_LEASE_TIMEOUT:g}s "
                                  f"(clients rely on it), got {read_lease_timeout:g}")
        self._tls = tls
        self._host_id = host_id()
        unix_name = f"kvstore-{os.getpid()}-{secrets.token_hex(4)}" if enable_shm else None
        self.request_budget = RequestBudget(
            max_request_bytes or default_request_bytes(node.settings.dram_bytes))
        node.add_stat_source(self.request_budget.stats)
        self._grpc = grpc.server(futures.ThreadPoolExecutor(max_workers=grpc_workers,
                                                            thread_name_prefix="kvstore-grpc"),
                                 options=_server_options(self.request_budget.limit),
                                 interceptors=[RequestInterceptor(metrics)])
        where = f"{_bracket(host)}:{port}"

        def bind_grpc() -> int:
            bound = (self._grpc.add_secure_port(where, tls.grpc_credentials()) if tls
                     else self._grpc.add_insecure_port(where))
            if bound == 0:
                raise OSError(f"cannot listen on {listen}")
            return bound

        # The port given first: a port left to the kernel (0) and bound before it could be
        # handed that very port, which is free until it is bound (a test, a demo or
        # ``kvstore cluster up`` picks a free port, then starts the node on it).
        grpc_first = int(port) != 0 or not data_port
        bound = bind_grpc() if grpc_first else 0
        self.channel = ChannelServer(node, host=host, port=data_port, unix_name=unix_name,
                                     ssl_context=tls.ssl_context() if tls else None,
                                     metrics=metrics, stall_s=read_lease_timeout)
        if not grpc_first:
            bound = bind_grpc()
        self.addresses = ServerAddresses(grpc=f"{_bracket(host)}:{bound}",
                                         channel=self.channel.tcp_address,
                                         unix_path=self.channel.unix_path)
        self.known_members = KnownMembers(members)
        # Every peer pool: the same member rule, stall timeout, token and TLS.
        peer_pool = functools.partial(PeerPool, timeout=peer_timeout, token=peer_token,
                                      tls=tls.peer() if tls else None,
                                      members=self.known_members)
        self.peers = peer_pool()
        # Half the handler threads at most wait on replication; each at most two peer
        # timeouts (a push and one fallback).
        self.replicator = Replicator(node, self.peers, self_addr=self.addresses.grpc,
                                     max_calls=max(1, grpc_workers // 2),
                                     wait_s=2 * peer_timeout)
        # Inert until a cluster role attaches its membership (replicated puts on the channel).
        # Its own peer clients, so forwards never queue behind Replicate or repair pushes
        # for a connection. Small blocks go over stream connections even to a peer on this
        # host: only they pipeline a forward to several targets
        # (``kvstore/remote/pipelined.py``), which at 64 KiB costs the nodes less CPU than
        # shared memory's reserve-fill-commit, one target at a time; large blocks to a peer
        # on this host through its shared memory, whose copies cost less than the socket's
        # at 1 MiB (benchmarks/RESULTS.md, "Cluster").
        self.forwarder = Forwarder(peer_pool(transport="tcp"), large_peers=peer_pool())
        self.channel.forwarder = self.forwarder
        self.servicer = KVStoreServicer(node, self._open_channel, self.replicator, auth)
        self._grpc.add_generic_rpc_handlers((decoding_handlers(self.servicer,
                                                               self.request_budget),))
        self.health = NodeHealth(node)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._grpc)

    def _open_channel(self, client_host_id: str, principal: Principal
                      ) -> pb.OpenChannelResponse:
        same_host = (bool(client_host_id) and client_host_id == self._host_id
                     and principal.may_map_region)
        return pb.OpenChannelResponse(
            protocol_version=wire.PROTOCOL_VERSION,
            tcp_host="",  # empty: the host the client used for gRPC
            tcp_port=self.channel.tcp_address[1],
            unix_path=self.channel.unix_path if same_host else "",
            token=self.channel.token_for(principal),
            same_host=same_host,
            region_bytes=self.node.region_bytes,
        )

    def start(self) -> None:
        self._grpc.start()
        self.channel.start()
        log.info("serving gRPC on %s, channel on %s:%d%s (channel I/O: %s)",
                 self.addresses.grpc, *self.addresses.channel,
                 f", same-host {self.addresses.unix_path}" if self.addresses.unix_path else "",
                 "native" if native_channel.enabled() else "pure Python")

    def stop(self, grace: float = 10.0) -> bool:
        """Refuses new requests, lets in-flight ones finish, then closes everything.

        Returns True if every in-flight request finished within ``grace`` seconds.
        """
        self.health.enter_graceful_shutdown()  # NOT_SERVING from here on, Watch streams too
        drained = self.node.drain(grace / 2)
        if not drained:
            # What still runs may be waiting on peers: cancel the outbound work (waiting
            # replicate calls answer at once, calls to peers end) and give the rest the time
            # left, so the whole stop stays within ``grace``.
            self.replicator.close()
            self.forwarder.close()
            self.peers.close()
            drained = self.node.drain(grace / 2)
        self.channel.stop()
        self._grpc.stop(grace=1.0).wait()
        self.replicator.close()
        self.forwarder.close()
        self.peers.close()
        return drained

    def wait(self, timeout: float | None = None) -> bool:
        return self._grpc.wait_for_termination(timeout)


def _server_options(request_bytes: int) -> list[tuple[str, int]]:
    """gRPC server settings under a request budget of ``request_bytes``: no message larger
    than the budget (refused on its length prefix, unread), and no bandwidth-delay probing,
    which would widen every stream's flow-control window until calls that wait for a
    handler thread sit in memory whole; without it such a call holds its initial window."""
    return [("grpc.max_receive_message_length", max_message_bytes(request_bytes)),
            ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.http2.bdp_probe", 0)]


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host else host

