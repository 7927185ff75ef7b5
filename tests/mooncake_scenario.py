"""One Mooncake 0.3.13 scenario, run unchanged against the real wheel's
``mooncake.store.MooncakeDistributedStore`` (tests/engines/test_mooncake_wheel.py) and
against kvstore's class (there and in tests/test_mooncake_ranges.py): the calls and the
results both must give. Only the store class, ``ReplicateConfig`` / ``SoftPinAction`` and
the setup dict differ between the two runs. Steps: ``open_store``, then
``soft_pin_steps``, ``basic_steps``, ``tensor_steps`` and ``ranged_steps`` (which closes the
store).
"""

from __future__ import annotations

import ctypes
from typing import Any

# Every public method of the 0.3.13.post1 wheel's MooncakeDistributedStore (dir() of the
# class; tests/engines/test_mooncake_wheel.py checks the list against the wheel itself).
WHEEL_METHODS = (
    "_get_pyclient_capsule", "alloc_from_mem_pool", "allocate_and_mount_segment",
    "batch_get_buffer", "batch_get_into", "batch_get_into_multi_buffer_ranges",
    "batch_get_into_multi_buffers", "batch_get_replica_desc", "batch_get_session_end",
    "batch_get_session_start", "batch_get_tensor", "batch_get_tensor_into",
    "batch_get_tensor_into_cuda", "batch_get_tensor_with_parallelism",
    "batch_get_tensor_with_parallelism_into", "batch_get_tensor_with_tp",
    "batch_get_tensor_with_tp_into", "batch_is_exist", "batch_pub_tensor",
    "batch_pub_tensor_with_tp", "batch_put_from", "batch_put_from_multi_buffer_ranges",
    "batch_put_from_multi_buffers", "batch_put_session_end", "batch_put_session_revoke",
    "batch_put_session_start", "batch_put_tensor", "batch_put_tensor_from",
    "batch_put_tensor_with_parallelism", "batch_put_tensor_with_parallelism_from",
    "batch_put_tensor_with_tp", "batch_put_tensor_with_tp_from", "batch_remove",
    "batch_replica_clear", "batch_upsert_from", "batch_upsert_pub_tensor",
    "batch_upsert_tensor", "batch_upsert_tensor_from", "batch_upsert_tensor_with_parallelism",
    "batch_upsert_tensor_with_parallelism_from", "close", "create_copy_task",
    "create_move_task", "get", "get_batch", "get_buffer", "get_hostname", "get_into",
    "get_into_ranges", "get_offload_rpc_read_count", "get_replica_desc", "get_size",
    "get_tensor", "get_tensor_into", "get_tensor_into_cuda", "get_tensor_with_parallelism",
    "get_tensor_with_parallelism_into", "get_tensor_with_tp", "get_tensor_with_tp_into",
    "health_check", "init_all", "is_exist", "load_tensor_from_safetensor", "mount_segment",
    "pub_tensor", "pub_tensor_with_tp", "put", "put_batch", "put_from",
    "put_from_with_metadata", "put_parts", "put_tensor", "put_tensor_from",
    "put_tensor_with_parallelism", "put_tensor_with_parallelism_from", "put_tensor_with_tp",
    "put_tensor_with_tp_from", "query_task", "register_buffer", "remove", "remove_all",
    "remove_by_regex", "save_tensor_to_safetensor", "setup", "setup_dummy",
    "unmount_and_free_segment", "unmount_local_disk_segment", "unmount_segment",
    "unregister_buffer", "upsert", "upsert_batch", "upsert_from", "upsert_parts",
    "upsert_pub_tensor", "upsert_tensor", "upsert_tensor_from",
    "upsert_tensor_with_parallelism", "upsert_tensor_with_parallelism_from",
)

