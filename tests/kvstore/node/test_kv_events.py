"""KV events from a real ``kvstore serve`` process: exact ordered events for puts,
removals, evictions and moves between tiers; gaps recovered from the replay buffer;
snapshots; a restart seen as a sequence jump and recovered by snapshot."""

from __future__ import annotations

import re
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NodeProcess, start_node, wait_until

from kvstore import Client
from kvstore.remote.kv_event_subscriber import BlockLocations, KVEventSubscriber, decode

BLOCK = 256 << 10  # four of these fill the 1 MiB DRAM tier past its high watermark
EVENTS = ("--kv-events-endpoint", "tcp://127.0.0.1:0",
          "--kv-events-replay-endpoint", "tcp://127.0.0.1:0")


def key(i: int) -> bytes:
    return bytes([i]) * 16


def endpoints(node: NodeProcess) -> tuple[str, str]:
    m = re.findall(r"kvstore: KV events on (\S+) \(replay (\S+)\)", node.output())
    assert m, node.output()
    return m[-1]


def flat(batches: list[tuple[int, bytes]]) -> list[tuple[Any, ...]]:
    """Events as tuples (type, hash, parent or medium...), across batches, in order."""
    out: list[tuple[Any, ...]] = []
    for _seq, payload in batches:
        for e in decode(payload):
            if e["type"] == "BlockStored":
                assert e["token_ids"] == [] and e["block_size"] == 0 and e["lora_id"] is None
                out.append(("S", e["block_hashes"][0], e["parent_block_hash"], e["medium"]))
            elif e["type"] == "BlockRemoved":
                out.append(("R", e["block_hashes"][0], e["medium"]))
            else:
                out.append(("C",))
    return out


def replay_all(sub: KVEventSubscriber, first: int, n_events: int) -> list[tuple[int, bytes]]:
    """The node's buffered batches from ``first`` once they hold ``n_events`` events (the
    publisher thread sends shortly after each change: polled, across processes)."""
    got: list[tuple[int, bytes]] = []

    def enough() -> bool:
        nonlocal got
        got = sub.replay(first)
        return len(flat(got)) >= n_events

    wait_until(enough, what=f"{n_events} KV events")
    assert [s for s, _ in got] == list(range(first, first + len(got)))  # no gaps
    return got


@pytest.fixture
def dram_node(tmp_path: Path) -> Iterator[tuple[NodeProcess, KVEventSubscriber, float]]:
    before = time.time()
    node = start_node(tmp_path, *EVENTS, dram="1MiB")
    sub = KVEventSubscriber(*endpoints(node))
    try:
        yield node, sub, before
    finally:
        sub.close()
        code = node.stop()
    assert code == 0, node.output()


def test_put_remove_evict_in_order(dram_node: tuple[NodeProcess, KVEventSubscriber, float]
                                   ) -> None:
    node, sub, before = dram_node
    start, payload = sub.snapshot()  # nothing but the start batch is out yet
    assert before * 1e6 <= start <= time.time() * 1e6  # the seq base is the start time
    assert flat([(start, payload)]) == [("C",)]
    with Client(node.addr, transport="grpc") as c:
        assert c.put(key(1), b"a" * BLOCK)
        assert c.put(key(2), b"b" * BLOCK, parent=key(1))
        assert c.put(key(3), b"c" * BLOCK, parent=key(2))
        assert not c.put(key(3), b"c" * BLOCK, parent=key(2))  # already stored: no event
        assert c.remove(key(2))
        assert not c.remove(key(2))
        assert c.put(key(4), b"d" * BLOCK)
        # 1 MiB used > 95%: LRU evicts key 1 (the oldest) before key 5 is committed.
        assert c.put(key(5), b"e" * BLOCK)
    batches = replay_all(sub, start, 8)
    assert flat(batches) == [
        ("C",),
        ("S", key(1), None, "CPU"),
        ("S", key(2), key(1), "CPU"),
        ("S", key(3), key(2), "CPU"),
        ("R", key(2), "CPU"),
        ("S", key(4), None, "CPU"),
        ("R", key(1), "CPU"),
        ("S", key(5), None, "CPU"),
    ]
    seq, snap = sub.snapshot()
    assert seq == batches[-1][0]  # the state as of the last published batch
    # All three are chain roots here (key 3's parent was removed): in the index's slot
    # order, which says nothing of when a block came (parents_first, below).
    got = flat([(seq, snap)])
    assert got[0] == ("C",)
    assert sorted(got[1:]) == [("S", key(3), key(2), "CPU"), ("S", key(4), None, "CPU"),
                               ("S", key(5), None, "CPU")]


