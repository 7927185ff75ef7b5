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

The scheduler side decides, request by request, from what it has seen: the requests
scheduled and not finished (``running``) and the asynchronous loads not yet reported
done (``loading``). A preempted request still counts as running (it comes back).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field


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
