"""kvstore as vLLM's external KV cache: a ``KVConnectorBase_V1`` loaded out of tree.

Configuration (vLLM 0.32 and 0.33, the list in ``kvstore.integrations.vllm.versions``; the
connector API is marked unstable upstream, so other versions are refused at import)::

    KVTransferConfig(
        kv_connector="KVStoreConnector",
        kv_connector_module_path="kvstore.integrations.vllm.connector",
        kv_role="kv_both",                  # kv_producer: save only; kv_consumer: load only
        kv_load_failure_policy="recompute", # a refused block is recomputed, not an error
        kv_connector_extra_config={"kvstore_addr": "127.0.0.1:7600"},
    )

``kv_connector_extra_config`` keys: where the store is, exactly one of ``kvstore_addr``
(``"HOST:PORT"`` of one node), ``kvstore_etcd`` (``"HOST:PORT"`` of a cluster's etcd) or
``kvstore_members`` (``"H1:P1,H2:P2,..."``, a fixed cluster), with a cluster ``replicas``
(copies of each block, default 1) and ``write_quorum`` (copies a save waits for, default
``replicas``), see ``kvstore.integrations.store_config``; ``namespace`` (default:
``default_namespace``, which names the engine identity: see *Identity* below),
``weights_id`` (a name for the weights instead of their fingerprint), ``kvstore_token``
(bearer token of a node with tenants), ``max_pending_saves`` (save batches in flight
before a step waits, default 4), ``timeout`` (seconds per store call, default 30),
``gil_switch_interval_ms`` (the worker process's GIL switch interval while it runs the
connector's threads, default 0.5; 0 leaves Python's: ``threads.shorten_gil_switch``),
``load_inline_when_idle`` (default true: a load on an engine with nothing else to run is
done in the step instead of on the loader thread; ``load_mode``),
``load_inline_busy_max_bytes`` (default 16 MiB: with other requests running, loads inline
in one step together up to this many bytes; 0: none).

Design
------
*Keys.* A request's token ids (prompt, then output tokens as they become known) are cut
into full blocks of ``block_size`` tokens; block ``i``'s key is
``kvstore.block_keys(tokens, block_size, namespace, extra=...)[i]``, the prefix-hash spec
of ``kvstore.core.keys``. ``extra`` carries the LoRA adapter, the cache salt and multimodal
hashes, so those never share blocks with plain text. Only full blocks are stored.

*Values.* One object per block holding every layer (``vllm_blocks``): header, checksum,
then the engine's own bytes of each layer's block. A block is present or absent as a whole.

*Scheduler side.* ``get_num_new_matched_tokens`` asks the store how many leading blocks
it holds (one ``prefix_match``) and offers those beyond vLLM's local prefix-cache hit,
block-aligned and always leaving the prompt's last token to compute. The store is asked
once per request: vLLM asks again on every scheduler pass a request waits through, and
gets the first answer; a preempted request (its tokens grown by its output) is looked up
again. A request whose ``kv_transfer_params`` carry ``kvstore_stored_blocks`` (the
Conductor's own lookup) is not looked up at all, when its keys are the router's (one KV
cache group; no LoRA, cache salt or media). A block's key is hashed once, chained from
the previous one as the request's blocks fill. A load is
asynchronous (it returns ``load_async=True``: vLLM allocates the blocks and parks the
request in ``WAITING_FOR_REMOTE_KVS`` while other requests keep running) unless the
engine has nothing else to run, or the load is small (``load_inline_busy_max_bytes`` a
step): then it is inline, done by the worker before the step's forward
(``kvstore.integrations.vllm.load_mode``; ``load_inline_when_idle``).
``build_connector_meta`` hands the worker each new load (keys, destination block ids)
and, for every scheduled request, the blocks that become full and computed in this step
and that the store does not hold yet (keys, block ids, parent key).

*Worker side.* ``start_load_kv`` runs each inline load and queues each other load on a
loader thread (``kvstore.integrations.vllm.loads``): one ``get_batch_into`` into a staging buffer,
every value checked (size, header, key, checksum), the sound leading blocks copied into
the paged cache;
``get_finished`` reports the request done and ``get_block_ids_with_load_errors`` the
refused or missing blocks, which vLLM recomputes (with
``kv_load_failure_policy="recompute"``). A refused value is also removed from the store,
so the recomputed block is saved in its place.
``save_kv_layer`` copies each layer's to-save blocks into a staging buffer right after
that layer's attention has written them; ``wait_for_save`` seals the rows (headers,
checksums) and queues one ``put_batch`` on a saver thread, so the network transfer
overlaps the following steps' compute. The blocks were copied, so vLLM may free them at
once (``request_finished`` returns False); at most ``max_pending_saves`` batches are in
flight, after which a step waits for the oldest. Store errors never fail a request: a
failed lookup is a miss, a failed load is recomputed, a failed save is logged.

*Retention.* A request asks the store to keep its blocks with
``kv_transfer_params={"kvstore_retain_s": S}`` (the OpenAI server's ``kv_transfer_params``
field, or ``SamplingParams(extra_args={"kv_transfer_params": {...}})`` offline): every
full block of the request is saved with ``retain_s=S`` (docs/node.md, "Retention"). The
leading blocks the store already held at the request's first lookup are kept by one
``retain`` call then (no bytes sent), so the whole prefix is kept; blocks only vLLM's
prefix cache had are saved from the store's prefix on, as for any request. A bad
value (not a number, negative, over 7 days) is logged and ignored: the request runs
without retention rather than failing.

*Identity.* ``engine_identity`` names what decides the KV bytes beyond the cache layout:
the weights (``kvstore.integrations.identity``: the checkpoint's fingerprint, or
``weights_id``), dtypes, quantization, KV scales, config overrides, TP/PP sizes. The
default namespace includes it, so an engine on other weights (a checkpoint overwritten in
place, say) never computes the same keys; every value's header carries its hash plus the
worker's shard, so even under one explicit namespace such an engine refuses the value.

*Ranks.* Under tensor or pipeline parallelism every rank saves and loads its own shard
of each block under ``shard_key(key, "tp{t}of{T}.pp{p}of{P}")``; a block counts as stored
only when every shard is; under MLA, TP rank 0 writes the one copy every rank reads
(``kvstore.integrations.vllm.ranks``). A one-rank engine stores under the keys themselves.

*Hybrid models* (several KV cache groups: full attention plus sliding window or chunked
local attention, as vLLM's hybrid allocator groups them): each group is saved and loaded
by vLLM's rules, under keys of its own, a window group only inside its window
(``kvstore.integrations.vllm.groups``); a prefix counts as cached only when every group
holds what it needs for it. A load that fails in a hybrid model is reported per request
(vLLM recomputes the request), since vLLM takes block-level errors from one group only.
Under parallelism each group's keys are sharded per rank as above: a prefix is cached
only when every group and every shard holds what it needs.

Not supported (refused at start-up): Mamba / linear-attention and other group kinds
(``groups``), non-CPU caches (not tested here), vLLM 0.33's sleep mode.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from functools import partial
from typing import TYPE_CHECKING, Any

import torch
import vllm

from kvstore import Client
from kvstore.core.keys import namespace_root_key
from kvstore.core.retention import MAX_RETAIN_KEYS
from kvstore.integrations.identity import weights_identity
from kvstore.integrations.store_config import store_spec
from kvstore.integrations.vllm.blocks import BlockLayout
from kvstore.integrations.vllm.describe import describe_reply
from kvstore.integrations.vllm.engine_identity import (
    default_namespace,
    engine_identity,
    header_identity,
)
from kvstore.integrations.vllm.group_staging import GroupCaches, StepStaging
from kvstore.integrations.vllm.groups import (
    GroupPlan,
    null_block_id,
    plan_from_config,
    primary_block_bytes,
)
from kvstore.integrations.vllm.load_mode import EngineActivity, InlineLoads
from kvstore.integrations.vllm.loads import Staging, load_blocks
from kvstore.integrations.vllm.ranks import engine_shard_plan
from kvstore.integrations.vllm.request_state import (
    RequestState,
    request_extra,
    request_retain_s,
    request_stored_blocks,
)
from kvstore.integrations.vllm.threads import GIL_SWITCH_MS, io_executor, shorten_gil_switch
from kvstore.integrations.vllm.versions import check_vllm_version

# Before any other vLLM import (hence the E402s below): a version outside the list fails
# here, by name, not at whichever of vLLM's moved names comes first.
VLLM_VERSION = check_vllm_version(vllm.__version__)

from vllm.distributed.kv_transfer.kv_connector.v1.base import (  # noqa: E402
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    SupportsHMA,
)
from vllm.logger import init_logger  # noqa: E402
from vllm.v1.core.sched.output import SchedulerOutput  # noqa: E402

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

# Under "vllm." so the engine's log configuration (format, level) applies.
logger = init_logger("vllm.kvstore_connector")


# --- metadata: scheduler -> worker, once per step (pickled) ------------------------------

@dataclass(slots=True)
class LoadSpec:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    group: int = 0
    """Position of the KV cache group in the connector's ``GroupPlan``."""
    inline: bool = False
    """Loaded in ``start_load_kv``, before this step's forward (``load_mode``)."""