# What the 0.3.13.post1 wheel answers to each step (checked against a real
# mooncake_master in tests/engines/test_mooncake_wheel.py); kvstore must answer the same.
EXPECTED: dict[str, Any] = {
    "setup_bad_size": -600,
    "setup_missing_hostname": -600,
    "setup": 0,
    "with_soft_pin": "AttributeError",
    "ttl_without_enable": -600,
    "ttl_enable": 0,
    "ttl_enable_default": 0,
    "ttl_too_long": -600,
    "ttl_disable": 0,
    "ttl_types": ["NoneType None", "int 0", "int 7", "int 1", "int 5", "TypeError",
                  "TypeError", "TypeError", "TypeError", "TypeError", "TypeError"],
    "dfs_replica": -1601,
    "nof_replica": -600,
    "health": 0,
    "register": 0,
    "puts": [0, 0],
    "ranges": [[[4, 3], [5], [-704]]],
    "ranges_bytes": [b"\x01\x02\x03\x04", b"\x1e\x1f\x20", b"\xfd\xfc\xfb\xfa\xf9"],
    "ranges_src_overflow": [[[-600]]],
    "ranges_dst_overflow": [[[-600]]],
    "ranges_fragment_shape": [[[-600, -600]]],
    "ranges_top_shape": [[[-600]], [[-600]]],
    "ranges_unregistered": [[[-600]]],
    "put_start": [0, 0, -705],
    "put_start_again": [-600],
    "put_start_twice_in_one_call": [0, -705],
    "put_start_length_mismatch": [-600, -600],
    "put_start_zero_size": [-600],
    "put_start_bad_config": [-600],
    "put_ranges": [300, 200],
    "visible_before_end": [0, 0],
    "put_range_overflow": [-600],
    "put_range_no_session": [-600],
    "put_end": [0],
    "put_revoke": [0],
    "put_end_after_revoke": [-600],
    "put_revoke_unknown": [-600],
    "put_end_unknown": [-600],
    "session_value_ok": True,
    "visible_after_end": [1, 0],
    "get_start": [0, -704],
    "get_ranges": [30],
    "get_ranges_bytes_ok": True,
    "get_range_overflow": [-600],
    "get_range_no_session": [-600],
    "get_end": 0,
    "get_end_unknown": 0,
    "get_range_after_end": [-600],
    "close": 0,
    "health_closed": 1,
    # basic_steps
    "b_put": 0, "b_put_again": 0, "b_get": b"hello", "b_get_missing": b"", "b_put_empty": -600,
    "b_put_batch": 0, "b_put_batch_mismatch": -600, "b_get_batch": [b"bb", b"", b"ccc"],
    "b_is_exist": [1, 0], "b_batch_is_exist": [1, 0, 1], "b_get_size": [5, -704],
    "b_put_parts": 0, "b_get_parts": b"abcd", "b_get_buffer": (b"hello", 5),
    "b_get_buffer_missing": None, "b_put_from_unregistered": 0, "b_register": 0,
    "b_put_from": 0, "b_batch_put_from": [0, 0], "b_get_into": 4,
    "b_get_into_bytes": b"\t\x08\x07\x06", "b_get_into_small": -600, "b_get_into_missing": -704,
    "b_batch_get_into": [2, -704, 3], "b_multi_put": [0], "b_multi_get": [-800],
    "b_multi_bytes": b"\x00\x00\x00\x00", "b_unregister": [0, -600], "b_remove_missing": -704,
    "u_upsert": 0, "u_get": b"HELLO!", "u_upsert_new": 0, "u_upsert_empty": -600,
    "u_get_after_empty": b"HELLO!", "u_upsert_batch": 0, "u_get_batch": [b"1", b"22"],
    "u_upsert_parts": 0, "u_upsert_from": 0, "u_batch_upsert_from": [0, 0],
    "u_values": [b"xyz", b"\x08\x07", b"\t", b"\t\x08\x07"],
    # tensor_steps (the same bytes: the stored object's SHA-256 is the wheel's)
    "t_put": 0,
    "t_raw_sha256": "342f06b39df0eb82c0f52797eb254f8fa8e64502a4d3ea0f972452ca0e2ba91d",
    "t_raw_len": 352,
    "t_get": ("torch.float32", (3, 4), [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0],
                                        [8.0, 9.0, 10.0, 11.0]]),
    "t_get_missing": None,
    "t_get_not_a_tensor": (0, None),
    "t_batch_put": [0, 0, 0],
    "t_batch_get": [("torch.bfloat16", (1, 2), [[1.5, -2.0]]), None,
                    ("torch.bool", (3,), [1.0, 0.0, 1.0]), ("torch.int64", (1,), [7.0])],
    "t_noncontiguous": (0, ("torch.float32", (4, 3), [[0.0, 4.0, 8.0], [1.0, 5.0, 9.0],
                                                     [2.0, 6.0, 10.0], [3.0, 7.0, 11.0]])),
    "t_register": 0,
    "t_get_into": (("torch.float32", (3, 4), [[0.0, 1.0, 2.0, 3.0], [4.0, 5.0, 6.0, 7.0],
                                             [8.0, 9.0, 10.0, 11.0]]), 304),
    "t_batch_get_into": [("torch.bfloat16", (1, 2), [[1.5, -2.0]]), None],
    "t_unregister": 0,
}

