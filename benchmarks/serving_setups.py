"""The set-ups ``python -m benchmarks.vllm_serving`` compares: two vLLM OpenAI servers each,
one per core (``VLLM_CPU_OMP_THREADS_BIND`` 0 and 1), started, waited for, and stopped.

* ``rr-no-kvstore``: no connector, round-robin by the client (vLLM's own prefix cache
  only): the baseline of the ratios;
* ``rr-kvstore``: ``KVStoreConnector`` (``kv_both``) on both, round-robin by the client:
  what the store does apart from the routing;
* ``colocated-kvstore``: the same two instances behind ``conductor serve --vllm``
  (cache-aware routing; the Conductor learns namespace and block size from the instances);
* ``disaggregated``: 1 prefill (``kv_both``) + 1 decode (``kv_consumer``) behind
  ``conductor serve --vllm-prefill/--vllm-decode`` (the KV cache handed over by the store);
* the peers a user would choose instead (``benchmarks.vllm_peers``), round-robin by the
  client: ``rr-mooncake-store`` (vLLM's ``MooncakeStoreConnector`` on Mooncake Store),
  ``rr-lmcache`` (LMCache's vLLM connector), ``rr-offloading`` (vLLM's native CPU
  offloading); one that cannot start here is reported with the reason.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from conductor.front.vllm_instances import metric_sum, parse_metrics
from conductor.front.vllm_procs import Proc, start_conductor, start_vllm, wait_ready

KVSTORE_SETUPS = ("rr-no-kvstore", "rr-kvstore", "colocated-kvstore", "disaggregated")
PEER_SETUPS = ("rr-mooncake-store", "rr-lmcache", "rr-offloading")
SETUPS = KVSTORE_SETUPS + PEER_SETUPS
CORES = ("0", "1")
"""One instance per core: two servers left to vLLM's automatic binding can share one."""


class SetupUnavailable(Exception):
    """The set-up cannot run on this machine; the message says why (reported, not fatal)."""


@dataclass(slots=True, kw_only=True, frozen=True)
class ServerSpec:
    """What every instance of a run shares."""

    vllm_python: str
    model: Path
    max_model_len: int
    kv_cache_bytes: int
    store: str
    """The kvstore node's HOST:PORT (publishing KV events)."""
    max_num_batched_tokens: int | None = None
    """vLLM's token budget per step (None: vLLM's default): a request arriving during a
    long prefill waits for the step that prefill is in."""


@dataclass(slots=True, kw_only=True)
class Running:
    urls: list[str]
    """Where the client sends requests: one Conductor, or the instances round-robin."""
    instances: list[Proc]
    conductor: Proc | None = None
    notes: list[str] = field(default_factory=list)


PeerStarter = Callable[[str, Path, ExitStack, str], tuple[str, dict[str, str], list[str]]]
"""``(setup, logdir, stack, vllm_python) -> (kv_transfer JSON, server environment, notes)``:
starts what a peer's servers need (entering its processes into ``stack``); raises
``SetupUnavailable``."""


def _peer_starter() -> PeerStarter:
    try:
        from benchmarks.vllm_peers import PeerUnavailable, start_peer_backend
    except ImportError as e:
        raise SetupUnavailable(f"benchmarks.vllm_peers does not import: {e}") from e

    def start(setup: str, logdir: Path, stack: ExitStack, vllm_python: str
              ) -> tuple[str, dict[str, str], list[str]]:
        try:
            return start_peer_backend(setup, logdir, stack, vllm_python=vllm_python)
        except PeerUnavailable as e:
            raise SetupUnavailable(str(e)) from e

    return start


def _stop_later(stack: ExitStack, p: Proc) -> Proc:
    stack.callback(p.stop)
    return p


