"""Real etcd for tests: the ``etcd`` and ``member_process`` fixtures.

Use from a test module with ``pytest_plugins = ["etcd_fixtures"]`` and test parameters
named ``etcd`` (a started ``EtcdServer``) and/or ``member_process`` (starts child processes
that each hold one registration). Test modules need not import this file; for annotations,
import it under ``TYPE_CHECKING`` (importing it at run time too defeats pytest's assertion
rewriting of it).

Run as a script (``python etcd_fixtures.py ENDPOINT MEMBER_JSON TTL``), this file is that
child: it registers the member, prints ``registered``, and keeps the lease alive until it is
signalled, so tests can SIGKILL or SIGSTOP a live registration. SIGTERM makes it leave.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

# Run as a script (a member child), this file's folder is first on sys.path, and tests/
# mirrors the source tree (tests/replication/ is a namespace folder): the repository root
# must come first so ``replication`` is the real package.
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from replication.membership import (
    EtcdMembership,
    decode_member,
    encode_member,
)
from replication.membership.etcd_server import EtcdServer
from replication.placement.rendezvous import Member

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture
def etcd(tmp_path: Path) -> Iterator[EtcdServer]:
    """A fresh single-member etcd on free loopback ports, data in ``tmp_path``; stopped after."""
    server = EtcdServer(tmp_path / "etcd")
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass(slots=True, kw_only=True)
class MemberProcess:
    """A child process holding one registration (see ``start_member_process``)."""

    member: Member
    proc: subprocess.Popen[bytes]
    log: Path

    def send(self, sig: int) -> None:
        """Signals the child (by its PID); a no-op once it has exited."""
        if self.proc.poll() is None:
            os.kill(self.proc.pid, sig)

    def stop(self) -> None:
        """Ends the child however it is (SIGCONT first, in case it is stopped), then reaps it."""
        self.send(signal.SIGKILL)
        self.send(signal.SIGCONT)
        self.proc.wait(10)

    def output(self) -> str:
        return self.log.read_text(errors="replace")


def start_member_process(endpoint: str, member: Member, *, ttl: int, log_dir: Path,
                         ready_timeout: float = 20.0) -> MemberProcess:
    """Starts a child that registers ``member`` at ``endpoint``; returns once it has."""
    log = log_dir / f"member-{member.node_id}.log"
    args = [sys.executable, str(Path(__file__).resolve()), endpoint,
            encode_member(member).decode(), str(ttl)]
    with open(log, "wb") as out:
        proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=out,
                                stderr=subprocess.STDOUT, cwd=REPO,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
    child = MemberProcess(member=member, proc=proc, log=log)
    deadline = time.monotonic() + ready_timeout
    while "registered" not in child.output():
        if proc.poll() is not None or time.monotonic() > deadline:
            child.stop()
            raise RuntimeError(f"member child did not register:\n{child.output()}")
        time.sleep(0.02)
    return child


StartMember = Callable[[Member, int], MemberProcess]


@pytest.fixture
def member_process(etcd: EtcdServer, tmp_path: Path) -> Iterator[StartMember]:
    """``start(member, ttl)``: a registered child process on ``etcd``; all are killed after."""
    children: list[MemberProcess] = []

    def start(member: Member, ttl: int) -> MemberProcess:
        child = start_member_process(etcd.endpoint, member, ttl=ttl, log_dir=tmp_path)
        children.append(child)
        return child

    yield start
    for child in children:
        child.stop()


def _child_main(endpoint: str, member_json: str, ttl: str) -> None:
    logging.basicConfig(level=logging.INFO, stream=sys.stderr,
                        format="%(asctime)s %(name)s %(levelname)s %(message)s")
    node_id = json.loads(member_json)["node_id"]
    member = decode_member(node_id, member_json.encode())
    membership = EtcdMembership(endpoint)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))  # SIGTERM leaves cleanly
    try:
        membership.register(member, ttl=int(ttl))
        print("registered", flush=True)
        threading.Event().wait()
    finally:
        membership.close()


if __name__ == "__main__":
    _child_main(*sys.argv[1:])