# Where kvstore answers otherwise on purpose (docs/engines/mooncake.md, "What differs from
# Mooncake"): a range outside registered memory is refused (-600) instead of read through a
# raw pointer; multi-buffer gets accept buffers larger in total than the value and report the
# bytes read, where the wheel fails the transfer (-800).
KVSTORE_DIFFERS: dict[str, Any] = {
    "b_put_from_unregistered": -600,
    "b_multi_get": [4],
    "b_multi_bytes": b"\t\x08\x07\x06",
}


def expected(got: dict[str, Any], *, kvstore: bool) -> dict[str, Any]:
    """What ``got`` must be: the wheel's results, with kvstore's documented differences."""
    want = {**EXPECTED, **(KVSTORE_DIFFERS if kvstore else {})}
    return {k: want[k] for k in got}


def open_store(store_cls: type, setup: dict[str, str], got: dict[str, Any]) -> Any:
    """A ``store_cls()`` after the setup steps (two refused dicts, then ``setup``)."""
    s = store_cls()
    got["setup_bad_size"] = s.setup({**setup, "global_segment_size": "4XB"})
    got["setup_missing_hostname"] = s.setup({k: v for k, v in setup.items()
                                             if k != "local_hostname"})
    got["setup"] = s.setup(setup)
    return s




def soft_pin_steps(s: Any, config_cls: type, soft_pin: Any, k: str,
                   got: dict[str, Any]) -> None:
    """0.3.13's ReplicateConfig soft-pin fields, as puts (keys under ``k``)."""
    c = config_cls()
    try:
        c.with_soft_pin = True
        got["with_soft_pin"] = "accepted"
    except AttributeError:
        got["with_soft_pin"] = "AttributeError"
    c.soft_pin_ttl_ms = 1000
    got["ttl_without_enable"] = s.put(k + "a", b"x" * 100, c)
    c.soft_pin_action = soft_pin.ENABLE
    got["ttl_enable"] = s.put(k + "a", b"x" * 100, c)
    c.soft_pin_ttl_ms = None
    got["ttl_enable_default"] = s.put(k + "a2", b"x" * 100, c)
    c.soft_pin_ttl_ms = 25 * 3600 * 1000
    got["ttl_too_long"] = s.put(k + "b", b"x" * 100, c)
    d = config_cls()
    d.soft_pin_action = soft_pin.DISABLE
    got["ttl_disable"] = s.put(k + "c", b"x" * 100, d)
    # What the setter does with each type (the wheel's is pybind11's Optional[int]): the value
    # read back and its type, or the error; a refused value leaves the field as it was.
    types = []
    for value in (None, 0, 7, True, _Index(), 1.0, 1.5, "5", b"5", -1, 2**64):
        t = config_cls()
        t.soft_pin_ttl_ms = 3
        try:
            t.soft_pin_ttl_ms = value
        except TypeError:
            types.append("TypeError" if t.soft_pin_ttl_ms == 3 else "TypeError, changed")
        else:
            types.append(f"{type(t.soft_pin_ttl_ms).__name__} {t.soft_pin_ttl_ms!r}")
    got["ttl_types"] = types


