"""kvstore as an LMCache remote storage plugin.

``KVStoreRemoteConnector`` is an LMCache ``RemoteConnector`` (``lmcache.v1.storage_backend.
connector.base_connector``), loaded by LMCache's ``remote_storage_plugins`` mechanism (a
``RemoteConnector`` subclass named in ``extra_config`` is wrapped in LMCache's
``DynamicConnectorAdapter``)::

    remote_storage_plugins: ["kvstore"]
    extra_config:
      remote_storage_plugin.kvstore.module_path: kvstore.integrations.lmcache.connector
      remote_storage_plugin.kvstore.class_name: KVStoreRemoteConnector
      kvstore_addr: "127.0.0.1:7600"      # one node; or a cluster:
      # kvstore_etcd: "HOST:PORT"  or  kvstore_members: "H1:P1,H2:P2,H3:P3"
      # replicas: 2                                   (cluster: copies of each chunk)
      # write_quorum: 2                               (cluster: copies a put waits for)
      # kvstore_transport: auto | grpc | tcp | shm   (default auto)
      # kvstore_token: ...                            (a node with tenants)
      # kvstore_timeout: 30                           (seconds per call)
      # kvstore_model_path: /models/llama             (the checkpoint to fingerprint)
      # kvstore_weights_id: llama-ft-7                (a name for the weights instead)

LMCache needs its local CPU backend on (``local_cpu: true``, ``max_local_cpu_size > 0``):
it is the buffer chunks are read into.

What is stored: one kvstore object per LMCache chunk, holding the chunk's bytes as LMCache
lays them out in its ``MemoryObj`` (``byte_array``: its logical size, so a partial last
chunk is shorter), without a metadata header. A read allocates a full chunk from the
local CPU backend, reads the value into it and narrows it to the tokens read with
``RemoteConnector.reshape_partial_chunk`` (the layout LMCache's Mooncake connector uses
with ``save_chunk_meta: false``); shapes and dtypes come from the engine's metadata, so a
reader must run the same model, TP rank and chunk size (they are part of LMCache's key).

Keys: LMCache's key string (``CacheEngineKey.to_string()``) and this connector's
``identity`` are stored under ``lmcache_key(key, identity)`` =
``kvstore.integrations.mooncake.store.mooncake_key(key_string + "#" + identity)``:
``xxh3_128(b"kvstore-mooncake-v1\\x00" || utf8(that string))``, 16 bytes. ``identity``
(``i`` and 32 hex digits, ``kvstore.integrations.identity``) stands for what decides a
chunk's bytes beyond LMCache's key: the weights' fingerprint (the checkpoint at
``kvstore_model_path``, else at the metadata's model name; ``kvstore_weights_id`` names the
weights instead; a model whose checkpoint is not found gets this process's own identity,
with a warning), the KV dtype and shape and MLA. So an engine on other weights (a
checkpoint overwritten in place under the same name, say) misses instead of loading the
old weights' KV. A plain ``kvstore.Client`` reads a chunk with ``lmcache_key(key,
connector.identity)``. (Before issue 23 the key was ``mooncake_key(key_string)``, the one
LMCache's own Mooncake connector uses; that one has no identity and is not shared.)

Limits: kvstore cannot list its keys and the hash does not invert, so ``list()`` returns
the key strings this connector instance wrote and has not removed (nothing from other
processes or before a restart). A put of a key that already exists keeps the stored value
(LMCache's chunks are content-addressed). kvstore errors never reach LMCache: a failed
get is a miss (``None``), a failed put is logged and dropped, a failed exists is False.

kvstore calls block, so every coroutine runs its call in a worker thread
(``asyncio.to_thread``); the event loop is LMCache's.
"""

from __future__ import annotations

import asyncio
import logging
import threading
from typing import Any

from lmcache.utils import CacheEngineKey
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.storage_backend.connector.base_connector import RemoteConnector

from kvstore.core.errors import KVStoreError
from kvstore.integrations.identity import WeightsIdentity, identity_digest, weights_identity
from kvstore.integrations.mooncake.store import mooncake_key
from kvstore.integrations.store_config import store_spec

logger = logging.getLogger(__name__)

__all__ = ["KVStoreRemoteConnector", "lmcache_key"]


