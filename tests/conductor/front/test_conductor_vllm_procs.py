"""``conductor.front.vllm_procs.free_port``: the one ``kvstore.core.ports.free_port``, under
the name benchmarks and tests import (its rule, never the same port twice in a process, is
tested in ``tests/kvstore/core/test_ports.py``)."""

from __future__ import annotations

from conductor.front import vllm_procs
from kvstore.core import ports


def test_free_port_is_the_one_in_kvstore_core() -> None:
    assert vllm_procs.free_port is ports.free_port