class _Index:
    """An integer by ``__index__`` only (as numpy's integers are)."""

    def __index__(self) -> int:
        return 5


def basic_steps(s: Any, k: str, got: dict[str, Any]) -> None:
    """The copying and zero-copy calls engines used before 0.3.13 (keys under ``k``)."""
    a, b, missing = k + "a", k + "b", k + "missing"
    got["b_put"] = s.put(a, b"hello")
    got["b_put_again"] = s.put(a, b"other")
    got["b_get"] = s.get(a)
    got["b_get_missing"] = s.get(missing)
    got["b_put_empty"] = s.put(k + "empty", b"")
    got["b_put_batch"] = s.put_batch([b, k + "c"], [b"bb", b"ccc"])
    got["b_put_batch_mismatch"] = s.put_batch([k + "d"], [b"1", b"2"])
    got["b_get_batch"] = s.get_batch([b, missing, k + "c"])
    got["b_is_exist"] = [s.is_exist(a), s.is_exist(missing)]
    got["b_batch_is_exist"] = s.batch_is_exist([a, missing, b])
    got["b_get_size"] = [s.get_size(a), s.get_size(missing)]
    got["b_put_parts"] = s.put_parts(k + "parts", b"ab", memoryview(b"cd"))
    got["b_get_parts"] = s.get(k + "parts")
    h = s.get_buffer(a)
    got["b_get_buffer"] = (bytes(memoryview(h)), h.size())
    got["b_get_buffer_missing"] = s.get_buffer(missing)
    buf = (ctypes.c_ubyte * 64)()
    bp = ctypes.addressof(buf)
    got["b_put_from_unregistered"] = s.put_from(k + "u", bp, 4)
    got["b_register"] = s.register_buffer(bp, 64)
    buf[0:4] = (ctypes.c_ubyte * 4)(9, 8, 7, 6)
    got["b_put_from"] = s.put_from(k + "pf", bp, 4)
    got["b_batch_put_from"] = s.batch_put_from([k + "pf1", k + "pf2"], [bp, bp + 1], [2, 3])
    got["b_get_into"] = s.get_into(k + "pf", bp + 10, 8)
    got["b_get_into_bytes"] = bytes(buf[10:14])
    got["b_get_into_small"] = s.get_into(a, bp + 20, 2)
    got["b_get_into_missing"] = s.get_into(missing, bp + 20, 8)
    got["b_batch_get_into"] = s.batch_get_into([k + "pf1", missing, k + "pf2"],
                                               [bp + 30, bp + 40, bp + 50], [8, 8, 8])
    got["b_multi_put"] = s.batch_put_from_multi_buffers([k + "m"], [[bp, bp + 2]], [[2, 2]])
    got["b_multi_get"] = s.batch_get_into_multi_buffers([k + "m"], [[bp + 40, bp + 60]],
                                                        [[3, 3]])
    got["b_multi_bytes"] = bytes(buf[40:43]) + bytes(buf[60:61])
    got["u_upsert"] = s.upsert(a, b"HELLO!")
    got["u_get"] = s.get(a)
    got["u_upsert_new"] = s.upsert(k + "un", b"n")
    got["u_upsert_empty"] = s.upsert(a, b"")
    got["u_get_after_empty"] = s.get(a)
    got["u_upsert_batch"] = s.upsert_batch([a, b], [b"1", b"22"])
    got["u_get_batch"] = s.get_batch([a, b])
    got["u_upsert_parts"] = s.upsert_parts(b, b"x", b"yz")
    got["u_upsert_from"] = s.upsert_from(k + "pf", bp + 1, 2)
    got["u_batch_upsert_from"] = s.batch_upsert_from([k + "pf1", k + "new"], [bp, bp], [1, 3])
    got["u_values"] = s.get_batch([b, k + "pf", k + "pf1", k + "new"])
    got["b_unregister"] = [s.unregister_buffer(bp), s.unregister_buffer(bp)]
    got["b_remove_missing"] = s.remove(missing)
    del buf


