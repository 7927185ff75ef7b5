"""``MooncakeDistributedStore.setup(dict)``: Mooncake 0.3.13's one-dict configuration,
read as Mooncake's ``RealClient::setup_internal(ConfigDict)`` reads it.

Every value is taken as ``str(value)`` (pybind11 does the same), so ``"4GB"``, ``4096`` and
``"1.5 GB"`` are all sizes. Sizes use Mooncake's units, not kvstore's: ``K``/``KB``,
``M``/``MB``, ``G``/``GB``, ``T``/``TB`` are powers of 1024 (``"4GB"`` is 4 GiB),
case-insensitive, ``B`` or no unit is bytes, ``"infinite"`` the largest. A missing
``local_hostname`` or ``metadata_server``, a size or port that does not parse, or a size
outside Mooncake's bounds is a clear ``InvalidArgument`` (``setup`` answers -600 and logs it).
Keys Mooncake does not know are ignored with a warning, as Mooncake ignores them silently;
kvstore's own ``setup`` keywords (``replicas``, ``write_quorum``, ``transport``, ``token``,
``timeout``) may be given in the dict too.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

from kvstore.core.errors import InvalidArgument

log = logging.getLogger(__name__)

_SIZE_UNITS = {"": 1, "B": 1, "K": 1 << 10, "KB": 1 << 10, "M": 1 << 20, "MB": 1 << 20,
               "G": 1 << 30, "GB": 1 << 30, "T": 1 << 40, "TB": 1 << 40}
_SIZE = re.compile(r"^([0-9]*\.?[0-9]+(?:[eE][+-]?[0-9]+)?)\s*([A-Za-z]*)$")
MAX_U64 = (1 << 64) - 1
MIN_SEGMENT_SIZE = 1024  # Mooncake: a segment size is 0 or at least 1 KB
MAX_SEGMENT_SIZE = 1 << 40  # and the local buffer at most 1 TB
DEFAULT_SEGMENT = 16 * 1024 * 1024
DEFAULT_MASTER = "127.0.0.1:50051"
DEFAULT_CLIENT_HTTP_PORT = 9300

_MOONCAKE_KEYS = frozenset({
    "local_hostname", "metadata_server", "global_segment_size", "local_buffer_size",
    "protocol", "rdma_devices", "master_server_addr", "ipc_socket_path",
    "enable_ssd_offload", "ssd_offload_path", "tenant_id", "enable_client_http_server",
    "client_http_port"})
_KVSTORE_KEYS = frozenset({"replicas", "write_quorum", "transport", "token", "timeout"})
# The names the same settings go by in the configs written for Mooncake's older positional
# setup (Mooncake's own mooncake_config.py, LMCache's and vLLM's Mooncake store connectors),
# which those callers now pass in the dict as they are. The 0.3.13 wheel ignores them and
# falls back to its default master (127.0.0.1:50051): a store that is set up against no
# kvstore at all and whose every put fails while the caller, which does not check setup's
# code, carries on (LMCache 0.5.6 stored nothing that way). kvstore reads them; the
# 0.3.13 name wins when both are given.
ALIASES = {"master_server_address": "master_server_addr", "device_name": "rdma_devices"}


def parse_mooncake_size(text: object) -> int:
    """Bytes from a Mooncake size (``4096``, ``"64MB"``, ``"1.5 GB"``; units are binary).
    ValueError with the accepted forms for anything else."""
    s = str(text).strip()
    if s == "infinite":
        return MAX_U64
    m = _SIZE.match(s)
    unit = m.group(2).upper() if m else None
    if m is None or unit not in _SIZE_UNITS:
        raise ValueError(f"not a Mooncake size: {text!r} (use bytes or a number with "
                         f"K/KB, M/MB, G/GB, T/TB, powers of 1024: e.g. 4096, 512MB, 4GB)")
    return int(float(m.group(1)) * _SIZE_UNITS[unit])


def _parse_bool(key: str, text: str, default: bool) -> bool:
    v = text.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    log.warning("setup: %s=%r is not a boolean; using %s (as Mooncake does)", key, text,
                default)
    return default


def setup_arguments(config: Mapping[Any, Any]) -> dict[str, Any]:
    """The keyword arguments of the positional ``setup`` for a Mooncake config dict.
    InvalidArgument (its message names the key) for a form Mooncake refuses too."""
    if not isinstance(config, Mapping):
        raise InvalidArgument(f"setup(config) takes a dict, got {type(config).__name__}")
    raw = {str(k): v for k, v in config.items()}
    text = {k: str(v) for k, v in raw.items() if k in _MOONCAKE_KEYS}
    for alias, name in ALIASES.items():
        if alias in raw and name not in text:
            text[name] = str(raw[alias])
    unknown = sorted(set(raw) - _MOONCAKE_KEYS - _KVSTORE_KEYS - set(ALIASES))
    if unknown:
        log.warning("setup: ignoring config keys Mooncake does not know: %s",
                    ", ".join(unknown))
    for required in ("local_hostname", "metadata_server"):
        if not text.get(required):
            raise InvalidArgument(f"setup: missing required config key {required!r}")
    sizes: dict[str, int] = {}
    for key in ("global_segment_size", "local_buffer_size"):
        try:
            sizes[key] = parse_mooncake_size(text[key]) if key in text else DEFAULT_SEGMENT
        except ValueError as exc:
            raise InvalidArgument(f"setup: {key}: {exc}") from None
        if 0 < sizes[key] < MIN_SEGMENT_SIZE:
            raise InvalidArgument(f"setup: {key}={sizes[key]} must be 0 or at least "
                                  f"{MIN_SEGMENT_SIZE} bytes")
    if sizes["local_buffer_size"] > MAX_SEGMENT_SIZE:
        raise InvalidArgument(f"setup: local_buffer_size={sizes['local_buffer_size']} is "
                              f"above {MAX_SEGMENT_SIZE} bytes (1 TB)")
    port_text = text.get("client_http_port", str(DEFAULT_CLIENT_HTTP_PORT)).strip()
    if not re.fullmatch(r"[+-]?[0-9]+", port_text):
        raise InvalidArgument(f"setup: client_http_port={port_text!r} is not an integer")
    args: dict[str, Any] = {
        "local_hostname": text["local_hostname"],
        "metadata_server": text["metadata_server"],
        "global_segment_size": sizes["global_segment_size"],
        "local_buffer_size": sizes["local_buffer_size"],
        "protocol": text.get("protocol", "tcp"),
        "rdma_devices": text.get("rdma_devices", ""),
        "master_server_addr": text.get("master_server_addr", DEFAULT_MASTER),
        "enable_ssd_offload": _parse_bool("enable_ssd_offload",
                                          text.get("enable_ssd_offload", "false"), False),
        "ssd_offload_path": text.get("ssd_offload_path", ""),
        "tenant_id": text.get("tenant_id", "default"),
        "enable_client_http_server": _parse_bool(
            "enable_client_http_server", text.get("enable_client_http_server", "false"),
            False),
        "client_http_port": int(port_text),
    }
    if text.get("ipc_socket_path"):
        log.warning("setup: ipc_socket_path is ignored (kvstore's shared-memory transport "
                    "needs no socket)")
    args.update({k: raw[k] for k in _KVSTORE_KEYS if k in raw})
    return args
