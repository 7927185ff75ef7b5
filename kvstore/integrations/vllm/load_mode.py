"""How a load runs: inline in the step when the engine has nothing else to run, else on
the loader thread while other requests' steps go on.

An asynchronous load (vLLM's ``load_kv_async=True``) parks the request in
``WAITING_FOR_REMOTE_KVS``; the worker fetches on its loader thread, vLLM learns the load
is done from a later step's ``get_finished``, and schedules the request in the step after.
That overlaps the load with other requests' compute, which is what it is for. On an
engine with nothing else to run it only adds: the hand-over to the loader thread, the
engine loop's empty steps competing with it for the GIL while the request waits, and the
step between the load's end and the request's prefill (``benchmarks.connector_cost``,
RESULTS.md: a 1,920-token hit took ~1.3 ms per MiB in the engine against ~0.3 outside it).
An inline load (``load_kv_async=False``) is done by the worker in ``start_load_kv``, before
that same step's forward: nothing else waits for it, since nothing else runs.

On a busy engine a small load is inline too (``load_inline_busy_max_bytes``): it lengthens
the step it runs in by its own time (milliseconds: bytes at the store's get bandwidth),
where an asynchronous load costs its request at least one whole step more, waiting for the
report that it landed. On a CPU here a step with a cold prefill in it takes ~0.4 s and a
1,200-token load ~20 ms, so a hit arriving behind a cold prefill gains a whole step; on a
GPU a decode step is tens of milliseconds, and the bound keeps the load shorter than that
at TCP speeds. The loads inline in one step together stay under the bound.

The scheduler side decides, request by request, from what it has seen: the requests
scheduled and not finished (``running``) and the asynchronous loads not yet reported
done (``loading``). A preempted request still counts as running (it comes back).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any


@dataclass(slots=True, kw_only=True)
class EngineActivity:
    """The scheduler side's view of the engine's work; not thread safe (vLLM's scheduler
    calls the connector from one thread)."""

    running: set[str] = field(default_factory=set)
    """Requests scheduled at least once and not finished."""
    loading: set[str] = field(default_factory=set)
    """Requests whose asynchronous load is in flight."""

    def scheduled(self, req_ids: Iterable[str]) -> None:
        self.running.update(req_ids)

    def load_started(self, req_id: str) -> None:
        self.loading.add(req_id)

    def load_done(self, req_id: str) -> None:
        self.loading.discard(req_id)

    def finished(self, req_id: str) -> None:
        self.running.discard(req_id)
        self.loading.discard(req_id)

    def idle(self) -> bool:
        """Nothing would wait for a load done in the step: no request runs or loads."""
        return not self.running and not self.loading


DEFAULT_BUSY_MAX_BYTES = 16 << 20
"""``load_inline_busy_max_bytes``' default: 16 MiB load in ~6-16 ms at 1-2.5 GB/s."""


@dataclass(slots=True, kw_only=True, frozen=True)
class InlineLoads:
    """Which loads run inline (the module docstring)."""

    when_idle: bool = True
    """``load_inline_when_idle``: off, every load is asynchronous."""
    busy_max_bytes: int = DEFAULT_BUSY_MAX_BYTES
    """``load_inline_busy_max_bytes``: with requests running, loads inline in one step
    together up to this many bytes (0: none)."""

    def __post_init__(self) -> None:
        if self.busy_max_bytes < 0:
            raise ValueError("busy_max_bytes must be >= 0")

    @classmethod
    def from_config(cls, get: Callable[[str, Any], Any], *, hybrid: bool) -> InlineLoads:
        """From ``kv_connector_extra_config`` (``get(key, default)``); ValueError names a
        bad key. A hybrid model loads asynchronously only: vLLM takes its load errors per
        request, from asynchronous loads alone."""
        when_idle = get("load_inline_when_idle", True)
        if not isinstance(when_idle, bool):  # a string "false" would read as true
            raise ValueError("kv_connector_extra_config load_inline_when_idle must be true "
                             f"or false, got {when_idle!r}")
        busy = get("load_inline_busy_max_bytes", DEFAULT_BUSY_MAX_BYTES)
        if isinstance(busy, bool) or not isinstance(busy, int) or busy < 0:
            raise ValueError("kv_connector_extra_config load_inline_busy_max_bytes must be "
                             f"an integer >= 0, got {busy!r}")
        return cls(when_idle=when_idle and not hybrid, busy_max_bytes=busy)

    def inline(self, activity: EngineActivity, *, planned: int, planned_inline_bytes: int,
               load_bytes: int) -> bool:
        """Whether a load of ``load_bytes`` runs inline, ``planned`` loads (of which
        ``planned_inline_bytes`` inline) being planned already in this scheduler pass."""
        if not self.when_idle:
            return False
        if activity.idle() and not planned:
            return True
        return planned_inline_bytes + load_bytes <= self.busy_max_bytes
