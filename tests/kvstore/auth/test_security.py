"""TLS, mutual TLS, bearer tokens, tenant namespaces and quotas, on real node processes."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import (
    REPO,
    NodeProcess,
    free_port,
    start_node,
    start_static_cluster,
    write_auth_file,
)

from kvstore.auth.security import ClientTls, salt_key
from kvstore.client import Client
from kvstore.core.errors import PermissionDenied, ResourceExhausted, Unauthenticated, Unavailable
from kvstore.proto import kvstore_pb2 as pb
from replication.placement.rendezvous import Member, NodeId, Placement

TOKENS = {"a": "token-of-tenant-a-0123456789", "b": "token-of-tenant-b-0123456789",
          "cluster": "token-of-the-cluster-0123456789"}
QUOTA = 100 << 10


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def _cert(d: Path, name: str, ca: str, ext: str) -> None:
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={name}", cwd=d)
    (d / f"{name}.ext").write_text(ext + "\n")
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
             "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
             cwd=d)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA with a server and a client certificate, and a rogue CA with its own client."""
    d = tmp_path_factory.mktemp("pki")
    for ca in ("ca", "rogue-ca"):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
                 "-nodes", "-keyout", f"{ca}.key", "-out", f"{ca}.pem", "-days", "2",
                 "-subj", f"/CN={ca}", cwd=d)
    # a node's certificate serves, and also identifies it when it calls its peers
    _cert(d, "server", "ca",
          "subjectAltName=IP:127.0.0.1\nextendedKeyUsage=serverAuth,clientAuth")
    _cert(d, "client", "ca", "extendedKeyUsage=clientAuth")
    _cert(d, "rogue", "rogue-ca", "extendedKeyUsage=clientAuth")
    return d


@pytest.fixture(scope="module")
def auth_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_auth_file(tmp_path_factory.mktemp("auth") / "tenants.toml",
                           {"a": TOKENS["a"], "b": TOKENS["b"]}, cluster=TOKENS["cluster"],
                           quotas={"a": QUOTA})


@pytest.fixture
def secured(tmp_path: Path, auth_file: Path) -> Iterator[NodeProcess]:
    n = start_node(tmp_path, "--auth-file", str(auth_file))
    try:
        yield n
    finally:
        n.stop()


def _key(i: int) -> bytes:
    return i.to_bytes(16, "big")


# ---- TLS ----------------------------------------------------------------------------------


def test_tls_serves_grpc_and_the_tcp_channel(tmp_path: Path, pki: Path) -> None:
    n = start_node(tmp_path, "--tls-cert", str(pki / "server.pem"),
                   "--tls-key", str(pki / "server.key"))
    try:
        tls = ClientTls(ca=str(pki / "ca.pem"))
        for transport in ("grpc", "tcp"):
            with Client(n.addr, transport=transport, tls=tls) as c:
                value = bytes(range(256)) * 4096  # 1 MiB: several TLS records
                c.put(_key(1 if transport == "grpc" else 2), value)
                assert c.get(_key(1 if transport == "grpc" else 2)) == value
                assert c.transport == transport
        with Client(n.addr, transport="grpc", timeout=5) as plain, pytest.raises(Unavailable):
            plain.get(_key(1))  # plaintext to a TLS port
        wrong = ClientTls(ca=str(pki / "rogue-ca.pem"))  # does not vouch for the server
        with Client(n.addr, transport="grpc", tls=wrong, timeout=5) as c, \
                pytest.raises(Unavailable):
            c.get(_key(1))
    finally:
        assert n.stop() == 0, n.output()


def test_mutual_tls_refuses_clients_without_a_trusted_certificate(tmp_path: Path,
                                                                  pki: Path) -> None:
    n = start_node(tmp_path, "--tls-cert", str(pki / "server.pem"),
                   "--tls-key", str(pki / "server.key"), "--tls-ca", str(pki / "ca.pem"),
                   "--tls-client-auth")
    try:
        ca = str(pki / "ca.pem")
        good = ClientTls(ca=ca, cert=str(pki / "client.pem"), key=str(pki / "client.key"))
        with Client(n.addr, transport="tcp", tls=good) as c:
            c.put(_key(1), b"secret")
            assert c.get(_key(1)) == b"secret"
        for tls in (ClientTls(ca=ca),
                    ClientTls(ca=ca, cert=str(pki / "rogue.pem"), key=str(pki / "rogue.key"))):
            with Client(n.addr, transport="grpc", tls=tls, timeout=5) as c, \
                    pytest.raises(Unavailable):
                c.exists([_key(1)])  # the handshake fails: nothing about keys comes back
    finally:
        assert n.stop() == 0, n.output()