@contextmanager
def running(name: str, spec: ServerSpec, logdir: Path) -> Iterator[Running]:
    """Starts set-up ``name``, yields it serving, stops everything it started."""
    if name not in SETUPS:
        raise ValueError(f"unknown set-up {name!r}; known: {', '.join(SETUPS)}")
    logdir.mkdir(parents=True, exist_ok=True)
    ns = f"bench-{name}-{time.time_ns()}"
    budget = ([] if spec.max_num_batched_tokens is None else
              ["--max-num-batched-tokens", str(spec.max_num_batched_tokens)])
    with ExitStack() as stack:
        notes: list[str] = []

        def vllm(i: int, *, role: str | None, kv_transfer: str | None = None,
                 env: dict[str, str] | None = None) -> Proc:
            return _stop_later(stack, start_vllm(
                spec.vllm_python, spec.model, logdir, name=f"{name}-{i}",
                store=spec.store if role else None, namespace=ns, role=role or "kv_both",
                max_model_len=spec.max_model_len, kv_cache_bytes=spec.kv_cache_bytes,
                kv_transfer=kv_transfer, extra_args=budget,
                env={"VLLM_CPU_OMP_THREADS_BIND": CORES[i], **(env or {})}))

        if name in PEER_SETUPS:
            kv_json, env, notes = _peer_starter()(name, logdir, stack, spec.vllm_python)
            insts = [vllm(i, role=None, kv_transfer=kv_json, env=env) for i in range(2)]
        elif name == "rr-no-kvstore":
            insts = [vllm(i, role=None) for i in range(2)]
        elif name == "disaggregated":
            insts = [vllm(0, role="kv_both"), vllm(1, role="kv_consumer")]
        else:
            insts = [vllm(i, role="kv_both") for i in range(2)]
        for p in insts:
            try:
                wait_ready(p, "/v1/models", 900)
            except RuntimeError as e:
                if name in PEER_SETUPS:
                    raise SetupUnavailable(_last_error(str(e))) from e
                raise
        for p in insts:
            warm_up(p, spec.model)
        conductor = None
        if name in ("colocated-kvstore", "disaggregated"):
            where = (["--vllm-prefill", insts[0].url, "--vllm-decode", insts[1].url]
                     if name == "disaggregated" else
                     ["--vllm", ",".join(p.url for p in insts)])
            conductor = _stop_later(stack, start_conductor(logdir, name="conductor", args=[
                "--store", spec.store, *where, "--rejection", "none",
                "--ttft-slo", "60s", "--tbt-slo", "10s"], timeout=120))
        urls = [conductor.url] if conductor else [p.url for p in insts]
        yield Running(urls=urls, instances=insts, conductor=conductor, notes=notes)


def warm_up(p: Proc, model: Path) -> None:
    """One short request straight to the instance: vLLM's first request on a CPU runs far
    slower than the next (one-time set-up), which would skew the first measurements and
    the Conductor's calibration of that instance. Less than a block, so nothing is saved."""
    r = httpx.post(p.url + "/v1/completions", timeout=300, json={
        "model": str(model), "prompt": [5, 6, 7, 8, 9, 10, 11, 12], "max_tokens": 2,
        "temperature": 0})
    r.raise_for_status()


def _last_error(log: str) -> str:
    """The most telling line of a server that died: the last exception line."""
    lines = [ln.strip() for ln in log.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "Error" in ln or "error" in ln or "not supported" in ln:
            return ln[:400]
    return lines[-1][:400] if lines else "no output"


def instance_counters(instances: list[Proc], names: tuple[str, ...]) -> list[dict[str, float]]:
    """Per instance, each counter in ``names`` summed over its labels."""
    out = []
    for p in instances:
        metrics = parse_metrics(httpx.get(p.url + "/metrics", timeout=30).text)
        out.append({n: metric_sum(metrics, n) for n in names})
    return out


def conductor_figures(conductor: Proc) -> dict[str, Any]:
    """What the Conductor saw: mean durability wait, prefix tokens found on arrival,
    requests per instance, requests held for another instance's save by outcome."""
    m = parse_metrics(httpx.get(conductor.url + "/metrics", timeout=30).text)
    chosen = {f"{lb.get('role', '')} {lb.get('instance', '')}": v
              for lb, v in m.get("conductor_instance_chosen_total", ())}
    n = metric_sum(m, "conductor_durability_wait_seconds_count")
    save_waits = {lb.get("outcome", ""): v for lb, v in m.get("conductor_save_waits_total", ())}
    return {"durability_wait_mean_s": metric_sum(
                m, "conductor_durability_wait_seconds_sum") / n if n else None,
            "prefix_tokens_found": metric_sum(m, "conductor_prefix_tokens_found_total"),
            "chosen": chosen, "save_waits": save_waits}