def join(sub: KVEventSubscriber, c: Client, state: BlockLocations, probes: list[bytes],
         *, after: int = -1) -> tuple[int, bytes]:
    """Puts probe blocks until the SUB socket receives a batch after seq ``after`` (a new
    subscription reaches the publisher asynchronously); what it missed, ``follow``
    recovers. Batches queued before (``after`` or older) are applied or skipped."""
    for i in range(100, 200):
        probes.append(key(i))
        c.put(key(i), b"p")
        while (got := sub.follow(state, timeout=0.2)) is not None:
            if got[0] > after:
                return got
    raise AssertionError("the subscription never reached the publisher")


def test_gap_recovered_from_replay_buffer_then_by_snapshot(
        dram_node: tuple[NodeProcess, KVEventSubscriber, float]) -> None:
    node, sub, _ = dram_node  # ``sub`` only asks for snapshots and replays here
    state = BlockLocations()
    state.apply(*sub.snapshot())
    assert state.media == {}
    with Client(node.addr, transport="grpc") as c:
        # Missed by the subscriber (it is not listening yet): a gap it must detect.
        c.put(key(1), b"a" * 1000)
        c.put(key(2), b"b" * 1000, parent=key(1))
        c.remove(key(1))
        behind = state.last_seq
        # Published before the late subscriber joins (events wait up to flush_interval_s to
        # share a batch, so the probe below could otherwise land in the same batch).
        deadline = time.monotonic() + 10.0
        while c.stats()["node"]["kv_events_seq"] <= behind:
            assert time.monotonic() < deadline, "the missed events were never published"
        probes: list[bytes] = []
        late = KVEventSubscriber(*endpoints(node))  # subscribes only now
        try:
            seq, _ = join(late, c, state, probes)
        finally:
            late.close()
        assert seq > behind + 1  # a real gap
        truth = {key(2): {"CPU"}} | {p: {"CPU"} for p in probes}
        # The replay that closed the gap runs to the newest batch the node holds, which may
        # be past the live batch ``join`` returned (a later probe's, on a loaded machine).
        assert state.media == truth and state.last_seq >= seq
        # Far behind the replay buffer (or another process of the node): a snapshot.
        stale = BlockLocations(media={key(7): {"GPU"}}, last_seq=5)
        c.put(key(3), b"c" * 1000)
        got = sub.follow(stale, timeout=10.0)
        assert got is not None
        truth[key(3)] = {"CPU"}
        assert stale.media == truth
        assert stale.last_seq >= got[0]


def test_malformed_replay_request_gets_the_end_marker(
        dram_node: tuple[NodeProcess, KVEventSubscriber, float]) -> None:
    import zmq

    from kvstore.protocol.kv_event_wire import END_SEQ

    node, _, _ = dram_node
    ctx = zmq.Context()
    try:
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(endpoints(node)[1])
        dealer.send_multipart((b"", b"\x01\x02"))  # not 8 bytes
        assert dealer.poll(10_000)
        assert dealer.recv_multipart() == [b"", b"", END_SEQ, b""]
    finally:
        ctx.destroy(linger=0)
    assert "malformed KV event replay request" in node.output()


