"""Who may call a node, what they see, and how the bytes are protected on the wire.

**Tenants.** With an auth file (``kvstore serve --auth-file tenants.toml``) every call
must carry a bearer token (gRPC metadata ``authorization: Bearer TOKEN``); an
unknown or missing token gets UNAUTHENTICATED before anything else is looked at.
Each token belongs to one entry::

    [[tenant]]
    name = "team-a"          # the namespace: salts every key this tenant names
    token_sha256 = "9f86..." # or token = "..." (hashing keeps the file harmless)
    quota_bytes = "10GiB"    # optional: bytes this tenant may keep on this node

    [[tenant]]
    name = "cluster"
    role = "cluster"         # nodes and operators: raw keys, no quota
    token = "..."

**Namespaces.** A tenant's keys are salted on the node, never by the client
(``kvstore.core.keys.salt_key``, where every stored-key derivation is written out)::

    stored_key = xxh3_128(b"kvstore-tenant-v1\\x00" || utf8(name) || b"\\x00" || key)

so two tenants naming the same key name two different blocks: one cannot read,
probe (exists, prefix match, locate) or overwrite another's blocks, and learns
nothing from a miss. Parents are salted the same way, so prefix chains hold.
The ``cluster`` role uses stored keys as they are (replication and repair copy
stored blocks between nodes). With tenants configured, same-host shared memory is
offered to the cluster role only: it maps the whole region, every tenant's bytes.

**Quotas** count the bytes a tenant's blocks keep on this node (reserved space
included, released on eviction, removal or abort): its own puts, and the copies
that replication and repair place here. A node sending a copy of a tenant's block
names the tenant in the gRPC metadata ``kvstore-charge-to-bin`` (UTF-8; also on the
OpenChannel that opens its transfer channel, so channel puts carry it): the copy is
charged to that tenant here, against the quota this node's auth file gives it (none
if this node does not list it). Only the cluster role (or anyone on an open node) may
name a tenant; a peer that names none (a node from before this) is served as before,
its copies charged to nobody. A tenant's replicated put asks for at most the
cluster's ``--replicas`` copies (PERMISSION_DENIED past it).

**TLS.** ``--tls-cert``/``--tls-key`` serve the gRPC API and the TCP transfer
channel over TLS (the channel inside ``ssl``); ``--tls-ca`` is the CA that node and
client certificates chain to, and ``--tls-client-auth`` requires client
certificates (mutual TLS). Without TLS a node listens only on loopback unless
``--insecure`` is given. A node presents its own certificate when it calls its
peers (replication, repair), so node certificates need both the serverAuth and
clientAuth key usages.

**etcd.** ``--etcd-ca``/``--etcd-cert``/``--etcd-key`` reach etcd over TLS, with a
client certificate when etcd requires one (``--client-cert-auth``).

**KV events.** The ZeroMQ event sockets (``kvstore/node/kv_events.py``) sit outside the
tokens above: they bind loopback only unless they use CURVE keys
(``--kv-events-secret-key``, ``--kv-events-client-keys``; the files are
``kvstore.auth.curve``'s) or ``--insecure`` is given, and with keys admit only the
listed subscriber keys.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import ssl
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import grpc

# The tenant view (salting, quotas, roles) lives in kvstore.auth.tenancy; its names are
# re-exported here, where callers have always found them.
from kvstore.auth.tenancy import OPEN, TENANT_DOMAIN, Principal, Tenant, charging, salt_key
from kvstore.core.errors import InvalidArgument, Unauthenticated
from kvstore.core.sizes import parse_size
from kvstore.core.toml_files import load_toml

__all__ = ["CHARGE_TO_HEADER", "OPEN", "ROLES", "TENANT_DOMAIN", "ClientTls", "Principal",
           "ServerTls", "Tenant", "TenantRegistry", "bearer_token", "charge_to_metadata",
           "is_loopback", "principal_of", "salt_key"]

ROLES = ("tenant", "cluster")
CHARGE_TO_HEADER = "kvstore-charge-to-bin"
"""gRPC metadata: the tenant a cluster-role caller's puts are charged to (UTF-8; ``-bin``,
so any name travels)."""
MAX_NAME_BYTES = 256


class TenantRegistry:
    """Tokens to tenants, from an auth file; immutable once loaded."""

    def __init__(self, tenants: Sequence[Tenant]) -> None:
        self._by_digest = {t.token_sha256: t for t in tenants}
        names = [t.name for t in tenants]
        if len(set(names)) != len(names):
            raise ValueError(f"tenant names must be unique, got {names}")
        if len(self._by_digest) != len(tenants):
            raise ValueError("two tenants share a token")
        self.tenants = tuple(tenants)
        self._by_name = {t.name: t for t in tenants}

    @classmethod
    def load(cls, path: str | Path) -> TenantRegistry:
        entries = load_toml(path, "auth file").get("tenant")
        if not isinstance(entries, list) or not entries:
            raise ValueError(f"auth file {path} needs at least one [[tenant]] entry")
        return cls([_tenant(path, i, e) for i, e in enumerate(entries)])

    def named(self, name: str) -> Tenant | None:
        """The tenant entry called ``name`` (None: this node does not list it)."""
        return self._by_name.get(name)

    def authenticate(self, token: str | None) -> Principal:
        if not token:
            raise Unauthenticated("this node requires a bearer token")
        digest = hashlib.sha256(token.encode()).digest()
        tenant = self._by_digest.get(digest)
        # The dict lookup is on a hash of the token; compare once more in constant time.
        if tenant is None or not hmac.compare_digest(tenant.token_sha256, digest):
            raise Unauthenticated("invalid bearer token")
        return Principal(tenant=tenant)


def _tenant(path: str | Path, i: int, e: object) -> Tenant:
    where = f"{path}: tenant {i + 1}"
    if not isinstance(e, dict):
        raise ValueError(f"{where}: must be a table")
    unknown = set(e) - {"name", "token", "token_sha256", "role", "quota_bytes"}
    if unknown:
        raise ValueError(f"{where}: unknown keys {sorted(unknown)}")
    name = e.get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{where}: needs a name")
    role = e.get("role", "tenant")
    if role not in ROLES:
        raise ValueError(f"{where}: role must be one of {ROLES}, got {role!r}")
    if ("token" in e) == ("token_sha256" in e):
        raise ValueError(f"{where}: give exactly one of token and token_sha256")
    if "token" in e:
        if not isinstance(e["token"], str) or len(e["token"]) < 16:
            raise ValueError(f"{where}: token must be a string of at least 16 characters")
        digest = hashlib.sha256(e["token"].encode()).digest()
    else:
        try:
            digest = bytes.fromhex(e["token_sha256"])
        except (TypeError, ValueError):
            digest = b""
        if len(digest) != 32:
            raise ValueError(f"{where}: token_sha256 must be 64 hex characters")
    quota = e.get("quota_bytes")
    if quota is not None:
        quota = parse_size(quota)
        if role == "cluster":
            raise ValueError(f"{where}: the cluster role has no quota")
    return Tenant(name=name, token_sha256=digest, role=role, quota_bytes=quota)


def principal_of(registry: TenantRegistry | None,
                 metadata: Sequence[tuple[str, str | bytes]] | None) -> Principal:
    """The caller of a gRPC call: authenticated by its bearer token (with ``registry``),
    then charged to the tenant ``CHARGE_TO_HEADER`` names, if any (``tenancy.charging``:
    PERMISSION_DENIED for a tenant). A tenant this node does not list is charged with no
    quota: its copies are counted, not limited."""
    p = OPEN if registry is None else registry.authenticate(bearer_token(metadata))
    name = _charged_name(metadata)
    if name is None:
        return p
    known = registry.named(name) if registry is not None else None
    return charging(p, known if known is not None and known.salts
                    else Tenant(name=name, token_sha256=b""))


def charge_to_metadata(name: str) -> tuple[str, bytes]:
    """The metadata item that charges a call's puts to tenant ``name``."""
    return CHARGE_TO_HEADER, name.encode()