@dataclass(slots=True)
class SaveSpec:
    req_id: str
    keys: list[bytes]
    block_ids: list[int]
    parent: bytes | None
    """Key of the block before ``keys[0]`` (None if ``keys[0]`` is block 0)."""
    retain_s: float = 0.0
    """The request's ``kvstore_retain_s`` (0: none)."""
    group: int = 0
    """Position of the KV cache group in the connector's ``GroupPlan``."""


@dataclass
class KVStoreConnectorMetadata(KVConnectorMetadata):
    loads: list[LoadSpec] = field(default_factory=list)
    saves: list[SaveSpec] = field(default_factory=list)


class KVStoreConnector(KVConnectorBase_V1, SupportsHMA):
    """vLLM's external KV cache in kvstore (see the module docstring)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole,
                 kv_cache_config: KVCacheConfig) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        cfg = self._kv_transfer_config
        self._plan: GroupPlan = plan_from_config(kv_cache_config)  # UnsupportedGroup
        self._block_size = self._plan.block_size
        self._store = store_spec(lambda key: cfg.get_from_extra_config(key, None),
                                 who="kv_connector_extra_config")
        self._addr = self._store.describe()
        self._token = cfg.get_from_extra_config("kvstore_token", None)
        self._timeout = float(cfg.get_from_extra_config("timeout", 30.0))
        model = vllm_config.model_config
        weights = weights_identity(
            model.model, revision=model.revision,
            weights_id=cfg.get_from_extra_config("weights_id", None),
            cache_dirs=[vllm_config.load_config.download_dir or ""])
        self._identity = engine_identity(vllm_config, weights=weights)
        self._namespace = str(cfg.get_from_extra_config("namespace", "")
                              or default_namespace(vllm_config, kv_cache_config,
                                                   weights=weights))
        # Tensor / pipeline ranks: each saves and reads its shard (``ranks``).
        self._shards = engine_shard_plan(vllm_config)
        self._header_identity = header_identity(self._identity, shard=self._shards.own_shard)
        self._do_load = cfg.is_kv_consumer
        self._do_save = cfg.is_kv_producer
        self._max_pending_saves = int(cfg.get_from_extra_config("max_pending_saves", 4))
        self._gil_switch_s = float(cfg.get_from_extra_config("gil_switch_interval_ms",
                                                             GIL_SWITCH_MS)) / 1000
        self._inline = InlineLoads.from_config(cfg.get_from_extra_config,
                                               hybrid=self._plan.hybrid)
        self._block_bytes = primary_block_bytes(kv_cache_config, self._plan)
        logger.info("KVStoreConnector (%s): store %s, namespace %r, weights %s, load=%s "
                    "save=%s", role.name, self._addr, self._namespace, weights,
                    self._do_load, self._do_save)
        if role == KVConnectorRole.SCHEDULER:
            self._sched_client: Client | None = None
            self._reqs: dict[str, RequestState] = {}
            self._roots = [namespace_root_key(self._plan.group_namespace(self._namespace, q))
                           for q in range(len(self._plan.groups))]
            """Each group's chain root (the parent of its first block's key)."""
            self._pending_loads: list[LoadSpec] = []
            self._inline_bytes = 0
            """Bytes of the inline loads in ``_pending_loads`` (this scheduler pass)."""
            self._activity = EngineActivity()
            self.stats = {"store_lookups": 0, "lookups_reused": 0, "lookups_from_router": 0,
                          "loads_inline": 0, "loads_async": 0}
        else:
            self._layout: BlockLayout | None = None
            """The primary group's layout (all of a one-group model's layers)."""
            self._caches: list[torch.Tensor] = []
            self._groups: GroupCaches | None = None
            self._failed_loads: set[str] = set()
            self._step: StepStaging | None = None
            self._load_client = self._new_client()
            self._save_client = self._new_client()
            # Not pinned to the compute's cores, as threads the worker starts would be.
            self._loader = io_executor("kvstore-load")
            self._load_staging = Staging()  # the loader thread's alone
            # Inline loads run on vLLM's thread, maybe beside an asynchronous one.
            self._inline_client: Client | None = None
            self._inline_staging = Staging()
            shorten_gil_switch(self._gil_switch_s)  # see threads.py
            self._saver = io_executor("kvstore-save")
            self._loads: dict[str, Future] = {}
            self._load_errors: set[int] = set()
            self._saves: deque[Future] = deque()
            self._stats_lock = threading.Lock()
            self.stats = {"loaded_blocks": 0, "refused_blocks": 0, "missing_blocks": 0,
                          "saved_blocks": 0, "saves_already_stored": 0, "save_errors": 0,
                          "layers_copied_in_hook": 0,
                          "layers_copied_at_step_end": 0}

    def _new_client(self) -> Client:
        return self._store.connect(timeout=self._timeout, token=self._token)

    @classmethod
    def supports_sleep_mode(cls, kv_transfer_config: Any) -> bool:
        # vLLM 0.33 asks (0.32 never does): sleep releases and remaps the KV cache memory
        # while this worker's loader and saver threads hold views of it, and it has not
        # run here (it needs CUDA). False makes vLLM refuse enable_sleep_mode by name.
        return False

    @property
    def requires_kv_delivery(self) -> bool:
        # A cache, not a hand-off: a dropped save is a later miss.
        return False

    @property
    def namespace(self) -> str:
        return self._namespace

    # ======================================================================================
    # Scheduler side
    # ======================================================================================

    def _client(self) -> Client:
        if self._sched_client is None:
            self._sched_client = self._new_client()
        return self._sched_client

    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            keep = request_retain_s(request)
            st = RequestState(request=request, extra=request_extra(request), retain_s=keep,
                           retain_from_start=keep > 0)
            self._reqs[request.request_id] = st
        return st

    def _keys_upto(self, st: RequestState, num_blocks: int, group: int | None = None
                   ) -> list[bytes]:
        """The keys of the first ``num_blocks`` blocks of ``st``'s request in ``group``
        (a position of the plan; None: the primary group, the namespace's own keys)."""
        p = self._plan.primary if group is None else group
        return st.keys_upto(num_blocks, p, roots=self._roots, block_size=self._block_size)

    @staticmethod
    def _cacheable(request: Request) -> bool:
        # Prompt embeddings have no token ids to name them by.
        return request.prompt_embeds is None

    def _present(self, st: RequestState, full: int) -> list[list[bool]]:
        """Per group, which of the request's first ``full`` blocks the store holds in
        every shard (``groups.GroupPlan.present``, ``ranks.ShardPlan``)."""
        client = self._client()
        return self._plan.present(
            [self._keys_upto(st, full, p) for p in range(len(self._plan.groups))],
            prefix_match=partial(self._shards.stored_prefix, client.prefix_match),
            exists=partial(self._shards.stored_flags, client.exists))

    def _lookup(self, st: RequestState, full: int) -> list[list[bool]]:
        """Per group, which of the request's first ``full`` blocks the store holds: asked
        once per request (and again after a preemption grew its tokens, or after a load
        from the answer failed: vLLM asks again when the first block was refused, and the
        store, which dropped it, must answer, or the load would be retried for ever), or
        taken from the router's ``kvstore_stored_blocks`` when the request carries it and
        its keys are the router's (one group, no LoRA, salt or media: the router's keys
        have no ``extra``) and no load from it failed. A failed lookup is a miss."""
        request = st.request
        if st.present is not None and st.looked_up_tokens == request.num_tokens:
            self.stats["lookups_reused"] += 1
            return st.present
        hint = None if st.load_failed else request_stored_blocks(request)
        if hint is not None and not self._plan.hybrid and not st.extra:
            self.stats["lookups_from_router"] += 1
            present = [[True] * min(hint, full)]
        else:
            self.stats["store_lookups"] += 1
            try:
                present = self._present(st, full)
            except Exception as exc:
                logger.warning("kvstore lookup failed, treating as a miss: %s", exc)
                present = [[] for _ in self._plan.groups]
        st.present, st.looked_up_tokens = present, request.num_tokens
        return present

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int
                                   ) -> tuple[int | None, bool]:
        if not self._cacheable(request):
            return 0, False
        st = self._state(request)
        st.lookup_local_tokens = num_computed_tokens
        full = request.num_tokens // self._block_size
        if full == 0:
            return 0, False
        present = self._lookup(st, full)
        # Leading blocks every group holds: nothing to save there.
        hit = min(next((i for i, x in enumerate(p) if not x), len(p)) for p in present)
        st.store_blocks = hit
        st.saved_upto = max(st.saved_upto, hit)
        if st.retain_from_start:  # see "Retention"
            st.retain_from_start = False
            # Every group's and every shard's copy of the stored prefix (what a window
            # group dropped is simply not found).
            self._retain_held([k for p in range(len(self._plan.groups))
                               for chain in self._shards.shard_chains(self._keys_upto(st, hit, p))
                               for k in chain], st.retain_s)
        if not self._do_load:
            return 0, False
        # vLLM computes at least the prompt's last token itself; every group must hold
        # what it needs for the prefix (groups.GroupPlan.loadable_blocks).
        loadable = self._plan.loadable_blocks(
            present, local_blocks=num_computed_tokens // self._block_size,
            limit=(request.num_tokens - 1) // self._block_size)
        ext = loadable * self._block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        # An idle engine loads in the step; a busy one overlaps the load unless it is small
        # (``load_mode``). A load already planned this pass runs in this step too.
        st.load_inline = self._inline.inline(self._activity, planned=len(self._pending_loads),
                                             planned_inline_bytes=self._inline_bytes,
                                             load_bytes=self._load_bytes(ext))
        return ext, not st.load_inline

    def _load_bytes(self, tokens: int) -> int:
        """Bytes a load of ``tokens`` external tokens (whole blocks) moves on this rank."""
        return tokens // self._block_size * self._block_bytes

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks,
                                 num_external_tokens: int) -> None:
        if num_external_tokens <= 0:
            return
        st = self._reqs[request.request_id]
        first = st.lookup_local_tokens // self._block_size
        end = first + num_external_tokens // self._block_size
        all_ids = blocks.get_block_ids()
        for p, group in enumerate(self._plan.groups):
            # A window group's blocks before its window are null blocks: not loaded.
            want = self._plan.needed(p, end, first)
            keys = self._keys_upto(st, end, p)[want.start:]
            ids = list(all_ids[group.index][want.start : want.stop])
            if p == self._plan.primary:
                st.loading = ids if want.start == first else []
            if keys:
                self._pending_loads.append(LoadSpec(request.request_id, keys, ids, p,
                                                    inline=st.load_inline))
        st.load_first_block = first
        self.stats["loads_inline" if st.load_inline else "loads_async"] += 1
        if st.load_inline:
            self._inline_bytes += self._load_bytes(num_external_tokens)
        else:
            self._activity.load_started(request.request_id)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KVConnectorMetadata:
        meta = KVStoreConnectorMetadata(loads=self._pending_loads)
        self._pending_loads = []
        self._inline_bytes = 0
        self._activity.scheduled(r.req_id for r in scheduler_output.scheduled_new_reqs)
        if not self._do_save:
            return meta
        scheduled: list[tuple[str, int]] = [
            (r.req_id, r.num_computed_tokens) for r in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        scheduled += list(zip(cached.req_ids, cached.num_computed_tokens, strict=True))
        for req_id, num_computed in scheduled:
            st = self._reqs.get(req_id)
            if st is None or not self._cacheable(st.request):
                continue
            done = num_computed + scheduler_output.num_scheduled_tokens.get(req_id, 0)
            # Only blocks whose token ids are all known (async scheduling appends output
            # tokens a step late) and whose KV this step completes.
            full = min(done, len(st.request.all_token_ids)) // self._block_size
            lo = st.saved_upto
            if full <= lo:
                continue
            assert self._kv_cache_manager is not None
            all_ids = self._kv_cache_manager.get_block_ids(req_id)
            null = null_block_id(self._kv_cache_manager)
            for p, group in enumerate(self._plan.groups):
                keys = self._keys_upto(st, full, p)
                ids = all_ids[group.index]
                # A block vLLM already dropped from a window (a null block) is not saved.
                for a, b in group.saved_runs(ids, lo, full, null):
                    meta.saves.append(SaveSpec(req_id, keys[a:b], list(ids[a:b]),
                                               keys[a - 1] if a > 0 else None, st.retain_s, p))
            st.saved_upto = full
        return meta

    def _retain_held(self, keys: list[bytes], retain_s: float) -> None:
        """Retains blocks the store holds (a retained request's stored prefix)."""
        try:
            for lo in range(0, len(keys), MAX_RETAIN_KEYS):
                self._client().retain(keys[lo : lo + MAX_RETAIN_KEYS], retain_s)
        except Exception as exc:  # the cache still works, without the promise
            logger.warning("kvstore retain of %d stored blocks failed: %s", len(keys), exc)

    def update_connector_output(self, connector_output: KVConnectorOutput) -> None:
        invalid = connector_output.invalid_block_ids or set()
        failed = getattr(connector_output, "failed_recving", None) or set()
        # Every loading request, every step: under TP a rank reports its refused blocks
        # when its own load ends, maybe steps before the last rank finishes.
        for st in self._reqs.values() if invalid else ():
            for i, block_id in enumerate(st.loading):
                if block_id in invalid:
                    # vLLM recomputes from this block on: save what it recomputes.
                    first_bad = st.load_first_block + i
                    st.saved_upto = min(st.saved_upto, first_bad)
                    st.store_blocks = min(st.store_blocks, first_bad)
                    st.forget_lookup()  # a lookup vLLM makes again asks the store
                    break
        for req_id in connector_output.finished_recving or ():
            self._activity.load_done(req_id)
            if (done := self._reqs.get(req_id)) is None:
                continue
            if req_id in failed:
                # A hybrid model's failed load (every rank's, united by vLLM): vLLM
                # recomputes the request whole.
                done.saved_upto = min(done.saved_upto, done.load_first_block)
                done.store_blocks = min(done.store_blocks, done.load_first_block)
                done.forget_lookup()
            done.loading = []

    def request_finished(self, request: Request, block_ids: list[int]
                         ) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        self._activity.finished(request.request_id)
        # Saves were copied out of the paged cache in their step: free the blocks now.
        # A router that asks (``kvstore_describe``) learns the namespace and block size.
        return False, describe_reply(getattr(request, "kv_transfer_params", None),
                                     namespace=self._namespace, block_tokens=self._block_size,
                                     kv_role=str(self._kv_transfer_config.kv_role),
                                     shards=self._shards.shards)

    def request_finished_all_groups(self, request: Request, block_ids: tuple[list[int], ...]
                                    ) -> tuple[bool, dict[str, Any] | None]:
        # vLLM's call for a connector that supports the hybrid allocator (SupportsHMA).
        return self.request_finished(request, block_ids[0] if block_ids else [])

    # ======================================================================================
    # Worker side
    # ======================================================================================

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._groups = GroupCaches.register(self._plan, kv_caches,
                                            identity=self._header_identity)
        self._caches = self._groups.flat
        self._layout = self._groups.layouts[self._plan.primary]
        for group, layout in zip(self._plan.groups, self._groups.layouts, strict=True):
            logger.info("KVStoreConnector: group %d (%s), %d layers, block shape %s %s, "
                        "%d bytes per block", group.index, group.describe(),
                        layout.num_layers, layout.layer_shapes[0], layout.dtype,
                        layout.value_bytes)

    # --- loads ---------------------------------------------------------------------------

    def start_load_kv(self, forward_context: ForwardContext, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        by_request: dict[str, list[LoadSpec]] = {}
        for spec in meta.loads:
            by_request.setdefault(spec.req_id, []).append(spec)
        for req_id, specs in by_request.items():
            if specs[0].inline:  # before this step's forward, which reads the blocks
                if self._inline_client is None:
                    self._inline_client = self._new_client()
                self._load_errors.update(self._load_request(
                    specs, self._inline_client, self._inline_staging))
            else:
                self._loads[req_id] = self._loader.submit(
                    self._load_request, specs, self._load_client, self._load_staging)

    def _load_request(self, specs: list[LoadSpec], client: Client, staging: Staging
                      ) -> list[int]:
        """Loads one request's blocks, group by group, through ``client`` and ``staging``
        (the loader thread's, or the inline loads'); returns the refused block ids (a
        hybrid model: a refusal in any group is reported as the request's failure)."""
        refused: list[int] = []
        for spec in specs:
            bad = self._load(spec, client, staging)
            if bad and self._plan.hybrid:
                self._failed_loads.add(spec.req_id)
            refused += bad
        return [] if self._plan.hybrid else refused

    def _load(self, spec: LoadSpec, client: Client, staging: Staging) -> list[int]:
        """Fetches, checks and writes one group's blocks (``loads.load_blocks``); returns
        the block ids vLLM must recompute. Refused values are removed from the store, so
        the recomputed blocks are saved in their place."""
        groups = self._groups
        assert groups is not None
        out = load_blocks(client, groups.layouts[spec.group],
                          self._shards.own_keys(spec.keys), spec.block_ids,
                          partial(groups.scatter, spec.group), staging)
        if out.error is not None:
            logger.warning("kvstore load of %d blocks failed (recomputing them): %s",
                           len(spec.block_ids), out.error)
        self._count("loaded_blocks", out.loaded)
        self._count("missing_blocks", out.missing)
        self._count("refused_blocks", len(out.refused))
        for key, why in out.refused:
            logger.warning("kvstore block %s refused (%s); removing it from the store",
                           key.hex(), why)
            try:
                client.remove(key)
            except Exception as exc:
                logger.warning("could not remove refused block %s: %s", key.hex(), exc)
        return list(spec.block_ids[out.loaded:])

    def wait_for_layer_load(self, layer_name: str) -> None:
        # An asynchronous load's request runs only after get_finished reported its blocks
        # written; an inline one was written whole in start_load_kv, before the forward.
        return

    def get_finished(self, finished_req_ids: set[str]
                     ) -> tuple[set[str] | None, set[str] | None]:
        done: set[str] = set()
        for req_id, fut in list(self._loads.items()):
            if not fut.done():
                continue
            del self._loads[req_id]
            try:
                refused = fut.result()
            except Exception as exc:  # _load catches store errors; this is a bug
                logger.exception("kvstore load crashed: %s", exc)
                refused = []
                if self._plan.hybrid:
                    self._failed_loads.add(req_id)
            self._load_errors.update(refused)
            done.add(req_id)
        return None, (done or None)

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        # A hybrid model's failed load, by request: vLLM takes block ids of one group only.
        sending, recving = self.get_finished(finished_req_ids)
        recving = set(recving or ())
        failed = self._failed_loads & recving
        self._failed_loads -= failed
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=recving, failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    # --- saves ---------------------------------------------------------------------------

    def _step_saves(self) -> list[SaveSpec]:
        if not self._shards.writes or not self.has_connector_metadata():
            return []  # under MLA, TP rank 0 saves the copy every rank reads
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVStoreConnectorMetadata)
        return meta.saves

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor,
                      attn_metadata: AttentionMetadata, **kwargs: Any) -> None:
        """Copies this layer's to-save blocks to staging while they are hot in cache."""
        saves = self._step_saves()
        if not saves or self._groups is None:
            return
        if self._step is None:
            self._step = self._groups.new_step(saves)
        if self._groups.gather(self._step, layer_name):
            self.stats["layers_copied_in_hook"] += 1

    def wait_for_save(self) -> None:
        saves = self._step_saves()
        step, self._step = self._step, None
        if not saves or self._groups is None:
            return
        if step is None:
            step = self._groups.new_step(saves)
        self.stats["layers_copied_at_step_end"] += self._groups.gather_rest(step)
        # This rank's shard of each group's blocks (a one-rank engine: the keys themselves).
        sealed = self._groups.seal_step(step, saves, self._shards)
        while len(self._saves) >= self._max_pending_saves:
            self._saves.popleft().result()
        while self._saves and self._saves[0].done():
            self._saves.popleft()
        self._saves.append(self._saver.submit(self._put, sealed.keys, sealed.rows,
                                              sealed.parents, sealed.retain_s))

    def _put(self, keys: list[bytes], staging: Sequence[torch.Tensor],
             parents: list[bytes | None], keep: list[float]) -> None:
        # One put_batch per retention asked (one call when no request asked for any).
        for retain in sorted(set(keep)):
            rows = [i for i, r in enumerate(keep) if r == retain]
            try:
                stored = self._save_client.put_batch(
                    [keys[i] for i in rows], [staging[i] for i in rows],
                    parents=[parents[i] for i in rows], retain_s=retain or None)
                self._count("saved_blocks", sum(stored))
                self._count("saves_already_stored", len(stored) - sum(stored))
            except Exception as exc:
                self._count("save_errors", 1)
                logger.warning("kvstore save of %d blocks failed: %s", len(rows), exc)

    def _count(self, name: str, n: int) -> None:
        with self._stats_lock:
            self.stats[name] += n

    def shutdown(self) -> None:
        if self._role != KVConnectorRole.WORKER:
            logger.info("KVStoreConnector scheduler stats: %s", self.stats)
            if self._sched_client is not None:
                self._sched_client.close()
            return
        deadline = time.monotonic() + self._timeout
        for fut in list(self._saves):
            try:
                fut.result(timeout=max(0.0, deadline - time.monotonic()))
            except Exception as exc:
                logger.warning("kvstore save still pending at shutdown: %s", exc)
        self._loader.shutdown(wait=False, cancel_futures=True)
        self._saver.shutdown(wait=False, cancel_futures=True)
        logger.info("KVStoreConnector worker stats: %s", self.stats)
        self._load_client.close()
        self._save_client.close()
        if self._inline_client is not None:
            self._inline_client.close()