def test_plaintext_on_a_public_address_needs_insecure(tmp_path: Path) -> None:
    out = subprocess.run([sys.executable, "-m", "kvstore", "serve", "--listen",
                          f"0.0.0.0:{free_port()}", "--dram-bytes", "8MiB", "--no-prefault"],
                         capture_output=True, text=True, cwd=REPO, timeout=60)
    assert out.returncode == 1
    assert "without TLS" in out.stderr and "--insecure" in out.stderr
    assert "Traceback" not in out.stderr


# ---- tokens and tenants ---------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_calls_without_a_valid_token_are_refused(secured: NodeProcess, transport: str) -> None:
    with Client(secured.addr, transport=transport, token=TOKENS["a"]) as a:
        a.put(_key(1), b"x" * 100)
    for token in (None, "not-a-token-of-anyone-at-all"):
        with Client(secured.addr, transport=transport, token=token) as c:
            for call in (lambda c=c: c.get(_key(1)), lambda c=c: c.exists([_key(1)]),
                         lambda c=c: c.put(_key(2), b"y"), lambda c=c: c.stats()):
                with pytest.raises(Unauthenticated):
                    call()


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_namespaces_keep_tenants_apart(secured: NodeProcess, transport: str) -> None:
    k, child = _key(10), _key(11)
    with Client(secured.addr, transport=transport, token=TOKENS["a"]) as a, \
            Client(secured.addr, transport=transport, token=TOKENS["b"]) as b, \
            Client(secured.addr, transport=transport, token=TOKENS["cluster"]) as cl:
        assert a.put(k, b"a's bytes") is True
        a.put(child, b"a's child", parent=k)
        assert b.get(k) is None and b.exists([k, child]) == [False, False]
        assert b.prefix_match([k, child]) == 0 and b.locate([k]) == [None]
        assert b.remove(k) is False
        assert b.put(k, b"b's bytes") is True  # a different block: the same name, salted
        assert a.get(k) == b"a's bytes" and b.get(k) == b"b's bytes"
        assert a.prefix_match([k, child]) == 2
        # the cluster role sees stored keys: the spec's salt, computed anywhere
        assert cl.get(k) is None
        assert cl.get(salt_key("a", k)) == b"a's bytes"
        assert cl.get(salt_key("b", k)) == b"b's bytes"


def test_shared_memory_is_only_for_the_cluster_role(secured: NodeProcess) -> None:
    with Client(secured.addr, transport="shm", token=TOKENS["a"]) as a, \
            pytest.raises(Unavailable, match="shared memory"):
        a.get(_key(1))
    with Client(secured.addr, token=TOKENS["a"]) as a:  # auto falls back to TCP
        a.put(_key(1), b"v")
        assert a.transport == "tcp"
    with Client(secured.addr, token=TOKENS["cluster"]) as cl:
        assert cl.get(salt_key("a", _key(1))) == b"v"
        assert cl.transport == "shm"


@pytest.mark.parametrize("transport", ["grpc", "tcp"])
def test_quota_is_enforced_and_freed_by_removal(secured: NodeProcess, transport: str) -> None:
    chunk = 40 << 10
    with Client(secured.addr, transport=transport, token=TOKENS["a"]) as a, \
            Client(secured.addr, transport=transport, token=TOKENS["b"]) as b:
        assert a.put(_key(1), b"1" * chunk) and a.put(_key(2), b"2" * chunk)
        with pytest.raises(ResourceExhausted, match="quota"):
            a.put(_key(3), b"3" * chunk)  # 120 KiB > 100 KiB
        assert a.get(_key(1)) == b"1" * chunk and a.get(_key(3)) is None  # nothing lost
        assert b.put(_key(3), b"3" * chunk)  # b has no quota
        assert a.remove(_key(1))
        assert a.put(_key(3), b"3" * chunk)
        used = a.stats()["node"]["namespace_bytes"]
        assert used == {"a": 2 * chunk}