def tensor_steps(s: Any, k: str, got: dict[str, Any]) -> None:
    """Whole CPU tensors in Mooncake's object format (keys under ``k``); needs torch."""
    import hashlib

    import torch

    def seen(t: Any) -> Any:
        return None if t is None else (str(t.dtype), tuple(t.shape), t.float().tolist())

    f32 = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    got["t_put"] = s.put_tensor(k + "f32", f32)
    got["t_raw_sha256"] = hashlib.sha256(s.get(k + "f32")).hexdigest()
    got["t_raw_len"] = len(s.get(k + "f32"))
    got["t_get"] = seen(s.get_tensor(k + "f32"))
    got["t_get_missing"] = s.get_tensor(k + "missing")
    got["t_get_not_a_tensor"] = (s.put(k + "plain", b"x" * 400), s.get_tensor(k + "plain"))
    bf = torch.tensor([[1.5, -2.0]], dtype=torch.bfloat16)
    flags = torch.tensor([True, False, True])
    scalar = torch.tensor(7, dtype=torch.int64)
    got["t_batch_put"] = s.batch_put_tensor([k + "bf", k + "flags", k + "scalar"],
                                            [bf, flags, scalar])
    got["t_batch_get"] = [seen(t) for t in s.batch_get_tensor(
        [k + "bf", k + "missing", k + "flags", k + "scalar"])]
    got["t_noncontiguous"] = (s.put_tensor(k + "nc", f32.t()), seen(s.get_tensor(k + "nc")))
    buf = torch.zeros(4096, dtype=torch.uint8)
    bp = buf.data_ptr()
    got["t_register"] = s.register_buffer(bp, 4096)
    t = s.get_tensor_into(k + "f32", bp, 4096)
    got["t_get_into"] = (seen(t), None if t is None else t.data_ptr() - bp)
    many = s.batch_get_tensor_into([k + "bf", k + "missing"], [bp + 1024, bp + 2048],
                                   [1024, 1024])
    got["t_batch_get_into"] = [seen(x) for x in many]
    got["t_unregister"] = s.unregister_buffer(bp)
    del buf


