"""kvstore's Mooncake class against Mooncake Store's real 0.3.13 wheel, side by side.

Runs in the Mooncake environment (``make test-mooncake``; ``scripts/setup-mooncake-env.sh``
installs ``mooncake-transfer-engine-non-cuda==0.3.13.post1``). Where the wheel is not
installed this module collects no test; with ``KVSTORE_MOONCAKE_TESTS=1`` (set by ``make
test-mooncake``) a missing wheel fails the run.

The same scenario (``tests/mooncake_scenario.py``) runs against the wheel's
``MooncakeDistributedStore``, set up over TCP against its own ``mooncake_master`` (the binary
inside the package, with its HTTP metadata server; 127.0.0.1 only:
``MC_TCP_BIND_ADDRESS=127.0.0.1``), and against kvstore's class on a real kvstore node; both
must give the recorded results, step by step.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import main_conftest  # the engines conftest put this folder on sys.path
import mooncake_scenario as scenario
import pytest

HAVE_MOONCAKE = importlib.util.find_spec("mooncake") is not None
REQUIRED = os.environ.get("KVSTORE_MOONCAKE_TESTS") == "1"

if REQUIRED and not HAVE_MOONCAKE:
    raise ImportError(
        f"KVSTORE_MOONCAKE_TESTS=1 but Mooncake is not importable from {sys.executable}: "
        "build its environment with scripts/setup-mooncake-env.sh (make test-mooncake does)")

free_port = main_conftest.main.free_port
wait_until = main_conftest.main.wait_until
start_node = main_conftest.main.start_node


@pytest.fixture(scope="module")
def master(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    """A real mooncake_master on 127.0.0.1 with its HTTP metadata server; the setup dict."""
    import urllib.request

    import mooncake

    os.environ["MC_TCP_BIND_ADDRESS"] = "127.0.0.1"  # else it advertises a LAN address
    binary = Path(mooncake.__file__).parent / "mooncake_master"
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = tmp_path_factory.mktemp("mooncake-master") / "master.log"
    with log.open("w") as out:
        proc = subprocess.Popen(
            [str(binary), f"--rpc_port={rpc}", "--rpc_address=127.0.0.1",
             "--enable_http_metadata_server=true", "--http_metadata_server_host=127.0.0.1",
             f"--http_metadata_server_port={http}", f"--metrics_port={metrics}"],
            stdout=out, stderr=subprocess.STDOUT)

    def up() -> bool:
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{http}/metadata?key=probe", timeout=1)
        except urllib.error.HTTPError:
            return True  # 404: the metadata server answers
        except OSError:
            return False
        return True

    try:
        wait_until(up, timeout=30, what="mooncake_master's metadata server")
        yield {"local_hostname": "127.0.0.1",
               "metadata_server": f"http://127.0.0.1:{http}/metadata",
               "global_segment_size": "64MB", "local_buffer_size": "32MB",
               "protocol": "tcp", "master_server_addr": f"127.0.0.1:{rpc}"}
    finally:
        proc.terminate()
        proc.wait(timeout=30)


@pytest.fixture(scope="module")
def node_setup(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, str]]:
    node = start_node(tmp_path_factory.mktemp("mooncake-kvstore"))
    try:
        yield {"local_hostname": "127.0.0.1", "metadata_server": "http://127.0.0.1:1/metadata",
               "global_segment_size": "64MB", "local_buffer_size": "32MB",
               "protocol": "tcp", "master_server_addr": node.addr}
    finally:
        node.stop()


def _wheel() -> tuple[type, type, object]:
    from mooncake.store import MooncakeDistributedStore, ReplicateConfig, SoftPinAction

    return MooncakeDistributedStore, ReplicateConfig, SoftPinAction


def _kvstore() -> tuple[type, type, object]:
    from kvstore.integrations.mooncake_compat import (
        MooncakeDistributedStore,
        ReplicateConfig,
        SoftPinAction,
    )

    return MooncakeDistributedStore, ReplicateConfig, SoftPinAction


class TestSideBySide:
    __test__ = HAVE_MOONCAKE  # no test at all where the wheel is not installed

    def test_every_wheel_method_is_on_kvstores_class(self) -> None:
        wheel_cls, _, _ = _wheel()
        ours, _, _ = _kvstore()
        public = sorted(n for n in dir(wheel_cls)
                        if not n.startswith("__") and n != "_pybind11_conduit_v1_")
        assert tuple(public) == scenario.WHEEL_METHODS
        assert [n for n in public if not callable(getattr(ours, n, None))] == []

    def test_enums_and_config_defaults_are_the_wheels(self) -> None:
        import mooncake.store as wheel

        from kvstore.integrations import mooncake_compat as ours

        for name in ("SoftPinAction", "ObjectDataType"):
            theirs = {k: int(v) for k, v in getattr(wheel, name).__members__.items()}
            assert {k: int(v) for k, v in getattr(ours, name).__members__.items()} == theirs
        w, k = wheel.ReplicateConfig(), ours.ReplicateConfig()
        fields = sorted(a for a in dir(w) if not a.startswith("_"))
        assert fields == sorted(a for a in dir(k) if not a.startswith("_"))
        assert {f: getattr(k, f) for f in fields} == {
            f: (int(v) if f in ("soft_pin_action", "data_type") else v)
            for f, v in ((f, getattr(w, f)) for f in fields)}

    def test_wheel_whole_scenario(self, master: dict[str, str]) -> None:
        store_cls, config_cls, _ = _wheel()
        got: dict[str, object] = {}
        s = scenario.open_store(store_cls, master, got)
        scenario.basic_steps(s, "wheel-basic/", got)
        scenario.tensor_steps(s, "wheel-tensor/", got)
        scenario.ranged_steps(s, config_cls, "wheel-ranged/", got)
        assert got == scenario.expected(got, kvstore=False)
        assert len(got) == 95

    def test_kvstore_whole_scenario(self, node_setup: dict[str, str]) -> None:
        store_cls, config_cls, _ = _kvstore()
        got: dict[str, object] = {}
        s = scenario.open_store(store_cls, node_setup, got)
        scenario.basic_steps(s, "kvstore-basic/", got)
        scenario.tensor_steps(s, "kvstore-tensor/", got)
        scenario.ranged_steps(s, config_cls, "kvstore-ranged/", got)
        assert got == scenario.expected(got, kvstore=True)
        assert len(got) == 95

    def test_wheel_soft_pin(self, master: dict[str, str]) -> None:
        store_cls, config_cls, soft_pin = _wheel()
        got: dict[str, object] = {}
        s = scenario.open_store(store_cls, master, got)
        scenario.soft_pin_steps(s, config_cls, soft_pin, "wheel-pin/", got)
        s.close()
        assert got == scenario.expected(got, kvstore=False)
        assert len(got) == 10

    def test_kvstore_soft_pin(self, node_setup: dict[str, str]) -> None:
        store_cls, config_cls, soft_pin = _kvstore()
        got: dict[str, object] = {}
        s = scenario.open_store(store_cls, node_setup, got)
        scenario.soft_pin_steps(s, config_cls, soft_pin, "kvstore-pin/", got)
        s.close()
        assert got == scenario.expected(got, kvstore=True)
        assert len(got) == 10


class TestDocumentedPath:
    __test__ = HAVE_MOONCAKE  # no test at all where the engine is not installed

    def test_the_documented_module_path_is_the_module(self) -> None:
        """``kvstore.integrations.mooncake_compat`` (the path configs name) is the module itself."""
        import importlib

        old = importlib.import_module("kvstore.integrations.mooncake_compat")
        new = importlib.import_module("kvstore.integrations.mooncake.store")
        assert old is new and old.MooncakeDistributedStore is new.MooncakeDistributedStore
