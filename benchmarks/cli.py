"""``kvstore bench NAME``: the benchmarks' command, registered into the ``kvstore`` CLI.

Each benchmark module is loaded only when it runs (they need the ``bench`` extra), and
runs with the arguments after its name.
"""

from __future__ import annotations

import argparse
import importlib

from kvstore.core.errors import KVStoreError

BENCHMARKS = {"api": "benchmarks.api_bench", "tiers": "benchmarks.tier_bench",
              "cluster": "benchmarks.cluster_bench", "clients": "benchmarks.clients_bench",
              "trace": "benchmarks.trace_replay"}
"""``kvstore bench NAME`` runs ``main(argv)`` of these modules."""


class BenchUnavailable(KVStoreError):
    """A benchmark's module could not be imported (its extra is not installed)."""


def add_parser(sub: argparse._SubParsersAction) -> None:
    s = sub.add_parser("bench", help="benchmarks (not tests)")
    s.add_argument("which", choices=sorted(BENCHMARKS),
                   help="api: put/get vs Redis and raw TCP; tiers: each tier vs its limit; "
                        "clients: N client processes reading over TCP vs Redis")
    s.add_argument("args", nargs=argparse.REMAINDER, help="options of that benchmark")


def run(args: argparse.Namespace) -> int:
    try:
        module = importlib.import_module(BENCHMARKS[args.which])
    except ImportError as exc:
        raise BenchUnavailable(f"the benchmarks need the bench extra (pip install "
                               f"'kvstore[bench]'): {exc}") from exc
    return int(module.main(args.args) or 0)
