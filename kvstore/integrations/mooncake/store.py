"""Mooncake Store 0.3.13's Python API on top of kvstore.

``MooncakeDistributedStore`` here has the constructor, method names, argument order and
return conventions of 0.3.13's ``mooncake.store.MooncakeDistributedStore`` (the pybind11
class in Mooncake's ``store_py.cpp``): every method of it either works or raises
NotImplementedError with its reason, so code written for it runs by changing one import::

    from kvstore.integrations.mooncake.store import MooncakeDistributedStore, ReplicateConfig

Return conventions (as Mooncake's): status-returning calls give ``0`` on success and a
negative Mooncake ``ErrorCode`` on failure; ``get_into`` / ``batch_get_into*`` give the bytes
read or a negative code; ``is_exist`` gives ``1`` / ``0`` / ``-1``; ``get`` gives the value, or
empty bytes on a miss or an error; ``get_buffer`` / ``batch_get_buffer`` give a
``BufferHandle`` (buffer protocol, ``ptr()``, ``size()``) or ``None``. Nothing raises for a
store-side failure; programming errors (a non-integer pointer, say) raise as in Python.

Key mapping. Mooncake keys are strings of any length; kvstore keys are 16 bytes. A key
``k`` (``str``, encoded as UTF-8, or ``bytes`` as they are) is stored under::

    xxh3_128(b"kvstore-mooncake-v1\\x00" || utf8(k))      (seed 0, canonical digest)

The domain prefix keeps these keys apart from prefix-hash block keys (``kvstore.core.keys``).
Hashes cannot be listed or inverted, so ``remove_all`` removes the keys *this instance*
has written (successful puts, kept in a set) and not removed since; see ``remove_all``.

Where kvstore is: ``setup`` maps Mooncake's addresses as follows (kvstore has no master and
no metadata server):

* ``master_server_addr`` ``"HOST:PORT"``: one kvstore node, ``kvstore.Client(addr)``;
* ``master_server_addr`` ``"HOST:PORT,HOST:PORT,..."``: a static-member cluster,
  ``Client(members=[Member(node_id=NodeId(addr), addr=addr), ...], replicas=...)``;
* ``master_server_addr`` ``"etcd://HOST:PORT"``: the cluster registered in that etcd,
  ``Client(etcd="HOST:PORT", replicas=...)``;
* ``master_server_addr`` empty: ``metadata_server`` ``"etcd://HOST:PORT"`` names the
  cluster's etcd; any other ``metadata_server`` (``http://...``, ``P2PHANDSHAKE``) is ignored.

``protocol`` ``"tcp"`` uses kvstore's transport ``auto`` (shared memory with a node on this
host, else TCP); any other protocol does the same with a warning. ``rdma_devices`` and the
segment sizes are ignored: a kvstore client lends no memory (nodes own their tiers).

Registered memory: ``register_buffer(ptr, size)`` records a raw address range; the
``*_from`` / ``*_into`` calls check that every ``(ptr, size)`` lies inside one (else -600 for
that key, before any memory is touched) and hand kvstore a memoryview over it: no
intermediate copy. ``*_multi_buffers`` are zero-copy when a key's buffers are adjacent;
otherwise a put joins them and a get stages and scatters (one copy each).

``ReplicateConfig`` (0.3.13's: ``with_soft_pin`` is gone, setting it raises AttributeError
as on the wheel): ``replica_num`` sets the copies of a put on a cluster (a cluster client
with that many replicas, sharing the membership, and a write quorum of all of them);
without a config the ``replicas`` given to ``setup`` (default 1) apply. A single node keeps
one copy whatever ``replica_num`` says. ``with_hard_pin`` maps to kvstore's ``pin`` (never
evicted). ``soft_pin_action`` / ``soft_pin_ttl_ms`` map to kvstore retention
(``retain_s``) through ``retain_seconds`` alone. ``nof_replica_num`` / ``dfs_replica_num``
above 0 are refused (-600 / -1601: no such replica kind); placement hints are ignored.

Sessions and ranges: ``mooncake_ranges``; upserts: ``mooncake_upsert``; tensors:
``mooncake_tensors`` and ``mooncake_cuda``; the rest, refused: ``mooncake_unsupported``.
"""

from __future__ import annotations

import ctypes
import logging
import threading
from collections.abc import Mapping, Sequence
from typing import Any

