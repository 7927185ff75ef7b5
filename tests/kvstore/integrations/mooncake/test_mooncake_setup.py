"""``setup(dict)``'s reading of a Mooncake 0.3.13 config dict (``mooncake_setup``), exactly,
and the dict form against a real node."""

from __future__ import annotations

import logging
from collections.abc import Iterator

import pytest
from conftest import free_port, start_node

from kvstore.core.errors import InvalidArgument
from kvstore.integrations.mooncake.setup import (
    MAX_U64,
    parse_mooncake_size,
    setup_arguments,
)
from kvstore.integrations.mooncake.store import (
    INVALID_PARAMS,
    OK,
    RPC_FAIL,
    MooncakeDistributedStore,
)

BASE = {"local_hostname": "h", "metadata_server": "http://127.0.0.1:1/metadata"}


@pytest.mark.parametrize(("text", "want"), [
    (4096, 4096), ("4096", 4096), ("4GB", 4 << 30), ("4gb", 4 << 30), ("4G", 4 << 30),
    ("512MB", 512 << 20), ("1.5 GB", 3 << 29), ("64k", 64 << 10), ("2TB", 2 << 40),
    ("10B", 10), (" 7 ", 7), ("0", 0), ("infinite", MAX_U64),
])
def test_sizes_use_mooncakes_binary_units(text: object, want: int) -> None:
    assert parse_mooncake_size(text) == want


@pytest.mark.parametrize("text", ["4XB", "", "GB", "-1", "4GiB", "four", "1,024"])
def test_sizes_mooncake_refuses(text: str) -> None:
    with pytest.raises(ValueError, match="not a Mooncake size"):
        parse_mooncake_size(text)


def test_defaults_and_conversions() -> None:
    args = setup_arguments({**BASE, "enable_ssd_offload": True, "client_http_port": 9400,
                            "global_segment_size": 0})
    assert args == {
        "local_hostname": "h", "metadata_server": "http://127.0.0.1:1/metadata",
        "global_segment_size": 0, "local_buffer_size": 16 << 20, "protocol": "tcp",
        "rdma_devices": "", "master_server_addr": "127.0.0.1:50051",
        "enable_ssd_offload": True, "ssd_offload_path": "", "tenant_id": "default",
        "enable_client_http_server": False, "client_http_port": 9400}
    kv = setup_arguments({**BASE, "replicas": 2, "transport": "tcp"})
    assert (kv["replicas"], kv["transport"]) == (2, "tcp")


@pytest.mark.parametrize(("config", "message"), [
    ({"metadata_server": "x"}, "missing required config key 'local_hostname'"),
    ({"local_hostname": "h", "metadata_server": ""}, "'metadata_server'"),
    ({**BASE, "global_segment_size": "4XB"}, "global_segment_size: not a Mooncake size"),
    ({**BASE, "local_buffer_size": 100}, "local_buffer_size=100 must be 0 or at least 1024"),
    ({**BASE, "local_buffer_size": "2TB"}, "above 1099511627776 bytes"),
    ({**BASE, "client_http_port": "http"}, "client_http_port='http' is not an integer"),
])
def test_refused_forms_name_the_key(config: dict, message: str) -> None:
    with pytest.raises(InvalidArgument, match=message.replace("(", r"\(")):
        setup_arguments(config)


def test_not_a_dict() -> None:
    with pytest.raises(InvalidArgument, match="takes a dict, got list"):
        setup_arguments([("local_hostname", "h")])  # type: ignore[arg-type]


def test_loose_values_warn(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        args = setup_arguments({**BASE, "enable_ssd_offload": "maybe", "colour": "blue",
                                "ipc_socket_path": "/tmp/x.sock"})
    assert args["enable_ssd_offload"] is False
    assert "enable_ssd_offload='maybe' is not a boolean" in caplog.text
    assert "ignoring config keys Mooncake does not know: colour" in caplog.text
    assert "ipc_socket_path is ignored" in caplog.text


def test_the_pre_0_3_13_names_are_read() -> None:
    """LMCache 0.5.6 (and Mooncake's own mooncake_config.py) pass ``master_server_address``
    and ``device_name`` in the dict: they name the master and the RDMA devices, and the
    0.3.13 names win when both are given."""
    args = setup_arguments({**BASE, "master_server_address": "10.0.0.1:7600",
                            "device_name": "mlx5_0"})
    assert (args["master_server_addr"], args["rdma_devices"]) == ("10.0.0.1:7600", "mlx5_0")
    both = setup_arguments({**BASE, "master_server_address": "10.0.0.1:7600",
                            "master_server_addr": "10.0.0.2:7600",
                            "device_name": "mlx5_0", "rdma_devices": "mlx5_1"})
    assert (both["master_server_addr"], both["rdma_devices"]) == ("10.0.0.2:7600", "mlx5_1")


@pytest.fixture(scope="module")
def node_addr(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    node = start_node(tmp_path_factory.mktemp("mc-setup"))
    yield node.addr
    node.stop()


def test_dict_setup_against_a_node(node_addr: str, caplog: pytest.LogCaptureFixture) -> None:
    s = MooncakeDistributedStore()
    assert s.health_check() == 1  # not set up
    with caplog.at_level(logging.ERROR):
        assert s.setup({**BASE, "global_segment_size": "4XB",
                        "master_server_addr": node_addr}) == INVALID_PARAMS
    assert "global_segment_size: not a Mooncake size: '4XB'" in caplog.text
    assert s.setup({**BASE, "master_server_addr": f"127.0.0.1:{free_port()}"}) == RPC_FAIL
    assert s.setup({**BASE, "global_segment_size": "4GB", "local_buffer_size": "512MB",
                    "master_server_addr": node_addr}) == OK
    assert s.get_hostname() == "h" and s.health_check() == 0
    assert s.put("dict/k", b"v") == OK and s.get("dict/k") == b"v"
    assert s.remove_all() == 1
    assert s.close() == OK and s.health_check() == 1
    # LMCache's setup dict, its own key names as it passes them (save_chunk_meta and
    # transfer_timeout are its own and stay out of it)
    lmcache = {"local_hostname": "localhost", "metadata_server": "P2PHANDSHAKE",
               "master_server_address": node_addr, "global_segment_size": "3355443200",
               "local_buffer_size": "1073741824", "protocol": "tcp", "device_name": ""}
    assert s.setup(lmcache) == OK and s.health_check() == 0
    assert s.close() == OK