def test_queue_overflow_drops_events_then_resyncs() -> None:
    """A full queue never blocks a put: its events are dropped and the next batch is a
    resync (AllBlocksCleared, then every block). The publisher thread is held inside its
    clock (asked once per batch) so the queue fills deterministically."""
    import threading

    from kvstore.node.kv_events import KVEventPublisher, KVEventSettings
    from kvstore.node.semantics import Node, NodeSettings

    calls = 0
    entered, release = threading.Event(), threading.Event()

    def clock() -> float:
        nonlocal calls
        calls += 1
        if calls == 3:  # 1: the seq base, 2: the start resync, 3: the first live batch
            entered.set()
            assert release.wait(10.0)
        return 1000.0 + calls

    node = Node(NodeSettings(dram_bytes=1 << 20, prefault=False))
    pub = KVEventPublisher(node, KVEventSettings(endpoint="tcp://127.0.0.1:0",
                                                 replay_endpoint="tcp://127.0.0.1:0",
                                                 max_queue=2), clock=clock)
    sub = KVEventSubscriber(pub.endpoint, pub.replay_endpoint)
    try:
        assert pub.ready.wait(10.0)
        node.put(key(1), memoryview(b"a" * 100))
        assert entered.wait(10.0)  # the thread is sending [key 1]; the queue is empty
        node.put(key(2), memoryview(b"b" * 100))
        node.put(key(3), memoryview(b"c" * 100), parent=key(2))  # the queue is full now
        node.put(key(4), memoryview(b"d" * 100))  # dropped, and does not wait
        assert node.remove(key(2))  # dropped too: the resync replaces it
        release.set()
        base = 1001 * 1_000_000
        batches = replay_all(sub, base, 1 + 1 + 4)
        # The events still queued when the loss was seen (keys 2, 3) are superseded too.
        assert [s for s, _ in batches] == [base, base + 1, base + 2]
        assert flat(batches) == [
            ("C",),
            ("S", key(1), None, "CPU"),
            ("C",), ("S", key(1), None, "CPU"), ("S", key(3), key(2), "CPU"),
            ("S", key(4), None, "CPU"),
        ]
        info = node.stats()["node"]
        assert (info["kv_events_seq"], info["kv_events_resyncs"]) == (base + 2, 2)
    finally:
        release.set()
        sub.close()
        pub.close()
        node.close()


def test_moves_between_tiers_and_a_restart(tmp_path: Path) -> None:
    """DRAM -> SSD demotion is BlockStored(STORAGE) then BlockRemoved(CPU); after a
    restart the first batch clears and lists the recovered blocks, and a subscriber that
    followed the old process recovers by snapshot through the same sockets."""
    from conftest import free_port

    pub_port, replay_port = free_port(), free_port()
    args = ("--ssd-path", str(tmp_path / "kv.img"), "--ssd-bytes", "8MiB", "--ssd-io", "python",
            "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
            "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}")
    node = start_node(tmp_path, *args, dram="1MiB")
    sub = KVEventSubscriber(*endpoints(node))
    try:
        state = BlockLocations()
        base, payload = sub.snapshot()
        state.apply(base, payload)
        with Client(node.addr, transport="grpc") as c:
            for i in (1, 2, 3, 4):  # the 4th passes the high watermark: the mover demotes 1
                assert c.put(key(i), bytes([i]) * BLOCK)
        batches = replay_all(sub, base, 7)
        events = flat(batches)
        assert events[:4] == [("C",), ("S", key(1), None, "CPU"), ("S", key(2), None, "CPU"),
                              ("S", key(3), None, "CPU")]
        move = [("S", key(1), None, "STORAGE"), ("R", key(1), "CPU")]
        put4 = [("S", key(4), None, "CPU")]
        assert events[4:] in (put4 + move, move + put4)  # the mover runs beside the put
        for seq, p in batches[1:]:
            state.apply(seq, p)
        assert state.media == {key(1): {"STORAGE"}, key(2): {"CPU"}, key(3): {"CPU"},
                               key(4): {"CPU"}}
        old_last = state.last_seq
        assert node.stop() == 0, node.output()

        node = start_node(tmp_path, *args, dram="1MiB")
        assert "1 blocks recovered" in node.output()
        first, snap = sub.snapshot()  # the same sockets reconnect to the new process
        assert first > old_last + 1  # a restart jumps the sequence: a gap to subscribers
        assert flat([(first, snap)]) == [("C",), ("S", key(1), None, "STORAGE")]
        with Client(node.addr, transport="grpc") as c:
            probes: list[bytes] = []
            join(sub, c, state, probes, after=old_last)
        # The gap took ``follow`` to the replay endpoint, which had nothing from old_last + 1
        # (another process): a snapshot, so the lost DRAM blocks are gone from the state.
        assert state.media == {key(1): {"STORAGE"}} | {p: {"CPU"} for p in probes}
    finally:
        sub.close()
        code = node.stop()
    assert code == 0, node.output()