def test_replication_between_secured_nodes_uses_the_peer_token(
        tmp_path: Path, auth_file: Path) -> None:
    """Replicate is the cluster's: a tenant calling it is refused, but a tenant's replicated
    put goes in one trip to its master, which forwards it under the node's own peer token,
    to its --members only; a cluster-role caller may Replicate."""
    token_file = tmp_path / "peer-token"
    token_file.write_text(TOKENS["cluster"] + "\n")
    nodes = start_static_cluster(tmp_path, 3, "--auth-file", str(auth_file),
                                 "--peer-token-file", str(token_file))
    try:
        # Ids as the nodes name each other in a static cluster: their addresses.
        members = [Member(node_id=NodeId(n.addr), addr=n.addr) for n in nodes]
        placement = Placement(members)
        by_id = {m.node_id: m.addr for m in members}
        keys = [_key(i) for i in range(20)]
        with Client(members=members, replicas=2, write_quorum=2, token=TOKENS["a"]) as a:
            assert a.put_batch(keys[:10], [bytes([i]) * 500 for i in range(10)]) == [True] * 10
        with Client(nodes[0].addr, transport="grpc", token=TOKENS["a"]) as a, \
                pytest.raises(PermissionDenied, match="cluster-role token"):
            a._grpc("Replicate", pb.ReplicateRequest(
                keys=[salt_key("a", keys[0])], targets=[nodes[1].addr], copies=2,
                write_quorum=2))
        keys = keys[10:]
        with Client(members=members, replicas=1, token=TOKENS["a"]) as a, \
                Client(members=members, token=TOKENS["b"]) as b:
            a.put_batch(keys, [bytes([i]) * 500 for i in range(10, 20)])  # on the masters only
            assert b.get_batch(keys) == [None] * 10
        for k in keys:
            master, replica = placement.owners(k, 2)
            with Client(by_id[master], transport="grpc", token=TOKENS["cluster"]) as cl:
                reply = cl._grpc("Replicate", pb.ReplicateRequest(
                    keys=[salt_key("a", k)], targets=[by_id[replica]], copies=2, write_quorum=2))
                assert (reply.copies, list(reply.stored_on)) == (2, [by_id[replica]])
        for i, k in enumerate([_key(i) for i in range(20)]):
            holders = set()
            for m, n in zip(members, nodes, strict=True):
                with Client(n.addr, token=TOKENS["cluster"]) as cl:
                    if cl.get(salt_key("a", k)) == bytes([i]) * 500:
                        holders.add(m.node_id)
            assert holders == set(placement.owners(k, 2))
    finally:
        for n in nodes:
            n.stop()


# ---- etcd over TLS ----------------------------------------------------------------------------


def test_membership_talks_to_etcd_over_mutual_tls(tmp_path: Path, pki: Path) -> None:
    from kvstore.auth.security import ServerTls
    from replication.membership import EtcdMembership, MembershipUnavailable
    from replication.membership.etcd_server import EtcdServer

    ca = str(pki / "ca.pem")
    etcd = EtcdServer(tmp_path / "etcd", tls=ServerTls(
        cert=str(pki / "server.pem"), key=str(pki / "server.key"), ca=ca, client_auth=True))
    etcd.start()
    try:
        good = ClientTls(ca=ca, cert=str(pki / "client.pem"), key=str(pki / "client.key"))
        member = Member(node_id=NodeId("n1"), addr="127.0.0.1:7600", zone="z")
        with EtcdMembership(etcd.endpoint, tls=good) as m, \
                EtcdMembership(etcd.endpoint, tls=good) as watcher:
            m.register(member, ttl=5)
            assert watcher.wait_for(lambda v: v == (member,), 10)
        for tls in (None, ClientTls(ca=ca),
                    ClientTls(ca=ca, cert=str(pki / "rogue.pem"), key=str(pki / "rogue.key"))):
            with pytest.raises(MembershipUnavailable):
                EtcdMembership(etcd.endpoint, tls=tls, timeout=2.0)
    finally:
        etcd.stop()


def test_health_probe_speaks_tls(tmp_path: Path, pki: Path) -> None:
    n = start_node(tmp_path, "--tls-cert", str(pki / "server.pem"),
                   "--tls-key", str(pki / "server.key"))
    try:
        run = [sys.executable, "-m", "kvstore", "health", "--addr", n.addr, "--timeout", "5"]
        ok = subprocess.run([*run, "--tls-ca", str(pki / "ca.pem")], capture_output=True,
                            text=True, cwd=REPO, timeout=60)
        assert ok.returncode == 0 and "SERVING" in ok.stdout, ok.stderr
        plain = subprocess.run(run, capture_output=True, text=True, cwd=REPO, timeout=60)
        assert plain.returncode == 1 and "Traceback" not in plain.stderr
    finally:
        n.stop()