from kvstore.core.checks import byte_view
from kvstore.core.errors import InvalidArgument, KVStoreError, ResourceExhausted
from kvstore.integrations.mooncake.cuda import CudaTensorReads
from kvstore.integrations.mooncake.ranges import RangedTransfers
from kvstore.integrations.mooncake.setup import setup_arguments
from kvstore.integrations.mooncake.tensors import TensorObjects
from kvstore.integrations.mooncake.types import (
    BUFFER_OVERFLOW,
    DFS_SERVICE_UNAVAILABLE,
    INTERNAL_ERROR,
    INVALID_KEY,
    INVALID_PARAMS,
    NO_AVAILABLE_HANDLE,
    OBJECT_ALREADY_EXISTS,
    OBJECT_NOT_FOUND,
    OK,
    RPC_FAIL,
    BufferHandle,
    ObjectDataType,
    ReplicateConfig,
    SoftPinAction,
    check_placement,
    code_of,
    mooncake_key,
    per_key_codes,
    retain_seconds,
)
from kvstore.integrations.mooncake.unsupported import install
from kvstore.integrations.mooncake.upsert import Upserts

__all__ = [
    "BUFFER_OVERFLOW", "DFS_SERVICE_UNAVAILABLE", "INTERNAL_ERROR", "INVALID_KEY",
    "INVALID_PARAMS", "NO_AVAILABLE_HANDLE", "OBJECT_ALREADY_EXISTS", "OBJECT_NOT_FOUND", "OK",
    "RPC_FAIL", "BufferHandle", "MooncakeDistributedStore", "ObjectDataType", "ReplicateConfig",
    "SoftPinAction", "mooncake_key", "retain_seconds",
]

log = logging.getLogger(__name__)

_DEFAULT_SEGMENT = 16 * 1024 * 1024


class _Region:
    __slots__ = ("_mem", "end", "start", "view")

    def __init__(self, ptr: int, size: int) -> None:
        self._mem = (ctypes.c_char * size).from_address(ptr)
        self.view = memoryview(self._mem).cast("B")
        self.start = ptr
        self.end = ptr + size