def test_bad_endpoints_are_cli_errors(tmp_path: Path) -> None:
    import socket
    import subprocess
    import sys

    from conftest import REPO, free_port

    def serve(*flags: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen",
                               f"127.0.0.1:{free_port()}", "--dram-bytes", "1MiB",
                               "--no-prefault", *flags],
                              capture_output=True, cwd=REPO, timeout=60, text=True)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        (line,) = proc.stderr.splitlines()
        return line

    assert serve("--kv-events-endpoint", "udp://127.0.0.1:5557") == (
        "kvstore serve: error: kv_events_endpoint must be tcp://HOST:PORT (or ipc://PATH), "
        "got 'udp://127.0.0.1:5557'")
    assert serve("--kv-events-endpoint", "tcp://127.0.0.1:5557",
                 "--kv-events-replay-endpoint", "tcp://127.0.0.1") == (
        "kvstore serve: error: kv_events_replay_endpoint must be tcp://HOST:PORT (or "
        "ipc://PATH), got 'tcp://127.0.0.1'")
    assert serve("--kv-events-replay-endpoint", "tcp://127.0.0.1:5558") == (
        "kvstore serve: error: kv_events_replay_endpoint needs kv_events_endpoint")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        line = serve("--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
        assert line.startswith("kvstore serve: error: cannot bind KV events endpoint: "
                               "Address already in use"), line


def keygen(where: Path, name: str) -> tuple[Path, Path]:
    """``kvstore kv-events keygen``, as an operator runs it: (public .key, .key_secret)."""
    import subprocess
    import sys

    from conftest import REPO

    proc = subprocess.run([sys.executable, "-m", "kvstore", "kv-events", "keygen", str(where),
                           "--name", name], capture_output=True, cwd=REPO, timeout=60, text=True)
    assert proc.returncode == 0, proc.stderr
    return where / f"{name}.key", where / f"{name}.key_secret"


def handshake_refused(ctx: Any, endpoint: str, curve: dict[int, bytes]) -> Any:
    """A raw SUB socket connected to ``endpoint`` with these CURVE options (none: plain
    ZeroMQ), returned once its monitor reports a failed handshake: the node refused it."""
    import zmq
    from zmq.utils.monitor import recv_monitor_message

    sock = ctx.socket(zmq.SUB)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SUBSCRIBE, b"")
    for opt, value in curve.items():
        sock.setsockopt(opt, value)
    monitor = sock.get_monitor_socket()
    sock.connect(endpoint)
    failed = {zmq.EVENT_HANDSHAKE_FAILED_AUTH, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
              zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL}
    while True:
        assert monitor.poll(10_000), f"no handshake outcome from {endpoint}"
        event = recv_monitor_message(monitor)["event"]
        assert event != zmq.EVENT_HANDSHAKE_SUCCEEDED, f"admitted with {curve}"
        if event in failed:
            return sock


def test_curve_admits_only_the_listed_subscriber_keys(tmp_path: Path) -> None:
    """A node bound on every interface with CURVE keys: a subscriber without keys and one
    whose key the node does not list both fail their handshakes and receive nothing (nor
    replays); the listed one receives exactly the events."""
    import zmq
    from zmq.auth import load_certificate

    node_pub, node_secret = keygen(tmp_path / "node", "node")
    router_pub, router_secret = keygen(tmp_path / "router", "router")
    _, intruder_secret = keygen(tmp_path / "intruder", "intruder")
    admitted = tmp_path / "admitted"
    admitted.mkdir()
    (admitted / "router.key").write_bytes(router_pub.read_bytes())
    node = start_node(tmp_path, "--kv-events-endpoint", "tcp://*:0",
                      "--kv-events-replay-endpoint", "tcp://*:0",
                      "--kv-events-secret-key", str(node_secret),
                      "--kv-events-client-keys", str(admitted), dram="1MiB")
    pub, replay = (e.replace("0.0.0.0", "127.0.0.1") for e in endpoints(node))
    assert ", CURVE" in node.output()
    server_key = load_certificate(node_pub)[0]
    intruder = dict(zip(("public", "secret"), load_certificate(intruder_secret), strict=True))
    ctx = zmq.Context()
    good = KVEventSubscriber(pub, replay, secret_key=str(router_secret),
                             server_key=str(node_pub))
    try:
        open_sub = handshake_refused(ctx, pub, {})
        bad_sub = handshake_refused(ctx, pub, {zmq.CURVE_SERVERKEY: server_key,
                                               zmq.CURVE_PUBLICKEY: intruder["public"],
                                               zmq.CURVE_SECRETKEY: intruder["secret"]})
        for curve in ({}, {"secret_key": str(intruder_secret), "server_key": str(node_pub)}):
            nosy = KVEventSubscriber(pub, replay, **curve)
            try:
                with pytest.raises(TimeoutError):
                    nosy.replay(0, timeout=1.0)
            finally:
                nosy.close()
        start, payload = good.snapshot()
        assert flat([(start, payload)]) == [("C",)]
        state = BlockLocations()
        state.apply(start, payload)
        with Client(node.addr, transport="grpc") as c:
            probes: list[bytes] = []
            join(good, c, state, probes)
            c.put(key(1), b"a" * 1000)
            c.put(key(2), b"b" * 1000, parent=key(1))
            assert c.remove(key(1))
            denied = c.stats()["node"]["kv_events_denied"]
        live: list[tuple[int, bytes]] = []
        while len(flat(live)) < 3:
            got = good.recv(timeout=10.0)
            assert got is not None, flat(live)
            live.append(got)
        assert flat(live) == [("S", key(1), None, "CPU"), ("S", key(2), key(1), "CPU"),
                              ("R", key(1), "CPU")]
        assert flat(replay_all(good, start, 1 + len(probes) + 3)) == (
            [("C",)] + [("S", p, None, "CPU") for p in probes]
            + [("S", key(1), None, "CPU"), ("S", key(2), key(1), "CPU"), ("R", key(1), "CPU")])
        # Everything above was published after both refusals: none of it reached them.
        assert not open_sub.poll(0) and not bad_sub.poll(0)
        assert denied >= 2  # the intruder's SUB and replay sockets at least
        assert (f"refused a connection with an unknown CURVE client key "
                f"{intruder['public'].decode()}") in node.output()
    finally:
        ctx.destroy(linger=0)
        good.close()
        code = node.stop()
    assert code == 0, node.output()


