"""kvstore as SGLang's HiCache L3 storage (a ``dynamic`` ``HiCacheStorage`` backend).

SGLang (tested: 0.5.23) loads third-party L3 storage by class path. The server flags::

    --enable-hierarchical-cache --hicache-storage-backend dynamic
    --hicache-storage-backend-extra-config '{"backend_name": "kvstore",
        "module_path": "kvstore.integrations.sglang.hicache",
        "class_name": "KVStoreHiCacheStorage", "interface_v1": 1, "allocator": "shm",
        "kvstore_addr": "127.0.0.1:7600"}'

``interface_v1: 1`` makes SGLang's cache controller call the zero-copy methods
(``batch_exists``, ``batch_set_v1``, ``batch_get_v1``: page keys plus host-pool indices);
without it SGLang uses the older copy-based ``batch_set`` / ``batch_get`` (implemented
too, on their own objects). ``allocator: shm`` makes SGLang allocate the host KV pool in a
memfd (``ShmHostTensorAllocator``), which this backend maps itself (see *Memory*).

Where kvstore is (keys of the extra config; the rest of it is SGLang's):

* ``kvstore_addr`` ``"HOST:PORT"``: one node, ``kvstore.Client(addr)``;
* ``kvstore_etcd`` ``"HOST:PORT"``: the cluster registered in that etcd, or
  ``kvstore_members`` ``"H1:P1,H2:P2,..."``: a fixed list of cluster nodes; with either,
  ``replicas`` and ``write_quorum`` (also spelled ``kvstore_replicas`` and
  ``kvstore_write_quorum``), see ``kvstore.integrations.store_config``;
* optional: ``kvstore_transport`` (``auto``, the default: shared memory with a node on
  this host, else the TCP channel), ``kvstore_timeout`` (s), ``kvstore_token`` (a tenant's
  bearer token), ``kvstore_namespace`` (a string mixed into every key, to keep
  deployments apart on a shared store), ``kvstore_model_path`` (the checkpoint whose
  weights are fingerprinted, when neither the server's model path nor the model name is
  a local checkpoint), ``kvstore_weights_id`` (a name for the weights that replaces
  their fingerprint; see *Keys*).

Keys. SGLang names a page by a string (a hash chain over the page's tokens). A page is
stored as *pieces*, one kvstore value per contiguous buffer that the host pool's
``get_page_buffer_meta`` reports for it (an MHA pool with a ``page_first`` layout: K and
V of the page over all layers, 2 pieces; ``layer_first``: K and V per layer, 2 x layers;
an MLA pool: 1). Piece ``i`` of page ``key`` is stored under::

    mooncake_key("sglang/" + ns + "/" + model + "/" + shard + "/" + fmt + "/" + identity
                 + "/" + key + "/" + i)
    = xxh3_128(b"kvstore-mooncake-v1\\x00" || utf8(that string))

(``kvstore.integrations.mooncake.store.mooncake_key``, the helper of the Mooncake module:
the same 16-byte mapping, so the string names stay readable through that module too).
``shard`` is ``tp{rank}of{size}`` for MHA (each TP rank holds its own heads) and ``mla``
for MLA (pages identical on every rank; SGLang lets one rank write), plus ``.pp{rank}``,
``.cp{rank}``, ``.dcp{rank}`` when those are in use; ``fmt`` is the host layout, dtype
and page size (plus the pool's ``storage_format_tag``), because the bytes of a piece
depend on them: pages written under another layout miss instead of loading garbage.
``identity`` (``i`` and 32 hex digits) stands for what decides the bytes beyond the page
format (``kvstore.integrations.identity``): the weights' fingerprint (the checkpoint at
``kvstore_model_path``, else the server's model path, else the storage config's model
name; ``kvstore_weights_id`` names the weights instead) and the server's dtype,
quantization, KV-cache dtype, KV scales file and config overrides, so a server on other
weights (a checkpoint overwritten in place, say) misses instead of loading another
model's pages. A model whose checkpoint is not found gets this process's own identity
(with a warning). Pools registered through the v2 interface
(``register_mem_host_pool_v2``: Mamba, SWA, indexer... sidecars) add ``.{pool name}`` to
the shard. The copy-based methods store a whole flat page as one value, piece ``flat``.

Memory. ``batch_set_v1`` / ``batch_get_v1`` hand kvstore memoryviews over the host pool
itself, so a page goes between the pool and the node with no intermediate buffer (with
the shared-memory transport: one ``memcpy`` between the pool and the node's
memfd-mapped DRAM region; over TCP: ``sendmsg`` / ``recv_into`` on the pool). With
``"allocator": "shm"`` the pool is a memfd (``mem_pool_host.allocator.fds``): the backend
maps that memfd itself (``mmap(fd, MAP_SHARED)``, the same physical pages as the pool's
tensor) and cuts the views from that mapping, bounded by the mapping (no raw pointers).
With any other allocator the views are built over the pool tensors' address ranges
(``ctypes``), checked against them.

Results follow SGLang's conventions: ``batch_exists`` counts the leading pages whose
every piece is stored; ``batch_set_v1`` / ``batch_get_v1`` return one bool per page (a
page counts only if all its pieces moved, a get only if each piece has the expected
size). A set skips pages already stored (as SGLang's Mooncake backend does). Nothing
raises for a store-side failure (the node down, out of space...): those pages are
``False`` and the failure is logged.

``clear()`` (SGLang's ``POST /hicache/storage-backend/clear``) removes the keys *this
backend instance* has written: kvstore cannot list keys and hashes do not invert.
``close()`` closes the client.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolHitPolicy,
    PoolTransfer,
    PoolTransferResult,
)

from kvstore.core.errors import KVStoreError
from kvstore.core.keys import leading_run
from kvstore.integrations.identity import (
    WeightsIdentity,
    identity_digest,
    process_value,
    weights_identity,
)
from kvstore.integrations.mooncake.store import mooncake_key
from kvstore.integrations.store_config import PLACE_KEYS, store_spec

__all__ = ["KVStoreHiCacheStorage", "page_object_name"]

log = logging.getLogger(__name__)

KV_POOL = "kv"


_SERVER_MODEL_SETTINGS = ("model_path", "revision", "download_dir", "dtype", "quantization",
                          "kv_cache_dtype", "quantization_param_path",
                          "json_model_override_args")


def _server_model_settings() -> dict[str, str]:
    """The model settings an SGLang server published (``runtime_context.get_model()``);
    empty where none were (a backend built outside a server, as the tests do)."""
    try:
        from sglang.srt.runtime_context import get_model

        bag = get_model()
    except (ImportError, ValueError, AttributeError):
        return {}
    out: dict[str, str] = {}
    for name in _SERVER_MODEL_SETTINGS:
        try:
            value = getattr(bag, name)
        except (AttributeError, ValueError):
            continue
        out[name] = "" if value is None else str(value)
    return out


def page_object_name(prefix: str, key: str, piece: int | str) -> str:
    """The string name of one piece of one page (hashed with ``mooncake_key``)."""
    return f"{prefix}/{key}/{piece}"


def _ptr_of_mmap(mm: mmap.mmap) -> int:
    holder = ctypes.c_char.from_buffer(mm)
    try:
        return ctypes.addressof(holder)
    finally:
        del holder  # release the export so the mmap can close later


@dataclass(slots=True)
class _Region:
    start: int
    nbytes: int
    view: memoryview  # writable, flat bytes
    source: str  # "memfd" or "address"


class _PoolMemory:
    """Byte views over one host pool's buffers, by raw address range."""

    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.regions: list[_Region] = []
        self._maps: list[tuple[mmap.mmap, memoryview]] = []
        buffers = pool.kv_buffer
        tensors = ([buffers] if isinstance(buffers, torch.Tensor)
                   else [b for b in (buffers or []) if isinstance(b, torch.Tensor)])
        memfds = self._memfds(pool)
        for t in tensors:
            start, nbytes = t.data_ptr(), t.numel() * t.element_size()
            region = self._map_memfd(memfds, start, nbytes)
            if region is None:
                raw = (ctypes.c_char * nbytes).from_address(start)
                region = _Region(start, nbytes, memoryview(raw).cast("B"), "address")
            self.regions.append(region)
        self.regions.sort(key=lambda r: r.start)

    @staticmethod
    def _memfds(pool: Any) -> list[tuple[int, int]]:
        """(fd, address of the allocator's own mapping) of a memfd-backed pool."""
        alloc = getattr(pool, "allocator", None)
        fds, mms = getattr(alloc, "fds", None), getattr(alloc, "mms", None)
        if not fds or not mms or len(fds) != len(mms):
            return []
        return [(fd, _ptr_of_mmap(mm)) for fd, mm in zip(fds, mms, strict=True)
                if fd is not None and mm is not None]

    def _map_memfd(self, memfds: list[tuple[int, int]], start: int, nbytes: int
                   ) -> _Region | None:
        for fd, base in memfds:
            size = os.fstat(fd).st_size
            if base <= start and start + nbytes <= base + size:
                mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED,
                               prot=mmap.PROT_READ | mmap.PROT_WRITE)
                whole = memoryview(mm)
                self._maps.append((mm, whole))
                off = start - base
                return _Region(start, nbytes, whole[off : off + nbytes], "memfd")
        return None

    @property
    def source(self) -> str:
        kinds = {r.source for r in self.regions}
        return kinds.pop() if len(kinds) == 1 else "mixed" if kinds else "none"

    def view(self, ptr: int, size: int) -> memoryview:
        for r in self.regions:
            if r.start <= ptr and ptr + size <= r.start + r.nbytes:
                off = ptr - r.start
                return r.view[off : off + size]
        raise ValueError(f"host range {ptr:#x}+{size} lies outside the registered pool")

    def close(self) -> None:
        for r in self.regions:
            r.view.release()
        self.regions = []
        for mm, whole in self._maps:
            whole.release()
            # a view still in use elsewhere keeps the mapping until it is collected
            with contextlib.suppress(BufferError):
                mm.close()
        self._maps = []


