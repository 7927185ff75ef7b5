"""The methods of Mooncake 0.3.13's ``MooncakeDistributedStore`` that kvstore does not
provide, each with the reason. ``install`` adds them to the class so that a call fails at
once with ``NotImplementedError`` naming the method and the reason (not an AttributeError,
and never a silent success); docs/engines/mooncake.md's table lists the same reasons.
"""

from __future__ import annotations

from typing import Any, NoReturn

_TENSOR = ("only whole CPU tensors are provided (put_tensor, get_tensor, get_tensor_into "
           "and their batch forms); the sharded (tp/parallelism), pub, upsert, from-buffer "
           "and safetensors variants are not")
_SEGMENT = ("a kvstore client lends no memory or disk to the pool: nodes own their tiers "
            "(kvstore serve --dram-bytes/--ssd-path)")
_REPLICAS = ("replica placement, copies and moves are the cluster's (rendezvous placement, "
             "repair), not a client's to direct")

UNSUPPORTED: dict[str, str] = {
    **{name: _TENSOR for name in (
        "put_tensor_from",
        "batch_put_tensor_from", "pub_tensor", "batch_pub_tensor", "upsert_tensor",
        "batch_upsert_tensor", "upsert_tensor_from", "batch_upsert_tensor_from",
        "upsert_pub_tensor", "batch_upsert_pub_tensor", "get_tensor_with_tp",
        "batch_get_tensor_with_tp", "get_tensor_with_tp_into", "batch_get_tensor_with_tp_into",
        "put_tensor_with_tp", "batch_put_tensor_with_tp", "put_tensor_with_tp_from",
        "batch_put_tensor_with_tp_from", "pub_tensor_with_tp", "batch_pub_tensor_with_tp",
        "get_tensor_with_parallelism", "batch_get_tensor_with_parallelism",
        "get_tensor_with_parallelism_into", "batch_get_tensor_with_parallelism_into",
        "put_tensor_with_parallelism", "batch_put_tensor_with_parallelism",
        "put_tensor_with_parallelism_from", "batch_put_tensor_with_parallelism_from",
        "upsert_tensor_with_parallelism", "upsert_tensor_with_parallelism_from",
        "batch_upsert_tensor_with_parallelism", "batch_upsert_tensor_with_parallelism_from",
        "save_tensor_to_safetensor", "load_tensor_from_safetensor")},
    **{name: _SEGMENT for name in (
        "mount_segment", "unmount_segment", "allocate_and_mount_segment",
        "unmount_and_free_segment", "unmount_local_disk_segment", "init_all",
        "alloc_from_mem_pool")},
    **{name: _REPLICAS for name in (
        "get_replica_desc", "batch_get_replica_desc", "batch_replica_clear",
        "create_copy_task", "create_move_task", "query_task")},
    "setup_dummy": ("Mooncake's dummy client shares a local real client's memory over IPC; "
                    "kvstore's shared-memory transport does that for any client on the "
                    "node's host (setup with protocol 'tcp')"),
    "get_offload_rpc_read_count": ("a counter of Mooncake's SSD-offload RPC path; kvstore's "
                                   "SSD tier is counted in the node's metrics"),
    "put_from_with_metadata": ("kvstore values have no separate metadata part; put the "
                               "metadata and data as one value with put_parts or "
                               "batch_put_from_multi_buffers"),
    "remove_by_regex": ("kvstore stores hashes of Mooncake keys and cannot list or match "
                        "them; remove keys by name (batch_remove), or remove_all for the "
                        "keys this instance wrote"),
    "_get_pyclient_capsule": "an internal handle of Mooncake's C++ client",
}


def _refuse(name: str, reason: str) -> Any:
    def method(self: object, *args: object, **kwargs: object) -> NoReturn:
        raise NotImplementedError(f"MooncakeDistributedStore.{name} is not supported by "
                                  f"kvstore: {reason}")

    method.__name__ = name
    method.__doc__ = f"Not supported by kvstore: {reason}."
    return method


def install(cls: type) -> None:
    """Adds a refusing method to ``cls`` for every unsupported name it does not define."""
    for name, reason in UNSUPPORTED.items():
        if name not in cls.__dict__:
            setattr(cls, name, _refuse(name, reason))