def lmcache_key(key: CacheEngineKey | str, identity: str = "") -> bytes:
    """The 16-byte kvstore key under which a chunk of LMCache key ``key`` is stored by a
    connector of ``identity`` (``KVStoreRemoteConnector.identity``; empty: the key
    without one, as LMCache's own Mooncake connector names it)."""
    name = key if isinstance(key, str) else key.to_string()
    return mooncake_key(f"{name}#{identity}" if identity else name)


def engine_identity(metadata: Any, extra: dict) -> tuple[WeightsIdentity, str]:
    """What decides a chunk's bytes beyond LMCache's key (model name, world size, worker,
    chunk hash, dtype): the weights (``kvstore.integrations.identity``: the checkpoint at
    ``kvstore_model_path``, else at the metadata's model name; ``kvstore_weights_id``
    names them instead), the KV dtype and shape and MLA, as ``i`` + 32 hex digits."""
    model = str(_setting(extra, "kvstore_model_path", "") or getattr(metadata, "model_name", "")
                or "")
    weights = weights_identity(model, weights_id=_setting(extra, "kvstore_weights_id"))
    parts = {"weights": str(weights), "kv_dtype": str(getattr(metadata, "kv_dtype", "")),
             "kv_shape": str(tuple(getattr(metadata, "kv_shape", ()) or ())),
             "mla": str(bool(getattr(metadata, "use_mla", False)))}
    return weights, "i" + identity_digest(parts)


def _setting(extra: dict, name: str, default: Any = None) -> Any:
    value = extra.get(name)
    return default if value is None or value == "" else value


