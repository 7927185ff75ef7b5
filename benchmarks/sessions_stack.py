"""The processes of one ``python -m benchmarks.sessions`` run, on 127.0.0.1: a kvstore node
with a DRAM and an SSD tier, the toy workers or vLLM instances, and ``conductor serve`` in
front of them. Everything is started here, logs to its own file and is stopped by
``Stack.stop`` (each process group by its PID).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from conductor.front.vllm_procs import (
    REPO,
    VLLM_BLOCK,
    Proc,
    free_port,
    start_conductor,
    start_vllm,
    wait_ready,
)

SESSION_TTL_FLAG = "--session-ttl"


@dataclass(slots=True, kw_only=True, frozen=True)
class NodeSize:
    dram_bytes: int
    ssd_bytes: int
    max_retained_fraction: float


def spawn(name: str, args: Sequence[str], logdir: Path, ready: str, *, url: str,
          timeout: float = 120.0) -> Proc:
    """``python ARGS`` from the work tree, waited until its log says ``ready``."""
    log = logdir / f"{name}.log"
    with open(log, "wb") as out:
        proc = subprocess.Popen([sys.executable, *args], stdout=out, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                                env={**os.environ, "PYTHONPATH": str(REPO),
                                     "PYTHONUNBUFFERED": "1"})
    p = Proc(name=name, proc=proc, log=log, url=url)
    deadline = time.monotonic() + timeout
    while ready not in p.output(tail=100_000):
        if not p.alive() or time.monotonic() > deadline:
            p.stop(signal.SIGKILL)
            raise RuntimeError(f"{name} did not start:\n{p.output()}")
        time.sleep(0.05)
    return p


def session_flag_supported() -> bool:
    """Whether this tree's ``conductor serve`` has ``--session-ttl`` (sessions built)."""
    out = subprocess.run([sys.executable, "-m", "conductor", "serve", "--help"], cwd=REPO,
                         capture_output=True, text=True, check=False,
                         env={**os.environ, "PYTHONPATH": str(REPO)})
    return SESSION_TTL_FLAG in out.stdout


def session_args(ttl_s: float, supported: bool) -> list[str]:
    """``conductor serve`` flags for sessions on (``ttl_s > 0``) or off (0); none where
    the flag does not exist yet."""
    return [SESSION_TTL_FLAG, f"{ttl_s:g}"] if supported else []


@dataclass(slots=True, kw_only=True)
class Stack:
    logdir: Path
    node: Proc | None = None
    backends: list[Proc] = field(default_factory=list)
    conductor: Proc | None = None

    def start_node(self, size: NodeSize) -> Proc:
        port = free_port()
        self.node = spawn("node", [
            "-m", "kvstore", "serve", "--listen", f"127.0.0.1:{port}",
            "--dram-bytes", str(size.dram_bytes), "--ssd-path", str(self.logdir / "ssd.bin"),
            "--ssd-bytes", str(size.ssd_bytes),
            "--max-retained-fraction", f"{size.max_retained_fraction:g}", "--no-prefault"],
            self.logdir, "kvstore: serving on", url=f"127.0.0.1:{port}")
        return self.node

    def start_toy(self, model_config: Path, block_tokens: int, conductor_args: list[str]
                  ) -> Proc:
        """One prefill and one decode worker, and ``conductor serve`` in front."""
        assert self.node is not None
        common = ["--store", self.node.url, "--model-config", str(model_config),
                  "--seed", "0", "--block-tokens", str(block_tokens), "--threads", "1"]
        for role in ("prefill", "decode"):
            addr = f"127.0.0.1:{free_port()}"
            self.backends.append(spawn(role, ["-m", "workers", role, "--listen", addr,
                                              *common], self.logdir,
                                       f"workers: {role} serving on", url=addr))
        addrs = {p.name: p.url for p in self.backends}
        self.conductor = start_conductor(self.logdir, name="conductor", args=[
            "--store", self.node.url, "--prefill", addrs["prefill"],
            "--decode", addrs["decode"], "--rejection", "none", "--ttft-slo", "1000s",
            "--tbt-slo", "100s", *conductor_args])
        return self.conductor

    def start_vllm(self, vllm_python: str, model: Path, *, instances: int, namespace: str,
                   max_model_len: int, kv_cache_bytes: int, conductor_args: list[str]
                   ) -> Proc:
        """``instances`` colocated vLLM servers (KVStoreConnector kv_both) and ``conductor
        serve --vllm`` in front."""
        assert self.node is not None
        for i in range(instances):
            self.backends.append(start_vllm(
                vllm_python, model, self.logdir, name=f"vllm{i}", store=self.node.url,
                namespace=namespace, role="kv_both", max_model_len=max_model_len,
                kv_cache_bytes=kv_cache_bytes, extra_args=["--enable-prompt-tokens-details"]))
        for p in self.backends:
            wait_ready(p, "/v1/models", 900)
        self.conductor = start_conductor(self.logdir, name="conductor", args=[
            "--store", self.node.url, "--vllm", ",".join(p.url for p in self.backends),
            "--kv-namespace", namespace, "--block-tokens", str(VLLM_BLOCK),
            "--rejection", "none", "--ttft-slo", "1000s", "--tbt-slo", "100s",
            *conductor_args])
        return self.conductor

    def stop(self) -> dict[str, int]:
        """Conductor first, then the backends, then the node; exit codes by name."""
        codes = {}
        for p in [self.conductor, *self.backends, self.node]:
            if p is not None:
                codes[p.name] = p.stop()
        return codes