def _charged_name(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for k, v in metadata or ():
        if k == CHARGE_TO_HEADER:
            raw = v if isinstance(v, bytes) else v.encode()
            try:
                name = raw.decode()
            except UnicodeDecodeError:
                name = ""
            if not name or len(raw) > MAX_NAME_BYTES:
                raise InvalidArgument(f"{CHARGE_TO_HEADER} must name a tenant in 1 to "
                                      f"{MAX_NAME_BYTES} bytes of UTF-8")
            return name
    return None


def bearer_token(metadata: Sequence[tuple[str, str | bytes]] | None) -> str | None:
    for k, v in metadata or ():
        if k == "authorization":
            text = v.decode() if isinstance(v, bytes) else v
            scheme, _, token = text.partition(" ")
            return token.strip() if scheme.lower() == "bearer" else None
    return None


# ---- TLS -------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True, kw_only=True)
class ServerTls:
    cert: str
    key: str
    ca: str | None = None  # verifies client certificates (and peers' servers)
    client_auth: bool = False  # mutual TLS: clients must present a certificate

    def __post_init__(self) -> None:
        for what, p in (("certificate", self.cert), ("key", self.key), ("CA", self.ca)):
            if p is not None and not Path(p).is_file():
                raise ValueError(f"TLS {what} file not found: {p}")
        if self.client_auth and not self.ca:
            raise ValueError("client certificate auth needs a CA (--tls-ca)")

    def grpc_credentials(self) -> grpc.ServerCredentials:
        ca = Path(self.ca).read_bytes() if self.ca else None
        return grpc.ssl_server_credentials(
            [(Path(self.key).read_bytes(), Path(self.cert).read_bytes())],
            root_certificates=ca, require_client_auth=self.client_auth)

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_cert_chain(self.cert, self.key)
        if self.ca:
            ctx.load_verify_locations(self.ca)
        ctx.verify_mode = ssl.CERT_REQUIRED if self.client_auth else ssl.CERT_NONE
        return ctx

    def peer(self) -> ClientTls:
        """What this node presents when it calls its peers (its own certificate)."""
        return ClientTls(ca=self.ca, cert=self.cert, key=self.key)


@dataclass(frozen=True, slots=True, kw_only=True)
class ClientTls:
    ca: str | None = None  # None: the system's trust store
    cert: str | None = None  # client certificate, for nodes that require one
    key: str | None = None

    def __post_init__(self) -> None:
        if (self.cert is None) != (self.key is None):
            raise ValueError("a client certificate needs both --tls-cert and --tls-key")

    def grpc_credentials(self) -> grpc.ChannelCredentials:
        def read(p: str | None) -> bytes | None:
            return Path(p).read_bytes() if p else None

        return grpc.ssl_channel_credentials(root_certificates=read(self.ca),
                                            private_key=read(self.key),
                                            certificate_chain=read(self.cert))

    def ssl_context(self) -> ssl.SSLContext:
        ctx = ssl.create_default_context(cafile=self.ca)
        if self.cert and self.key:
            ctx.load_cert_chain(self.cert, self.key)
        return ctx


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