def _flatten_meta(ptrs: Sequence[Any], sizes: Sequence[Any]) -> tuple[list[int], list[int]]:
    """``get_page_buffer_meta`` gives flat lists, or per object lists of buffers."""
    fp: list[int] = []
    fs: list[int] = []
    for p, s in zip(ptrs, sizes, strict=True):
        if isinstance(p, (list, tuple)):
            fp.extend(int(x) for x in p)
            fs.extend(int(x) for x in s)
        else:
            fp.append(int(p))
            fs.append(int(s))
    return fp, fs


class KVStoreHiCacheStorage(HiCacheStorage):
    """SGLang HiCache L3 storage on kvstore (see the module docstring)."""

    def __init__(self, storage_config: HiCacheStorageConfig | None = None,
                 kwargs: dict | None = None) -> None:
        kwargs = dict(kwargs or {})
        self.storage_config = storage_config
        extra = dict((storage_config.extra_config if storage_config else None) or {})
        extra.update({k: v for k, v in kwargs.items() if k.startswith("kvstore_")})
        self.extra_config = extra
        client = kwargs.get("client")
        self._owns_client = client is None
        self.client = client if client is not None else self._make_client(extra)
        self._lock = threading.Lock()
        self._written: set[bytes] = set()  # guarded by _lock
        self._mem: dict[str, _PoolMemory] = {}
        self._pools: dict[str, Any] = {}
        self.mem_pool_host: Any = None
        self.registered_pools: dict[str, Any] = {}
        self._closed = False
        self.weights, self.identity = self._engine_identity(storage_config, extra)
        log.info("KVStoreHiCacheStorage: weights %s, identity %s", self.weights,
                 self.identity)

    # ---- setup ---------------------------------------------------------------------------

    @staticmethod
    def _make_client(extra: dict) -> Any:
        opts: dict[str, Any] = {}
        if "kvstore_transport" in extra:
            opts["transport"] = str(extra["kvstore_transport"])
        if "kvstore_timeout" in extra:
            opts["timeout"] = float(extra["kvstore_timeout"])
        if extra.get("kvstore_token"):
            opts["token"] = str(extra["kvstore_token"])
        if not any(extra.get(k) for k in PLACE_KEYS) and os.environ.get("KVSTORE_ADDR"):
            extra = {**extra, "kvstore_addr": os.environ["KVSTORE_ADDR"]}

        def get(key: str) -> Any:
            value = extra.get(key)
            if value is None and key in ("replicas", "write_quorum"):
                value = extra.get(f"kvstore_{key}")  # the names this backend took first
            return value

        return store_spec(get, who="KVStoreHiCacheStorage (storage backend extra config)"
                          ).connect(**opts)

    @staticmethod
    def _engine_identity(storage_config: HiCacheStorageConfig | None, extra: dict
                         ) -> tuple[WeightsIdentity, str]:
        """What decides the KV bytes beyond the page format (``kvstore.integrations.
        identity``): the weights of ``kvstore_model_path``, of the server's model path
        or of the storage config's model name (``kvstore_weights_id`` names them
        instead), and the server's dtype, quantization, KV-cache dtype and scales and
        config overrides; as ``i`` + 32 hex digits."""
        settings = _server_model_settings()
        model = (str(extra.get("kvstore_model_path") or "") or settings.get("model_path")
                 or (storage_config.model_name if storage_config is not None else None) or "")
        weights = weights_identity(model, revision=settings.get("revision") or None,
                                   weights_id=extra.get("kvstore_weights_id"),
                                   cache_dirs=[settings.get("download_dir", "")])
        parts = {"weights": str(weights)}
        for name in ("dtype", "quantization", "kv_cache_dtype", "json_model_override_args"):
            if name in settings:
                parts[name] = settings[name]
        scales = settings.get("quantization_param_path")
        if scales:  # KV-cache scales read from a file: its contents
            try:
                parts["kv_scales"] = identity_digest({"file": Path(scales).read_bytes().hex()})
            except OSError as exc:
                log.warning("kvstore HiCache: cannot read KV scales %s (%s): this "
                            "process's pages are its own", scales, exc)
                parts["kv_scales"] = f"unread:{process_value()}"
        return weights, "i" + identity_digest(parts)

    def _shard(self, pool_name: str) -> str:
        c = self.storage_config
        if c is None:
            shard = "tp0of1"
        else:
            shard = "mla" if c.is_mla_model else f"tp{c.tp_rank}of{c.tp_size}"
            if c.pp_size > 1:
                shard += f".pp{c.pp_rank}"
            if c.attn_cp_size > 1:
                shard += f".cp{c.attn_cp_rank}"
            if c.dcp_size > 1:
                shard += f".dcp{c.dcp_rank}"
            if c.should_split_heads:
                raise NotImplementedError(
                    "KVStoreHiCacheStorage does not split heads across TP sizes "
                    "(tp_lcm_size with the page_head layout)")
        return shard if pool_name == KV_POOL else f"{shard}.{pool_name}"

    def _prefix(self, pool_name: str, pool: Any) -> str:
        c = self.storage_config
        model = (c.model_name if c is not None else None) or ""
        ns = str(self.extra_config.get("kvstore_namespace", ""))
        dtype = str(getattr(pool, "dtype", "")).removeprefix("torch.")
        fmt = f"{getattr(pool, 'layout', '')}.{dtype}.p{getattr(pool, 'page_size', 0)}"
        tag = getattr(pool, "storage_format_tag", None)
        if tag:
            fmt += f".{tag}"
        return f"sglang/{ns}/{model}/{self._shard(pool_name)}/{fmt}/{self.identity}"

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._attach(KV_POOL, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(str(host_pool_name), host_pool)

    def _attach(self, name: str, pool: Any) -> None:
        old = self._mem.pop(name, None)
        if old is not None and self._pools.get(name) is not pool:
            old.close()
        elif old is not None:
            self._mem[name] = old
            return
        self._pools[name] = pool
        if getattr(pool, "kv_buffer", None) is not None:
            self._mem[name] = _PoolMemory(pool)

    def memory_source(self, pool_name: str = KV_POOL) -> str:
        """How the views over a pool are made: ``"memfd"`` (the pool's memfd mapped by
        this backend, SGLang's ``allocator: shm``) or ``"address"``."""
        mem = self._mem.get(pool_name)
        return mem.source if mem is not None else "none"

    # ---- keys ----------------------------------------------------------------------------

    def _keys(self, pool_name: str, keys: Sequence[str], pieces: int) -> list[bytes]:
        prefix = self._prefix(pool_name, self._pools[pool_name])
        return [mooncake_key(page_object_name(prefix, k, i)) for k in keys for i in range(pieces)]

    def _flat_key(self, key: str) -> bytes:
        pool = self._pools.get(KV_POOL)
        prefix = self._prefix(KV_POOL, pool) if pool is not None else self._prefix(KV_POOL, None)
        return mooncake_key(page_object_name(prefix, key, "flat"))

    def _pieces_per_page(self, pool_name: str) -> int:
        pool = self._pools[pool_name]
        page = getattr(pool, "page_size", 1) or 1
        ptrs, _ = _flatten_meta(*pool.get_page_buffer_meta(torch.arange(page)))
        return len(ptrs)

    def _layout(self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor
                ) -> tuple[list[bytes], list[memoryview], int]:
        """Kvstore keys and host-pool views of every piece of ``keys``' pages."""
        pool = self._pools[pool_name]
        page = getattr(pool, "page_size", 1) or 1
        if host_indices.numel() != len(keys) * page:
            raise ValueError(f"{len(keys)} pages but {host_indices.numel()} host indices "
                             f"(page size {page})")
        ptrs, sizes = _flatten_meta(*pool.get_page_buffer_meta(host_indices))
        if len(ptrs) % len(keys):
            raise ValueError(f"{len(ptrs)} buffers for {len(keys)} pages")
        pieces = len(ptrs) // len(keys)
        mem = self._mem[pool_name]
        views = [mem.view(p, s) for p, s in zip(ptrs, sizes, strict=True)]
        return self._keys(pool_name, keys, pieces), views, pieces

    # ---- zero-copy interface (interface_v1) ----------------------------------------------

    def batch_exists(self, keys: list[str],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._exists_prefix(KV_POOL, keys)

    def _exists_prefix(self, pool_name: str, keys: Sequence[str]) -> int:
        if not keys:
            return 0
        if pool_name not in self._pools or (pool_name == KV_POOL and not self._v1):
            flat = [self._flat_key(k) for k in keys]
            return leading_run(self._exists(flat))
        pieces = self._pieces_per_page(pool_name)
        # A page counts whole: its leading run of pieces, cut to full pages.
        return leading_run(self._exists(self._keys(pool_name, keys, pieces))) // pieces

    def _exists(self, hkeys: list[bytes]) -> list[bool]:
        try:
            return list(self.client.exists(hkeys))
        except KVStoreError as e:
            log.warning("kvstore exists of %d keys failed: %s", len(hkeys), e)
            return [False] * len(hkeys)

    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._set_pages(KV_POOL, keys, host_indices)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._get_pages(KV_POOL, keys, host_indices)

    def _set_pages(self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor
                   ) -> list[bool]:
        if not keys:
            return []
        if pool_name not in self._mem:  # a logical-only pool holds no bytes
            return [True] * len(keys)
        hkeys, views, pieces = self._layout(pool_name, keys, host_indices)
        ok = self._exists(hkeys)
        todo = [i for i, present in enumerate(ok) if not present]
        if todo:
            try:
                stored = self.client.put_batch([hkeys[i] for i in todo], [views[i] for i in todo])
            except KVStoreError as e:
                log.warning("kvstore put of %d pieces failed: %s", len(todo), e)
                stored = [False] * len(todo)
            for i, s in zip(todo, stored, strict=True):
                ok[i] = bool(s)
            with self._lock:
                self._written.update(hkeys[i] for i, s in zip(todo, stored, strict=True) if s)
        return [all(ok[p * pieces : (p + 1) * pieces]) for p in range(len(keys))]

    def _get_pages(self, pool_name: str, keys: Sequence[str], host_indices: torch.Tensor
                   ) -> list[bool]:
        if not keys:
            return []
        if pool_name not in self._mem:
            return [True] * len(keys)
        hkeys, views, pieces = self._layout(pool_name, keys, host_indices)
        try:
            got = self.client.get_batch_into(hkeys, views)
        except KVStoreError as e:
            log.warning("kvstore get of %d pieces failed: %s", len(hkeys), e)
            got = [None] * len(hkeys)
        ok = [n == len(v) for n, v in zip(got, views, strict=True)]
        return [all(ok[p * pieces : (p + 1) * pieces]) for p in range(len(keys))]

    # ---- v2 interface (hybrid models: per-pool transfers) ------------------------------

    def batch_exists_v2(self, keys: list[str],
                        pool_transfers: list[PoolTransfer] | None = None,
                        extra_info: HiCacheStorageExtraInfo | None = None
                        ) -> PoolTransferResult:
        kv_pages = self._exists_prefix(KV_POOL, keys)
        hits: dict[str, int] = {KV_POOL: kv_pages} if kv_pages else {}
        restorable = list(range(1, kv_pages + 1))
        for transfer in pool_transfers or []:
            if not restorable:
                break
            name = str(transfer.name)
            if name not in self._pools:
                restorable = []
                break
            pieces = self._pieces_per_page(name)
            present = self._exists(self._keys(name, keys[:kv_pages], pieces))
            page_ok = [all(present[i * pieces : (i + 1) * pieces]) for i in range(kv_pages)]
            if transfer.hit_policy == PoolHitPolicy.ALL_PAGES:
                boundary = next((i for i, ok in enumerate(page_ok) if not ok), kv_pages)
                allowed = set(range(1, boundary + 1))
            elif transfer.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                trailing = max(1, len(transfer.keys) if transfer.keys else 1)
                allowed = {n for n in range(1, kv_pages + 1)
                           if all(page_ok[max(0, n - trailing) : n])}
                boundary = max(allowed, default=0)
            else:
                log.warning("kvstore HiCache: hit policy %s not supported", transfer.hit_policy)
                allowed, boundary = set(), 0
            if boundary:
                hits[name] = boundary
            restorable = [n for n in restorable if n in allowed]
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    def _v2(self, transfers: list[PoolTransfer], op: Any) -> dict[str, list[bool]]:
        out: dict[str, list[bool]] = {}
        for t in transfers:
            name = str(t.name)
            keys = list(t.keys or [])
            if name not in self._pools or t.host_indices is None:
                out[name] = [False] * len(keys)
                continue
            try:
                out[name] = op(name, keys, t.host_indices)
            except ValueError as e:
                log.error("kvstore HiCache %s for pool %s: %s", op.__name__, name, e)
                out[name] = [False] * len(keys)
        return out

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, self._get_pages)

    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: HiCacheStorageExtraInfo | None = None) -> dict[str, list[bool]]:
        return self._v2(transfers, self._set_pages)

    # ---- copy-based interface (without interface_v1) -----------------------------------

    @staticmethod
    def _bytes_of(t: torch.Tensor) -> Any:
        return t.detach().contiguous().view(torch.uint8).numpy()

    def get(self, key: str, target_location: Any | None = None,
            target_sizes: Any | None = None) -> torch.Tensor | None:
        return self.batch_get([key], [target_location] if target_location is not None
                              else None)[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None,
                  target_sizes: Any | None = None) -> list[torch.Tensor | None]:
        hkeys = [self._flat_key(k) for k in keys]
        try:
            if target_locations is None:
                values = self.client.get_batch(hkeys)
                return [None if v is None else torch.frombuffer(bytearray(v), dtype=torch.uint8)
                        for v in values]
            outs = [self._bytes_of(t) for t in target_locations if t.is_contiguous()]
            if len(outs) < len(target_locations):
                raise ValueError("target locations must be contiguous CPU tensors")
            got = self.client.get_batch_into(hkeys, outs)
        except KVStoreError as e:
            log.warning("kvstore get of %d pages failed: %s", len(keys), e)
            return [None] * len(keys)
        return [t if n == len(o) else None
                for t, o, n in zip(target_locations, outs, got, strict=True)]

    def set(self, key: str, value: Any | None = None, target_location: Any | None = None,
            target_sizes: Any | None = None) -> bool:
        return self.batch_set([key], [value])

    def batch_set(self, keys: list[str], values: Any | None = None,
                  target_locations: Any | None = None, target_sizes: Any | None = None
                  ) -> bool:
        if not keys:
            return True
        if values is None or len(values) != len(keys):
            return False
        hkeys = [self._flat_key(k) for k in keys]
        try:
            stored = self.client.put_batch(hkeys, [self._bytes_of(v) for v in values])
        except KVStoreError as e:
            log.warning("kvstore put of %d pages failed: %s", len(keys), e)
            return False
        with self._lock:
            self._written.update(k for k, s in zip(hkeys, stored, strict=True) if s)
        return all(stored)

    def exists(self, key: str) -> bool:
        return self.batch_exists([key]) == 1

    @property
    def _v1(self) -> bool:
        return bool(self.extra_config.get("interface_v1", 0)) and KV_POOL in self._pools

    # ---- housekeeping --------------------------------------------------------------------

    def clear(self) -> bool:
        """Removes the keys this instance wrote (kvstore cannot list keys)."""
        with self._lock:
            written, self._written = self._written, set()
        ok = True
        for k in written:
            try:
                self.client.remove(k)
            except KVStoreError as e:
                log.warning("kvstore remove failed: %s", e)
                ok = False
        return ok

    def written_keys(self) -> int:
        """How many kvstore keys this instance wrote and has not cleared."""
        with self._lock:
            return len(self._written)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for mem in self._mem.values():
            mem.close()
        self._mem.clear()
        if self._owns_client:
            self.client.close()

    def get_stats(self) -> None:
        return None