def test_exposed_binds_need_keys_or_insecure(tmp_path: Path) -> None:
    """Past loopback (every interface, ``tcp://*``, or another address) the sockets need
    CURVE keys, or ``--insecure``; key flags are checked before anything binds."""
    import subprocess
    import sys

    from conftest import REPO, free_port

    def serve(*flags: str) -> str:
        proc = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen",
                               f"127.0.0.1:{free_port()}", "--dram-bytes", "1MiB",
                               "--no-prefault", *flags],
                              capture_output=True, cwd=REPO, timeout=60, text=True)
        assert proc.returncode == 1, proc.stderr
        assert "Traceback" not in proc.stderr + proc.stdout, proc.stderr
        (line,) = proc.stderr.splitlines()
        return line

    refused = ("kvstore serve: error: refusing to serve KV events on {} without "
               "authentication: bind a loopback address, give --kv-events-secret-key and "
               "--kv-events-client-keys (CURVE), or --insecure to accept anyone who can "
               "connect")
    assert serve("--kv-events-endpoint", "tcp://*:0") == refused.format("tcp://*:0")
    assert serve("--kv-events-endpoint", "tcp://0.0.0.0:0") == refused.format("tcp://0.0.0.0:0")
    assert serve("--kv-events-endpoint", "tcp://127.0.0.1:0",
                 "--kv-events-replay-endpoint", "tcp://*:0") == refused.format("tcp://*:0")
    pub, secret = keygen(tmp_path / "keys", "node")
    assert serve("--kv-events-endpoint", "tcp://*:0", "--kv-events-secret-key", str(secret)) == (
        "kvstore serve: error: kv_events_secret_key and kv_events_client_keys go together "
        "(CURVE: the node's secret key and the clients it admits)")
    assert serve("--kv-events-endpoint", "tcp://*:0", "--kv-events-secret-key", str(pub),
                 "--kv-events-client-keys", str(pub)) == (
        f"kvstore serve: error: {pub} holds no secret key: give the .key_secret file")
    empty = tmp_path / "empty"
    empty.mkdir()
    assert serve("--kv-events-endpoint", "tcp://*:0", "--kv-events-secret-key", str(secret),
                 "--kv-events-client-keys", str(empty)) == (
        f"kvstore serve: error: no *.key files (CURVE public keys) in {empty}")
    node = start_node(tmp_path, "--kv-events-endpoint", "tcp://*:0", "--insecure")
    try:
        assert re.search(r"kvstore: KV events on tcp://0\.0\.0\.0:\d+\n", node.output())
    finally:
        code = node.stop()
    assert code == 0, node.output()


def test_a_snapshot_lists_every_block_after_its_parent() -> None:
    from kvstore.node.kv_events import parents_first

    a, b, c, d, x = (key(i) for i in (1, 2, 3, 4, 9))
    # Slot order put the chain a <- b <- c backwards and d's parent is not stored.
    blocks = [(c, b, 0), (d, x, 1), (b, a, 0), (a, None, 0)]
    assert parents_first(blocks) == [(d, x, 1), (a, None, 0), (b, a, 0), (c, b, 0)]
    assert parents_first([]) == []