class MooncakeDistributedStore(RangedTransfers, Upserts, TensorObjects, CudaTensorReads):
    """Mooncake Store's client class, served by kvstore. Thread-safe.

    ``client=``: an already-built ``kvstore.Client`` (single node or cluster) to use instead
    of the one ``setup`` would build; ``setup`` is then optional (it only records
    ``local_hostname``). The store closes it in ``close()``.
    """

    def __init__(self, client: Any = None) -> None:
        self._lock = threading.Lock()
        self._client: Any = client
        self._injected = client is not None
        self._regions: tuple[_Region, ...] = ()
        self._written: dict[bytes, str | bytes] = {}  # kvstore key -> Mooncake key
        self._hostname = ""
        self._cluster_opts: dict[str, Any] | None = None  # set when setup built a cluster
        self._derived: dict[int, Any] = {}  # replica_num -> cluster client sharing membership
        self._put_sessions: dict[bytes, Any] = {}  # kvstore key -> open put session
        self._get_sessions: dict[bytes, bytes] = {}  # kvstore key -> value read at start

    # ---- lifecycle ----------------------------------------------------------------------

    def setup(self, local_hostname: str | Mapping[str, Any], metadata_server: str = "",
              global_segment_size: int = _DEFAULT_SEGMENT,
              local_buffer_size: int = _DEFAULT_SEGMENT, protocol: str = "tcp",
              rdma_devices: str = "", master_server_addr: str = "", engine: Any = None,
              enable_ssd_offload: bool = False, ssd_offload_path: str = "",
              tenant_id: str = "default", enable_client_http_server: bool = False,
              client_http_port: int = 9300, *,
              master_server_address: str | None = None, replicas: int = 1,
              write_quorum: int | None = None, transport: str = "auto",
              token: str | None = None, timeout: float | None = 30.0) -> int:
        """Connects to kvstore (see the module docstring for the address mapping): 0, or a
        negative code (``RPC_FAIL`` when nothing answers, ``INVALID_PARAMS`` for a bad
        address or config). ``setup(config_dict)`` is Mooncake 0.3.13's one-dict form
        (``kvstore.integrations.mooncake.setup``). The keyword-only arguments are kvstore's
        own; the SSD-offload, tenant and client-HTTP arguments are accepted and ignored."""
        if isinstance(local_hostname, Mapping):
            try:
                return self.setup(**setup_arguments(local_hostname))
            except InvalidArgument as exc:
                log.error("%s", exc)
                return INVALID_PARAMS
        if not isinstance(local_hostname, str):
            raise TypeError("setup() takes a local hostname and addresses, or one dict")
        self._hostname = local_hostname
        if self._injected:
            return OK
        if enable_ssd_offload or enable_client_http_server or tenant_id != "default":
            log.warning("setup: enable_ssd_offload, tenant_id and enable_client_http_server "
                        "are ignored (a kvstore node owns its SSD tier; tenants come from "
                        "token=; metrics are on the node)")
        if master_server_address is not None:
            master_server_addr = master_server_address
        if protocol not in ("tcp", ""):
            log.warning("kvstore has no %s transport; using TCP (or shared memory on the same "
                        "host) instead", protocol)
        if engine is not None:
            log.warning("a Mooncake TransferEngine was passed to setup(); kvstore ignores it")
        from kvstore.client import Client

        target = (master_server_addr or "").strip()
        if not target and (metadata_server or "").startswith("etcd://"):
            target = metadata_server.strip()
        try:
            cluster: dict[str, Any] = {"replicas": replicas, "write_quorum": write_quorum,
                                       "transport": transport, "token": token,
                                       "timeout": timeout}
            if target.startswith("etcd://"):
                client = Client(etcd=target[len("etcd://"):], **cluster)
            elif "," in target:
                from replication.placement.rendezvous import Member, NodeId

                addrs = [a.strip() for a in target.split(",") if a.strip()]
                members = [Member(node_id=NodeId(a), addr=a) for a in addrs]
                client = Client(members=members, **cluster)
            elif target:
                client = Client(target, transport=transport, token=token, timeout=timeout)
                cluster = {}
            else:
                log.error("setup: no kvstore address in master_server_addr or metadata_server")
                return INVALID_PARAMS
        except KVStoreError as exc:
            log.error("setup: %s", exc)
            return code_of(exc)
        try:
            client.exists([mooncake_key("kvstore-mooncake-setup-probe")])
        except KVStoreError as exc:
            log.error("setup: kvstore at %s does not answer: %s", target, exc)
            client.close()
            return code_of(exc)
        self.close()
        with self._lock:
            self._client = client
            self._cluster_opts = ({k: v for k, v in cluster.items()
                                   if k not in ("replicas", "write_quorum")}
                                  if cluster else None)
        return OK

    def close(self) -> int:
        """Closes the connection(s) and drops open sessions: 0. Registered buffers and the
        written-key set are kept."""
        with self._lock:
            clients = [*self._derived.values(), self._client]
            self._derived.clear()
            self._put_sessions.clear()  # open sessions stored nothing; they are dropped
            self._get_sessions.clear()
            self._client = None
            self._cluster_opts = None
            self._injected = False
        for c in clients:
            if c is not None:
                c.close()
        return OK

    def get_hostname(self) -> str:
        """The ``local_hostname`` given to ``setup``."""
        return self._hostname

    def health_check(self) -> int:
        """Mooncake's codes: 0 healthy, 1 not set up (or closed), 2 kvstore unreachable."""
        client = self._client
        if client is None:
            return 1
        try:
            client.exists([mooncake_key("kvstore-mooncake-setup-probe")])
        except KVStoreError:
            return 2
        return 0

    # ---- registered memory --------------------------------------------------------------

    def register_buffer(self, buffer_ptr: int, size: int) -> int:
        """Records ``[buffer_ptr, buffer_ptr + size)`` as memory the ``*_from`` / ``*_into``
        calls may use: 0, or ``INVALID_PARAMS`` for a null pointer or a size below 1."""
        if buffer_ptr <= 0 or size <= 0:
            return INVALID_PARAMS
        region = _Region(buffer_ptr, size)
        with self._lock:
            self._regions = (*self._regions, region)
        return OK

    def unregister_buffer(self, buffer_ptr: int) -> int:
        """Forgets the range registered at ``buffer_ptr``: 0, or ``INVALID_PARAMS``."""
        with self._lock:
            keep = tuple(r for r in self._regions if r.start != buffer_ptr)
            if len(keep) == len(self._regions):
                return INVALID_PARAMS
            self._regions = keep
        return OK

    def _view(self, ptr: int, size: int) -> memoryview | None:
        """A view of registered memory ``[ptr, ptr + size)``, or None if no range holds it."""
        if size < 0 or ptr <= 0:
            return None
        for r in self._regions:
            if r.start <= ptr and ptr + size <= r.end:
                return r.view[ptr - r.start : ptr - r.start + size]
        return None

    def _span(self, ptrs: Sequence[int], sizes: Sequence[int]
              ) -> tuple[memoryview | None, list[memoryview] | None]:
        """A key's buffers: (one view if they are adjacent, the views), (None, None) if any
        lies outside registered memory."""
        found = (self._view(p, s) for p, s in zip(ptrs, sizes, strict=True))
        views = [v for v in found if v is not None]
        if not views or len(views) != len(ptrs):
            return None, None
        adjacent = all(ptrs[i] + sizes[i] == ptrs[i + 1] for i in range(len(ptrs) - 1))
        whole = self._view(ptrs[0], sum(sizes)) if adjacent else None
        return whole, views

    # ---- plumbing -----------------------------------------------------------------------

    def _reader(self) -> Any:
        return self._client

    def _writer(self, config: ReplicateConfig | None) -> tuple[Any, dict[str, Any]]:
        """The client a put with ``config`` goes to and its keyword arguments (``pin``, and
        ``retain_s`` only when the config asks for retention). InvalidArgument: a config
        kvstore cannot honour (see ``retain_seconds`` and ``check_placement``)."""
        client = self._client
        check_placement(config)
        opts: dict[str, Any] = {"pin": bool(config is not None and config.with_hard_pin)}
        retain = retain_seconds(config)
        if retain is not None:
            opts["retain_s"] = retain
        if client is None or config is None or self._cluster_opts is None:
            return client, opts
        n = int(getattr(config, "replica_num", 1) or 1)
        if n == getattr(client, "replicas", n):
            return client, opts
        with self._lock:
            derived = self._derived.get(n)
            if derived is None and self._client is not None:
                from replication.cluster_client import ClusterClient

                derived = ClusterClient(membership=client.membership, replicas=n,
                                        **self._cluster_opts)
                self._derived[n] = derived
        return derived, opts

    def _put(self, keys: Sequence[str | bytes], values: Sequence[object | None],
             config: ReplicateConfig | None) -> list[int]:
        """Puts ``values[i]`` (None: a bad buffer) under ``keys[i]``; a code per key."""
        try:
            client, opts = self._writer(config)
        except InvalidArgument as exc:
            log.error("put: %s", exc)
            return [code_of(exc)] * len(keys)
        if client is None:
            return [INVALID_PARAMS] * len(keys)
        codes = [OK] * len(keys)
        hks: list[bytes] = []
        idx: list[int] = []
        for i, (k, v) in enumerate(zip(keys, values, strict=True)):
            if v is None or not isinstance(k, (str, bytes)):
                codes[i] = INVALID_PARAMS
                continue
            idx.append(i)
            hks.append(mooncake_key(k))

        def put(sel: list[int]) -> None:
            client.put_batch([hks[j] for j in sel], [values[idx[j]] for j in sel], **opts)
            with self._lock:
                for j in sel:
                    self._written[hks[j]] = keys[idx[j]]

        per_key_codes(len(idx), put, (InvalidArgument, ResourceExhausted), idx, codes)
        return codes

    def _get_into(self, keys: Sequence[str | bytes], outs: Sequence[memoryview | None]
                  ) -> list[int]:
        """Reads ``keys[i]`` into ``outs[i]`` (None: a bad buffer); bytes read or a code."""
        client = self._reader()
        if client is None:
            return [INVALID_PARAMS] * len(keys)
        codes = [INVALID_PARAMS] * len(keys)
        idx = [i for i, (k, o) in enumerate(zip(keys, outs, strict=True))
               if o is not None and isinstance(k, (str, bytes))]
        hks = [mooncake_key(keys[i]) for i in idx]

        def get(sel: list[int]) -> None:
            got = client.get_batch_into([hks[j] for j in sel], [outs[idx[j]] for j in sel])
            for j, n in zip(sel, got, strict=True):
                codes[idx[j]] = OBJECT_NOT_FOUND if n is None else n

        # InvalidArgument: a buffer too small for its value; retried key by key to find it
        per_key_codes(len(idx), get, (InvalidArgument,), idx, codes)
        return codes

    # ---- existence ----------------------------------------------------------------------

    def is_exist(self, key: str | bytes) -> int:
        """1 if ``key`` is stored, 0 if not, -1 on error."""
        return self.batch_is_exist([key])[0]

    def batch_is_exist(self, keys: Sequence[str | bytes]) -> list[int]:
        """Per key: 1 stored, 0 not, -1 on error."""
        client = self._reader()
        if client is None:
            return [-1] * len(keys)
        try:
            found = client.exists([mooncake_key(k) for k in keys])
        except (KVStoreError, TypeError):
            return [-1] * len(keys)
        return [1 if f else 0 for f in found]

    # ---- copying API --------------------------------------------------------------------

    def put(self, key: str | bytes, value: object, config: ReplicateConfig | None = None
            ) -> int:
        """Stores a bytes-like ``value``: 0 (also when the key already exists, as in
        Mooncake), or a negative code (an empty value is ``INVALID_PARAMS``)."""
        return self._put([key], [value], config)[0]

    def put_batch(self, keys: Sequence[str | bytes], values: Sequence[object],
                  config: ReplicateConfig | None = None) -> int:
        """Stores each value under its key: 0 if all were stored, else the first error code."""
        if len(keys) != len(values):
            return INVALID_PARAMS
        return next((c for c in self._put(keys, values, config) if c != OK), OK)

    def put_parts(self, key: str | bytes, *parts: object,
                  config: ReplicateConfig | None = None) -> int:
        """Stores the concatenation of the bytes-like ``parts`` as one value: 0 or a code."""
        try:
            value = b"".join(byte_view(p) for p in parts)
        except TypeError:
            return INVALID_PARAMS
        return self._put([key], [value], config)[0]

    def get(self, key: str | bytes) -> bytes:
        """The value of ``key``; empty bytes on a miss or an error."""
        return self.get_batch([key])[0]

    def get_batch(self, keys: Sequence[str | bytes]) -> list[bytes]:
        """The value of each key; empty bytes for a miss (all empty on an error)."""
        values = self._values(keys)
        if values is None:
            return [b""] * len(keys)
        return [v if v is not None else b"" for v in values]

    def get_buffer(self, key: str | bytes) -> BufferHandle | None:
        """The value of ``key`` as a ``BufferHandle``, or None on a miss or an error."""
        return self.batch_get_buffer([key])[0]

    def batch_get_buffer(self, keys: Sequence[str | bytes]) -> list[BufferHandle | None]:
        """Each value as a ``BufferHandle``; None for a key not found (all None on an error)."""
        values = self._values(keys)
        if values is None:
            return [None] * len(keys)
        return [BufferHandle(v) if v is not None else None for v in values]

    def get_size(self, key: str | bytes) -> int:
        """The size of ``key``'s value, or ``OBJECT_NOT_FOUND`` / a code. kvstore has no size
        query: this reads the value."""
        client = self._reader()
        if client is None:
            return INVALID_PARAMS
        try:
            value = client.get(mooncake_key(key))
        except KVStoreError as exc:
            return code_of(exc)
        return OBJECT_NOT_FOUND if value is None else len(value)

    # ---- zero-copy API ------------------------------------------------------------------

    def put_from(self, key: str | bytes, buffer_ptr: int, size: int,
                 config: ReplicateConfig | None = None) -> int:
        """Stores ``size`` bytes at registered ``buffer_ptr``: 0 or a negative code."""
        return self.batch_put_from([key], [buffer_ptr], [size], config)[0]

    def batch_put_from(self, keys: Sequence[str | bytes], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int], config: ReplicateConfig | None = None
                       ) -> list[int]:
        """Per key: 0, or a negative code (``INVALID_PARAMS`` for a range outside
        registered memory)."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        views = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        return self._put(keys, views, config)

    def get_into(self, key: str | bytes, buffer_ptr: int, size: int) -> int:
        """Reads ``key`` into registered ``[buffer_ptr, buffer_ptr + size)``: bytes read, or
        ``OBJECT_NOT_FOUND``, ``INVALID_PARAMS`` (range not registered, value larger than
        ``size``) or another negative code."""
        return self.batch_get_into([key], [buffer_ptr], [size])[0]

    def batch_get_into(self, keys: Sequence[str | bytes], buffer_ptrs: Sequence[int],
                       sizes: Sequence[int]) -> list[int]:
        """Per key: bytes read, or a negative code (as ``get_into``)."""
        if not len(keys) == len(buffer_ptrs) == len(sizes):
            return [INVALID_PARAMS] * len(keys)
        outs = [self._view(p, s) for p, s in zip(buffer_ptrs, sizes, strict=True)]
        return self._get_into(keys, outs)

    def batch_put_from_multi_buffers(self, keys: Sequence[str | bytes],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     config: ReplicateConfig | None = None) -> list[int]:
        """Stores, per key, its buffers concatenated in order as one value: 0 or a code."""
        if not self._shapes_ok(keys, all_buffer_ptrs, all_sizes):
            return [INVALID_PARAMS] * len(keys)
        values: list[object | None] = []
        for ptrs, sizes in zip(all_buffer_ptrs, all_sizes, strict=True):
            whole, views = self._span(ptrs, sizes)
            values.append(whole if whole is not None
                          else b"".join(views) if views is not None else None)
        return self._put(keys, values, config)

    def batch_get_into_multi_buffers(self, keys: Sequence[str | bytes],
                                     all_buffer_ptrs: Sequence[Sequence[int]],
                                     all_sizes: Sequence[Sequence[int]],
                                     prefer_alloc_in_same_node: bool = False) -> list[int]:
        """Reads each key's value into its buffers in order: bytes read, or a negative code
        (``INVALID_PARAMS`` when a buffer is unregistered or they add up to less than the
        value). ``prefer_alloc_in_same_node`` is accepted and ignored."""
        if not self._shapes_ok(keys, all_buffer_ptrs, all_sizes):
            return [INVALID_PARAMS] * len(keys)
        outs: list[memoryview | None] = []
        scatter: dict[int, tuple[bytearray, list[memoryview]]] = {}
        for i, (ptrs, sizes) in enumerate(zip(all_buffer_ptrs, all_sizes, strict=True)):
            whole, views = self._span(ptrs, sizes)
            if whole is not None or views is None:
                outs.append(whole)
                continue
            staging = bytearray(sum(sizes))
            scatter[i] = (staging, views)
            outs.append(memoryview(staging))
        codes = self._get_into(keys, outs)
        for i, (staging, views) in scatter.items():
            left = codes[i]
            if left <= 0:
                continue
            off = 0
            for v in views:
                n = min(len(v), left)
                v[:n] = staging[off : off + n]
                off, left = off + n, left - n
                if not left:
                    break
        return codes

    @staticmethod
    def _shapes_ok(keys: Sequence[object], all_ptrs: Sequence[Sequence[int]],
                   all_sizes: Sequence[Sequence[int]]) -> bool:
        return (len(keys) == len(all_ptrs) == len(all_sizes)
                and all(len(p) == len(s) for p, s in zip(all_ptrs, all_sizes, strict=True)))

    # ---- removal ------------------------------------------------------------------------

    def remove(self, key: str | bytes, force: bool = False) -> int:
        """Removes ``key``: 0, ``OBJECT_NOT_FOUND``, or a code. ``force`` is accepted (kvstore
        has no leases to skip)."""
        return self.batch_remove([key], force)[0]

    def batch_remove(self, keys: Sequence[str | bytes], force: bool = False) -> list[int]:
        """Per key: 0, ``OBJECT_NOT_FOUND``, or a negative code."""
        client = self._reader()
        if client is None:
            return [INVALID_PARAMS] * len(keys)
        return [self._remove_one(client, mooncake_key(k)) for k in keys]

    def _remove_one(self, client: Any, hk: bytes) -> int:
        try:
            removed = client.remove(hk)
        except KVStoreError as exc:
            return code_of(exc)
        with self._lock:
            self._written.pop(hk, None)
        return OK if removed else OBJECT_NOT_FOUND

    def remove_all(self, force: bool = False) -> int:
        """Removes every key this instance has written and not removed since: how many
        were still stored, or -1 if a removal failed (the others are still done).

        Unlike Mooncake (whose master knows every key), kvstore cannot list keys, so keys
        written by other clients, or before a restart of this process, are not touched.
        """
        client = self._reader()
        if client is None:
            return -1
        with self._lock:
            pending = list(self._written)
        removed, failed = 0, False
        for hk in pending:
            code = self._remove_one(client, hk)
            removed += code == OK
            failed |= code not in (OK, OBJECT_NOT_FOUND)
        return -1 if failed else removed

    def written_keys(self) -> list[str | bytes]:
        """kvstore extension: the Mooncake keys ``remove_all`` would remove."""
        with self._lock:
            return list(self._written.values())

    def __enter__(self) -> MooncakeDistributedStore:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


install(MooncakeDistributedStore)
