"""Node configuration: defaults, a TOML file, then command-line flags, in that order."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvstore.core.prefetch import DEFAULT_MAX_PREFETCH_BYTES
from kvstore.core.sizes import format_size, parse_size
from kvstore.core.toml_files import load_toml
from kvstore.node.request_budget import MIN_REQUEST_BYTES
from kvstore.protocol.kv_event_wire import check_endpoint
from tiers.index_budget import DEFAULT_BLOCK_BYTES
from tiers.policy import POLICIES


@dataclass(slots=True, kw_only=True)
class NodeConfig:
    """Every option of ``kvstore serve``; the TOML file uses the same names."""

    listen: str = "127.0.0.1:7600"
    data_port: int = 0  # 0: any free port, announced to clients over gRPC
    dram_bytes: int = 1 << 30
    block_bytes: int = DEFAULT_BLOCK_BYTES  # blocks' size the index's metadata budget plans for
    policy: str = "lru"
    high_watermark: float = 0.95
    low_watermark: float = 0.90
    prefault: bool = True
    shm: bool = True
    grpc_workers: int = 16
    max_request_bytes: int = 0  # gRPC request bytes held at once; 0: DRAM/4, 64MiB..1GiB
    drain_timeout: float = 10.0
    read_lease_timeout: float = 30.0  # seconds a stalled client may pin a lease or a put
    log_level: str = "info"
    log_format: str = "text"  # "text" | "json" (one object per line, stdout and stderr)
    metrics_listen: str = ""  # HOST:PORT of the Prometheus /metrics endpoint; "": none
    kv_events_endpoint: str = ""  # tcp://HOST:PORT: publish KV events there (kv_events.py)
    kv_events_replay_endpoint: str = ""  # tcp://HOST:PORT: replays and snapshots; "": none
    kv_events_secret_key: str = ""  # CURVE: the node's .key_secret file; "": no CURVE
    kv_events_client_keys: str = ""  # CURVE: admitted clients' public .key file or directory
    hbm_bytes: int = 0  # 0: no HBM tier
    hbm_device: str = ""  # "": CUDA when present, else the CPU (and stat says so)
    ssd_path: str = ""  # "": no SSD tier
    ssd_bytes: int = 0
    ssd_io: str = "auto"  # "auto" | "uring" | "python"
    allow_index_rebuild: bool = False  # a damaged SSD index: rebuild it (scan) or refuse to start
    max_retained_fraction: float = 0.5  # of capacity (and of a tenant's quota) retain_s may hold
    max_prefetch_bytes: int = DEFAULT_MAX_PREFETCH_BYTES  # of blocks prefetches have on the move
    # cluster (all unused when etcd is ""):
    etcd: str = ""  # HOST:PORT of etcd; "": a single node, no cluster
    node_id: str = ""  # "": "HOST:PORT" of the gRPC address
    zone: str = ""
    advertise: str = ""  # address peers use; "": the listen address
    lease_ttl: int = 10  # seconds without keepalive before etcd drops the node
    replicas: int = 2  # copies repair keeps of every block; the most a tenant may ask for
    repair_bytes_per_s: int = 100 << 20
    repair_interval: float = 30.0  # seconds between periodic repair passes
    members: str = ""  # static peers "HOST:PORT,HOST:PORT": the only ones (with etcd's view)
    # this node sends blocks and its peer token to
    # security (see kvstore/auth/security.py):
    tls_cert: str = ""  # server certificate (PEM); with tls_key: TLS on gRPC and the channel
    tls_key: str = ""
    tls_ca: str = ""  # CA of client and peer certificates
    tls_client_auth: bool = False  # require client certificates (mutual TLS)
    auth_file: str = ""  # TOML of tenants and their bearer tokens; "": no auth
    peer_token_file: str = ""  # token this node presents to its peers (a cluster-role token)
    insecure: bool = False  # allow plaintext gRPC, open KV events, on a non-loopback address
    etcd_ca: str = ""  # etcd over TLS: the CA of etcd's certificate
    etcd_cert: str = ""  # client certificate for etcd (with --client-cert-auth)
    etcd_key: str = ""

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {sorted(POLICIES)}, got {self.policy!r}")
        if self.dram_bytes <= 0:
            raise ValueError("dram_bytes must be positive")
        if self.block_bytes <= 0:
            raise ValueError("block_bytes must be positive")
        if not 0 < self.low_watermark <= self.high_watermark <= 1:
            raise ValueError("need 0 < low_watermark <= high_watermark <= 1")
        if not 0 <= self.data_port < 65536:
            raise ValueError(f"data_port out of range: {self.data_port}")
        if self.read_lease_timeout < 1.0:  # wire.MIN_LEASE_TIMEOUT (config imports no wire)
            raise ValueError("read_lease_timeout must be >= 1 second")
        if self.grpc_workers < 1:
            raise ValueError("grpc_workers must be >= 1")
        if self.max_request_bytes and self.max_request_bytes < MIN_REQUEST_BYTES:
            raise ValueError(f"max_request_bytes must be 0 (derived from dram_bytes) or at "
                             f"least {format_size(MIN_REQUEST_BYTES)}, got "
                             f"{self.max_request_bytes}")
        if self.ssd_path and self.ssd_bytes <= 0:
            raise ValueError("ssd_path needs ssd_bytes (the SSD tier's size)")
        if self.ssd_bytes and not self.ssd_path:
            raise ValueError("ssd_bytes needs ssd_path (a file or block device)")
        if self.lease_ttl < 1:
            raise ValueError("lease_ttl must be >= 1 second")
        if self.replicas < 1:
            raise ValueError("replicas must be >= 1")
        if self.repair_bytes_per_s <= 0:
            raise ValueError("repair_bytes_per_s must be positive")
        if self.repair_interval <= 0:
            raise ValueError("repair_interval must be positive")
        for m in self.member_addrs():
            host, _, port = m.rpartition(":")
            if not host or not port.isdigit():
                raise ValueError(f"members must be HOST:PORT,HOST:PORT..., got {m!r}")
        if self.etcd and ":" not in self.etcd:
            raise ValueError(f"etcd must be HOST:PORT, got {self.etcd!r}")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ValueError("TLS needs both tls_cert and tls_key")
        if self.tls_client_auth and not self.tls_ca:
            raise ValueError("tls_client_auth needs tls_ca (the CA client certificates chain to)")
        if self.ssd_io not in ("auto", "uring", "python"):
            raise ValueError(f"ssd_io must be auto, uring or python, got {self.ssd_io!r}")
        if not 0.0 <= self.max_retained_fraction <= 1.0:
            raise ValueError(f"max_retained_fraction must be in [0, 1], got "
                             f"{self.max_retained_fraction!r}")
        if self.max_prefetch_bytes <= 0:
            raise ValueError("max_prefetch_bytes must be positive")
        if self.log_format not in ("text", "json"):
            raise ValueError(f"log_format must be text or json, got {self.log_format!r}")
        if self.metrics_listen:
            host, _, port = self.metrics_listen.rpartition(":")
            if not host.strip("[]") or not port.isdigit() or int(port) > 65535:
                raise ValueError(f"metrics_listen must be HOST:PORT, got "
                                 f"{self.metrics_listen!r}")
        for key in ("kv_events_endpoint", "kv_events_replay_endpoint"):
            if getattr(self, key):
                check_endpoint(key, getattr(self, key))
        if self.kv_events_replay_endpoint and not self.kv_events_endpoint:
            raise ValueError("kv_events_replay_endpoint needs kv_events_endpoint")
        if bool(self.kv_events_secret_key) != bool(self.kv_events_client_keys):
            raise ValueError("kv_events_secret_key and kv_events_client_keys go together "
                             "(CURVE: the node's secret key and the clients it admits)")
        if self.kv_events_secret_key and not self.kv_events_endpoint:
            raise ValueError("kv_events_secret_key needs kv_events_endpoint")


    def member_addrs(self) -> list[str]:
        return [m.strip() for m in self.members.split(",") if m.strip()]


SIZE_FIELDS = frozenset({"dram_bytes", "block_bytes", "hbm_bytes", "ssd_bytes",
                         "repair_bytes_per_s", "max_prefetch_bytes", "max_request_bytes"})
"""Keys whose value is a size: ``"64MiB"`` or a number of bytes (the reference says so)."""
_FIELDS = {f.name: f for f in dataclasses.fields(NodeConfig)}
# A field's type as written ("int", "float", ...): annotations are postponed here, so the
# field holds their text, which str() returns as it is.
_KINDS = {name: str(f.type) for name, f in _FIELDS.items()}
_EXPECTED: dict[str, type[Any] | tuple[type[Any], ...]] = {
    "int": int, "float": (int, float), "bool": bool, "str": str}


def _coerce(name: str, value: Any) -> Any:
    if name in SIZE_FIELDS:
        return parse_size(value)
    kind = _KINDS[name]
    expected = _EXPECTED[kind]
    if not isinstance(value, expected) or (kind != "bool" and isinstance(value, bool)):
        spelled = {"int": "an integer", "float": "a number", "bool": "true or false",
                   "str": "a string"}[kind]
        raise ValueError(f"config key {name!r} must be {spelled}, got {value!r}")
    return float(value) if kind == "float" else value


def load_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None
                ) -> NodeConfig:
    """Defaults, then the TOML file at ``path``, then ``overrides`` (None values ignored)."""
    values: dict[str, Any] = {}
    if path is not None:
        for key, value in load_toml(path, "config").items():
            name = key.replace("-", "_")
            if name not in _FIELDS:
                raise ValueError(f"unknown config key {key!r} in {path}; known: "
                                 f"{', '.join(sorted(_FIELDS))}")
            values[name] = _coerce(name, value)
    for name, value in (overrides or {}).items():
        if value is not None:
            values[name] = _coerce(name, value)
    return NodeConfig(**values)
