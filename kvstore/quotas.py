"""Per-tenant byte quotas of one node.

A ``QuotaBook`` is pure and single-owner: the node calls it under its metadata
lock, in the same critical section as the reservation it charges, so a check and
its charge can never interleave with another put. A key is charged from the
moment its space is reserved until it leaves the node (eviction, removal) or its
reservation is aborted; each key is charged to at most one tenant (keys are
salted per tenant, so two tenants never share one).
"""

from __future__ import annotations

from kvstore.errors import ResourceExhausted
from kvstore.keys import BlockKey
from kvstore.sizes import format_size


class QuotaBook:
    def __init__(self) -> None:
        self._used: dict[str, int] = {}
        self._charged: dict[BlockKey, tuple[str, int]] = {}

    def check(self, owner: str, quota: int, nbytes: int) -> None:
        used = self._used.get(owner, 0)
        if used + nbytes > quota:
            raise ResourceExhausted(
                f"namespace {owner!r} is over its quota on this node: {format_size(used)} used "
                f"+ {format_size(nbytes)} > {format_size(quota)}")

    def charge(self, owner: str, key: BlockKey, nbytes: int) -> None:
        if key in self._charged:
            raise AssertionError(f"key {key.hex()} charged twice")
        self._charged[key] = (owner, nbytes)
        self._used[owner] = self._used.get(owner, 0) + nbytes

    def release(self, key: BlockKey) -> None:
        got = self._charged.pop(key, None)
        if got is not None:
            owner, nbytes = got
            self._used[owner] -= nbytes

    def used(self) -> dict[str, int]:
        return dict(self._used)