def ranged_steps(s: Any, config_cls: type, k: str, got: dict[str, Any]) -> None:
    """Replica kinds, get_into_ranges, put sessions and get sessions (keys under ``k``)."""
    dfs = config_cls()
    dfs.dfs_replica_num = 1
    got["dfs_replica"] = s.put(k + "dfs", b"x" * 10, dfs)
    nof = config_cls()
    nof.nof_replica_num = 1
    got["nof_replica"] = s.put(k + "nof", b"x" * 10, nof)
    buf = (ctypes.c_ubyte * 4096)()
    bp = ctypes.addressof(buf)
    got["register"] = s.register_buffer(bp, 4096)
    data = bytes(range(256)) * 4
    k1, k2, missing = k + "k1", k + "k2", k + "missing"
    got["puts"] = [s.put(k1, data), s.put(k2, data[::-1])]
    got["ranges"] = s.get_into_ranges([bp], [[k1, k2, missing]], [[[0, 16], [100], [200]]],
                                      [[[1, 30], [2], [0]]], [[[4, 3], [5], [4]]])
    got["ranges_bytes"] = [bytes(buf[0:4]), bytes(buf[16:19]), bytes(buf[100:105])]
    got["ranges_src_overflow"] = s.get_into_ranges([bp], [[k1]], [[[0]]], [[[1020]]], [[[10]]])
    got["ranges_dst_overflow"] = s.get_into_ranges([bp], [[k1]], [[[4090]]], [[[0]]], [[[10]]])
    got["ranges_fragment_shape"] = s.get_into_ranges([bp], [[k1]], [[[0, 1]]], [[[0]]],
                                                     [[[10]]])
    got["ranges_top_shape"] = s.get_into_ranges([bp, bp], [[k1]], [[[0]]], [[[0]]], [[[10]]])
    other = (ctypes.c_ubyte * 64)()
    got["ranges_unregistered"] = s.get_into_ranges([ctypes.addressof(other)], [[k1]], [[[0]]],
                                                   [[[0]]], [[[10]]])
    # put session: reserve, write layer by layer, publish one and drop the other
    s1, s2 = k + "s1", k + "s2"
    got["put_start"] = s.batch_put_session_start([s1, s2, k1], [300, 200, 1024])
    got["put_start_again"] = s.batch_put_session_start([s1], [300])
    got["put_start_twice_in_one_call"] = s.batch_put_session_start([k + "q", k + "q"], [10, 10])
    got["put_start_length_mismatch"] = s.batch_put_session_start([k + "q2", k + "q3"], [10])
    got["put_start_zero_size"] = s.batch_put_session_start([k + "z"], [0])
    bad = config_cls()
    bad.soft_pin_ttl_ms = 5
    got["put_start_bad_config"] = s.batch_put_session_start([k + "y"], [10], bad)
    for i in range(300):
        buf[i] = i % 251
    got["put_ranges"] = s.batch_put_from_multi_buffer_ranges(
        [s1, s2], [[bp, bp + 100], [bp]], [[100, 200], [200]], [[0, 100], [0]])
    got["visible_before_end"] = s.batch_is_exist([s1, s2])
    got["put_range_overflow"] = s.batch_put_from_multi_buffer_ranges([s1], [[bp]], [[10]],
                                                                     [[295]])
    got["put_range_no_session"] = s.batch_put_from_multi_buffer_ranges([k + "zz"], [[bp]],
                                                                       [[10]], [[0]])
    got["put_end"] = s.batch_put_session_end([s1])
    got["put_revoke"] = s.batch_put_session_revoke([s2])
    got["put_end_after_revoke"] = s.batch_put_session_end([s2])
    got["put_revoke_unknown"] = s.batch_put_session_revoke([k + "nope"])
    got["put_end_unknown"] = s.batch_put_session_end([k + "nope"])
    got["session_value_ok"] = s.get(s1) == bytes(i % 251 for i in range(300))
    got["visible_after_end"] = s.batch_is_exist([s1, s2])
    # get session: resolve once, read ranges layer by layer, end
    got["get_start"] = s.batch_get_session_start([s1, missing])
    got["get_ranges"] = s.batch_get_into_multi_buffer_ranges(
        [s1], [[bp + 1000, bp + 2000]], [[10, 20]], [[0, 50]])
    got["get_ranges_bytes_ok"] = (bytes(buf[1000:1010]) == bytes(range(10))
                                  and bytes(buf[2000:2020]) == bytes(range(50, 70)))
    got["get_range_overflow"] = s.batch_get_into_multi_buffer_ranges([s1], [[bp]], [[10]],
                                                                     [[295]])
    got["get_range_no_session"] = s.batch_get_into_multi_buffer_ranges([k2], [[bp]], [[10]],
                                                                       [[0]])
    got["get_end"] = s.batch_get_session_end([s1])
    got["get_end_unknown"] = s.batch_get_session_end([k + "nope"])
    got["get_range_after_end"] = s.batch_get_into_multi_buffer_ranges([s1], [[bp]], [[10]],
                                                                      [[0]])
    got["health"] = s.health_check()
    got["close"] = s.close()
    got["health_closed"] = s.health_check()
    del buf, other  # alive until the store is closed
