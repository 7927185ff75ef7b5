"""Serving on one machine: a kvstore node, prefill and decode worker processes and a
``conductor serve`` process, all on loopback (free ports), for the demo and the tests.

Every process is started by this object, logs to its own file in ``directory`` and
is stopped by ``stop`` (SIGTERM, then SIGKILL after a timeout), by PID.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.core.ports import free_port  # re-exported: benchmarks and tests import it from here


@dataclass(slots=True, kw_only=True)
class Proc:
    name: str
    addr: str
    proc: subprocess.Popen
    log: Path

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""


@dataclass(slots=True, kw_only=True)
class LocalServing:
    directory: Path
    store: Proc | None = None
    prefill: list[Proc] = field(default_factory=list)
    decode: list[Proc] = field(default_factory=list)
    conductor: Proc | None = None

    @classmethod
    def up(cls, directory: str | Path, *, prefill: int = 2, decode: int = 2,
           model: str = "small", seed: int = 0, block_tokens: int = 16,
           dram: str = "1GiB", ttft_slo: str = "30s", tbt_slo: str = "1s",
           policy: str = "global-cache-aware", rejection: str = "predictive",
           worker_threads: int = 1, timeout: float = 120.0) -> LocalServing:
        d = Path(directory)
        d.mkdir(parents=True, exist_ok=True)
        s = cls(directory=d)
        try:
            s.store = s._start("store", ["-m", "kvstore", "serve", "--dram-bytes", dram,
                                         "--no-prefault"], "kvstore: serving on", "--listen")
            model_args = ["--store", s.store.addr, "--model-config", model, "--seed", str(seed),
                          "--block-tokens", str(block_tokens), "--threads", str(worker_threads)]
            for role, n, into in (("prefill", prefill, s.prefill), ("decode", decode, s.decode)):
                for i in range(n):
                    into.append(s._start(f"{role}-{i + 1}", ["-m", "workers", role, *model_args],
                                         f"workers: {role} serving on", "--listen",
                                         wait=False))
            for p in [*s.prefill, *s.decode]:
                s._wait(p, f"workers: {p.name.split('-')[0]} serving on", timeout)
            s.conductor = s._start("conductor", [
                "-m", "conductor", "serve", "--store", s.store.addr,
                "--prefill", ",".join(p.addr for p in s.prefill),
                "--decode", ",".join(p.addr for p in s.decode),
                "--ttft-slo", ttft_slo, "--tbt-slo", tbt_slo, "--policy", policy,
                "--rejection", rejection], "conductor: serving on", "--listen")
        except BaseException:
            s.stop()
            raise
        return s

    def _start(self, name: str, args: Sequence[str], ready: str, listen_flag: str, *,
               wait: bool = True, timeout: float = 120.0) -> Proc:
        addr = f"127.0.0.1:{free_port()}"
        log = self.directory / f"{name}.log"
        with open(log, "wb") as out:
            proc = subprocess.Popen([sys.executable, *args, listen_flag, addr], stdout=out,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                    env={**os.environ, "PYTHONUNBUFFERED": "1"})
        p = Proc(name=name, addr=addr, proc=proc, log=log)
        if wait:
            self._wait(p, ready, timeout)
        return p

    @staticmethod
    def _wait(p: Proc, ready: str, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while ready not in p.output():
            if p.proc.poll() is not None:
                raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n"
                                   f"{p.output()[-3000:]}")
            if time.monotonic() > deadline:
                raise RuntimeError(f"{p.name} not ready in {timeout}s:\n{p.output()[-3000:]}")
            time.sleep(0.05)

    def processes(self) -> list[Proc]:
        return [p for p in (self.conductor, *self.decode, *self.prefill, self.store)
                if p is not None]

    def stop(self, timeout: float = 20.0) -> dict[str, int | None]:
        """Stops the conductor first, then the workers, then the store; exit codes."""
        codes: dict[str, int | None] = {}
        for p in self.processes():
            if p.proc.poll() is None:
                p.proc.send_signal(signal.SIGTERM)
            try:
                codes[p.name] = p.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    p.proc.kill()
                codes[p.name] = p.proc.wait()
        return codes