class KVStoreRemoteConnector(RemoteConnector):
    """An LMCache ``RemoteConnector`` on a kvstore node (see the module docstring).

    LMCache builds it as ``KVStoreRemoteConnector(loop=..., local_cpu_backend=...,
    config=...)``; ``client=`` takes a ``kvstore.Client`` built elsewhere instead of
    ``extra_config['kvstore_addr']`` (it is then not closed by ``close``)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, local_cpu_backend: Any,
                 config: Any = None, *, client: Any = None) -> None:
        config = config if config is not None else local_cpu_backend.config
        super().__init__(config, local_cpu_backend.metadata)
        self.loop = loop
        self.local_cpu_backend = local_cpu_backend
        extra = dict(config.extra_config or {})
        self._owns_client = client is None
        if client is None:
            timeout = _setting(extra, "kvstore_timeout", 30.0)
            spec = store_spec(lambda key: _setting(extra, key),
                              who="KVStoreRemoteConnector extra_config")
            client = spec.connect(transport=str(_setting(extra, "kvstore_transport", "auto")),
                                  timeout=float(timeout), token=_setting(extra, "kvstore_token"))
        self.client = client
        self.weights, self.identity = engine_identity(local_cpu_backend.metadata, extra)
        self._written: set[str] = set()
        self._lock = threading.Lock()
        self._closed = False
        logger.info("KVStoreRemoteConnector on %s (full chunk %d bytes, weights %s, "
                    "identity %s)", getattr(client, "addr", None) or "the cluster",
                    self.full_chunk_size_bytes, self.weights, self.identity)

    def _key(self, key: CacheEngineKey | str) -> bytes:
        return lmcache_key(key, self.identity)

    # ---- existence ---------------------------------------------------------------------

    def _exists_many(self, keys: list[CacheEngineKey]) -> list[bool]:
        if not keys:
            return []
        try:
            return list(self.client.exists([self._key(k) for k in keys]))
        except KVStoreError as exc:
            logger.warning("kvstore exists failed: %s", exc)
            return [False] * len(keys)

    @staticmethod
    def _prefix(found: list[bool]) -> int:
        return found.index(False) if False in found else len(found)

    async def exists(self, key: CacheEngineKey) -> bool:
        return (await asyncio.to_thread(self._exists_many, [key]))[0]

    def exists_sync(self, key: CacheEngineKey) -> bool:
        return self._exists_many([key])[0]

    def support_batched_contains(self) -> bool:
        return True

    def batched_contains(self, keys: list[CacheEngineKey]) -> int:
        return self._prefix(self._exists_many(list(keys)))

    def support_batched_async_contains(self) -> bool:
        return True

    async def batched_async_contains(self, lookup_id: str, keys: list[CacheEngineKey],
                                     pin: bool = False) -> int:
        return self._prefix(await asyncio.to_thread(self._exists_many, list(keys)))

    # ---- reads ------------------------------------------------------------------------

    def _get_many(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        """Reads each key into a freshly allocated full chunk; None for a miss, an
        allocation failure, a kvstore error or a value of an impossible length."""
        out: list[MemoryObj | None] = [None] * len(keys)
        objs: list[tuple[int, MemoryObj]] = []
        for i in range(len(keys)):
            obj = self.local_cpu_backend.allocate(self.meta_shapes, self.meta_dtypes,
                                                  self.meta_fmt)
            if obj is None:
                logger.warning("LMCache CPU buffer full: %d of %d chunks not read",
                               len(keys) - i, len(keys))
                break
            objs.append((i, obj))
        if not objs:
            return out
        try:
            sizes = self.client.get_batch_into([self._key(keys[i]) for i, _ in objs],
                                               [memoryview(o.byte_array) for _, o in objs])
        except KVStoreError as exc:
            logger.warning("kvstore get of %d chunks failed: %s", len(objs), exc)
            sizes = [None] * len(objs)
        for (i, obj), n in zip(objs, sizes, strict=True):
            if not n:
                obj.ref_count_down()
                continue
            try:
                out[i] = self.reshape_partial_chunk(obj, n)
            except ValueError as exc:
                logger.warning("kvstore value of %s has a bad length: %s", keys[i], exc)
                obj.ref_count_down()
        return out

    async def get(self, key: CacheEngineKey) -> MemoryObj | None:
        return (await asyncio.to_thread(self._get_many, [key]))[0]

    def support_batched_get(self) -> bool:
        return True

    async def batched_get(self, keys: list[CacheEngineKey]) -> list[MemoryObj | None]:
        return await asyncio.to_thread(self._get_many, list(keys))

    def support_batched_get_non_blocking(self) -> bool:
        return True

    async def batched_get_non_blocking(self, lookup_id: str,
                                       keys: list[CacheEngineKey]) -> list[MemoryObj]:
        """The chunks read, up to the first one missing (the rest are released)."""
        got = await asyncio.to_thread(self._get_many, list(keys))
        out: list[MemoryObj] = []
        for obj in got:
            if obj is None:
                break
            out.append(obj)
        for obj in got[len(out):]:
            if obj is not None:
                obj.ref_count_down()
        return out

    # ---- writes -----------------------------------------------------------------------

    def _put_many(self, keys: list[CacheEngineKey], objs: list[MemoryObj]) -> None:
        if not keys:
            return
        names = [k.to_string() for k in keys]
        try:
            self.client.put_batch([self._key(n) for n in names],
                                  [memoryview(o.byte_array) for o in objs])
        except KVStoreError as exc:
            logger.warning("kvstore put of %d chunks failed: %s", len(keys), exc)
            return
        with self._lock:
            self._written.update(names)

    async def put(self, key: CacheEngineKey, memory_obj: MemoryObj) -> None:
        await asyncio.to_thread(self._put_many, [key], [memory_obj])

    def support_batched_put(self) -> bool:
        return True

    async def batched_put(self, keys: list[CacheEngineKey],
                          memory_objs: list[MemoryObj]) -> None:
        await asyncio.to_thread(self._put_many, list(keys), list(memory_objs))

    def remove_sync(self, key: CacheEngineKey) -> bool:
        name = key.to_string()
        try:
            removed = bool(self.client.remove(self._key(name)))
        except KVStoreError as exc:
            logger.warning("kvstore remove failed: %s", exc)
            return False
        with self._lock:
            self._written.discard(name)
        return removed

    # ---- the rest ---------------------------------------------------------------------

    async def list(self) -> list[str]:
        """Key strings this instance wrote and has not removed (kvstore cannot list)."""
        with self._lock:
            return sorted(self._written)

    def support_ping(self) -> bool:
        return True

    async def ping(self) -> int:
        """0 when the node answers, 1 otherwise."""
        def probe() -> int:
            try:
                self.client.exists([bytes(16)])
                return 0
            except KVStoreError:
                return 1
        return await asyncio.to_thread(probe)

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        if self._owns_client:
            await asyncio.to_thread(self.client.close)

    def __repr__(self) -> str:
        return f"<KVStoreRemoteConnector {getattr(self.client, 'addr', '')}>"
