"""A single-member etcd process on loopback, for tests and ``kvstore cluster up``.

etcd is kvstore's membership service (see ``replication.membership``). This module
only runs the binary: it picks free loopback ports, starts etcd with a data
directory, waits until etcd reports itself healthy, and stops it again by PID.

Invariants:

* Everything listens on 127.0.0.1 only.
* Ports are chosen once (at the first ``start``) and kept for every restart, so
  clients configured with ``endpoint`` reconnect to the restarted process.
* etcd's output goes to a log file next to the data directory
  (``<data_dir>.log``, appended across restarts), never to a pipe that could
  fill and stall it. Start-up errors quote the log's tail.
* ``stop``/``kill`` signal only the process this object started, by its PID.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path
from types import TracebackType
from typing import Self

from kvstore.auth.security import ServerTls
from kvstore.core.ports import free_port

_LOG_TAIL_BYTES = 4000
_BIND_ATTEMPTS = 3  # fresh ports are tried again only if the chosen ones were taken meanwhile
# urllib honours http_proxy; the health probe must go straight to loopback.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


class EtcdServerError(RuntimeError):
    """etcd could not be found, did not start, or did not become healthy in time."""


def _port_in_use(port: int) -> bool:
    """Whether something listens on loopback ``port`` (TIME_WAIT leftovers do not count)."""
    with socket.socket() as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as etcd itself binds
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return True
    return False


class EtcdServer:
    """One etcd member (a cluster of one) listening on loopback.

    ``client_port``/``peer_port`` of 0 mean "pick a free port at the first start".
    Not thread-safe: one owner starts and stops it.
    """

    def __init__(
        self,
        data_dir: Path,
        *,
        client_port: int = 0,
        peer_port: int = 0,
        name: str = "kvstore-etcd",
        binary: str = "etcd",
        tls: ServerTls | None = None,
    ) -> None:
        """``tls``: serve clients over TLS with ``tls.cert``/``tls.key``; with
        ``tls.client_auth``, clients must present a certificate signed by ``tls.ca``."""
        self.tls = tls
        self.data_dir = Path(data_dir)
        self.name = name
        self.binary = binary
        self.log_path = self.data_dir.with_name(self.data_dir.name + ".log")
        self._client_port = client_port
        self._peer_port = peer_port
        # Only ports this object chose may be chosen again when they were taken meanwhile.
        self._auto_ports = client_port == 0 and peer_port == 0
        self._proc: subprocess.Popen[bytes] | None = None

    # ---- state ---------------------------------------------------------------------------

    @property
    def client_port(self) -> int:
        """The client port; 0 until the first ``start`` when it was left to choose."""
        return self._client_port

    @property
    def peer_port(self) -> int:
        return self._peer_port

    @property
    def endpoint(self) -> str:
        """``"127.0.0.1:P"``, what ``EtcdMembership`` (and any gRPC client) connects to."""
        if self._client_port == 0:
            raise EtcdServerError("etcd has no client port yet: start it first")
        return f"127.0.0.1:{self._client_port}"

    @property
    def pid(self) -> int | None:
        """PID of the running etcd process, or None when it is not running."""
        proc = self._proc
        return proc.pid if proc is not None and proc.poll() is None else None

    @property
    def running(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    # ---- lifecycle -----------------------------------------------------------------------

    def start(self, *, timeout: float = 30.0, detach: bool = False) -> None:
        """Start etcd and return once it answers ``/health`` with ``"health": "true"``.

        ``detach=True`` starts etcd in a new session so it outlives the calling process
        (and its terminal's signals). Raises ``EtcdServerError`` with the log tail if
        etcd exits or is not healthy within ``timeout`` seconds.
        """
        if self.running:
            raise EtcdServerError(f"etcd {self.name} is already running (pid {self.pid})")
        exe = shutil.which(self.binary)
        if exe is None:
            raise EtcdServerError(
                f"etcd not found ({self.binary!r} is not on PATH): "
                "run scripts/install-system-deps.sh"
            )
        for attempt in range(_BIND_ATTEMPTS):
            self._choose_ports(fresh=attempt > 0)
            # Checked first because /health on a port another etcd holds would answer "true".
            taken = [p for p in (self._client_port, self._peer_port) if _port_in_use(p)]
            if taken and self._auto_ports and attempt + 1 < _BIND_ATTEMPTS:
                continue
            if taken:
                raise EtcdServerError(f"cannot start etcd: 127.0.0.1 port(s) {taken} in use")
            try:
                self._start_once(exe, timeout=timeout, detach=detach)
                self._auto_ports = False  # from now on these are the ports, restarts included
                return
            except EtcdServerError as e:
                lost_race = "address already in use" in str(e)
                if not (lost_race and self._auto_ports and attempt + 1 < _BIND_ATTEMPTS):
                    raise

    def stop(self, timeout: float = 10.0) -> int | None:
        """SIGTERM, then SIGKILL after ``timeout`` s; returns the exit code (None if not running).

        Idempotent. Data survives in ``data_dir`` for a later ``start``/``restart``.
        """
        proc = self._proc
        if proc is None:
            return None
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        self._proc = None
        return proc.returncode

    def kill(self) -> None:
        """SIGKILL etcd at once (a crash, for tests); idempotent."""
        proc = self._proc
        if proc is None:
            return
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        self._proc = None

    def restart(self, *, timeout: float = 30.0) -> None:
        """Stop and start again on the same data directory and ports."""
        self.stop()
        self.start(timeout=timeout)

    def __enter__(self) -> Self:
        if not self.running:
            self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def log_tail(self, nbytes: int = _LOG_TAIL_BYTES) -> str:
        """The last ``nbytes`` of etcd's log (for error messages)."""
        try:
            with open(self.log_path, "rb") as f:
                f.seek(max(0, f.seek(0, os.SEEK_END) - nbytes))
                return f.read().decode("utf-8", "replace")
        except FileNotFoundError:
            return ""

    # ---- internals -----------------------------------------------------------------------

    def _choose_ports(self, *, fresh: bool) -> None:
        """Picks the ports left to choose (all again when ``fresh`` and all were chosen)."""
        if self._client_port == 0 or (fresh and self._auto_ports):
            self._client_port = free_port()
        if self._peer_port == 0 or (fresh and self._auto_ports):
            self._peer_port = free_port()
            while self._peer_port == self._client_port:
                self._peer_port = free_port()

    def _args(self, exe: str) -> list[str]:
        scheme = "https" if self.tls else "http"
        client_url = f"{scheme}://127.0.0.1:{self._client_port}"
        peer_url = f"http://127.0.0.1:{self._peer_port}"
        tls = self.tls
        tls_args = [] if tls is None else [
            f"--cert-file={tls.cert}", f"--key-file={tls.key}",
            *([f"--trusted-ca-file={tls.ca}"] if tls.ca else []),
            *(["--client-cert-auth"] if tls.client_auth else []),
        ]
        return [
            exe,
            *tls_args,
            f"--name={self.name}",
            f"--data-dir={self.data_dir}",
            f"--listen-client-urls={client_url}",
            f"--advertise-client-urls={client_url}",
            f"--listen-peer-urls={peer_url}",
            f"--initial-advertise-peer-urls={peer_url}",
            f"--initial-cluster={self.name}={peer_url}",
            "--initial-cluster-state=new",
            "--logger=zap",
            "--log-outputs=stderr",
        ]

    def _start_once(self, exe: str, *, timeout: float, detach: bool) -> None:
        self.data_dir.parent.mkdir(parents=True, exist_ok=True)
        # etcd refuses to start when an ETCD_* variable shadows one of our flags.
        env = {k: v for k, v in os.environ.items() if not k.startswith("ETCD_")}
        with open(self.log_path, "ab") as log:
            log.write(f"--- kvstore: starting {' '.join(self._args(exe))}\n".encode())
            log.flush()
            self._proc = subprocess.Popen(
                self._args(exe),
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                start_new_session=detach,
            )
        deadline = time.monotonic() + timeout
        while True:
            healthy = self._healthy()
            code = self._proc.poll()  # after the probe: the answer came while etcd ran
            if code is not None:
                self._proc = None
                raise EtcdServerError(
                    f"etcd exited with code {code} during start-up; log {self.log_path}:\n"
                    f"{self.log_tail()}"
                )
            if healthy:
                return
            if time.monotonic() > deadline:
                self.kill()
                raise EtcdServerError(
                    f"etcd not healthy within {timeout}s at {self.endpoint}; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.05)

    def _healthy(self) -> bool:
        if self.tls is not None:
            return self._healthy_tls()
        url = f"http://127.0.0.1:{self._client_port}/health"
        try:
            with _DIRECT.open(url, timeout=1.0) as resp:
                body = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return isinstance(body, dict) and body.get("health") == "true"

    def _healthy_tls(self) -> bool:
        assert self.tls is not None
        ctx = self.tls.peer().ssl_context()  # etcd's CA, and our certificate if it asks
        opener = urllib.request.build_opener(urllib.request.ProxyHandler({}),
                                             urllib.request.HTTPSHandler(context=ctx))
        try:
            with opener.open(f"https://127.0.0.1:{self._client_port}/health",
                             timeout=1.0) as resp:
                body = json.loads(resp.read())
        except (OSError, urllib.error.URLError, ValueError):
            return False
        return isinstance(body, dict) and body.get("health") == "true"
