"""ZeroMQ CURVE key files, for the KV event sockets (``kvstore/node/kv_events.py``).

CURVE (``zmq_curve(7)``) encrypts a ZeroMQ connection and authenticates both ends by
Curve25519 keys: the client must know the server's public key, and the server admits a
client only if a ZAP handler accepts the client's public key. A key is 32 bytes,
written as 40 characters of Z85.

Files are the ZPL certificates of czmq and pyzmq (``zmq.auth.load_certificate`` reads
them), so keys made by either tool work here:

* ``NAME.key``: the public key (``public-key = "..."`` in a ``curve`` section), safe to
  hand out;
* ``NAME.key_secret``: the public and the secret key; ``write_keypair`` creates it
  readable by its owner only (mode 0600), and never overwrites an existing file.

A node takes its own ``.key_secret`` file and the public keys of the clients it admits:
one ``.key`` file, or a directory whose ``*.key`` files are read (czmq's convention;
``.key_secret`` files in it are ignored). A subscriber takes its own ``.key_secret`` and
the node's public ``.key``.

pyzmq is imported only when keys are made or read (the ``events`` extra).
"""

from __future__ import annotations

import datetime
import os
from dataclasses import dataclass
from pathlib import Path

KEY_CHARS = 40
"""A CURVE key in Z85: 32 bytes as 40 characters."""


@dataclass(frozen=True, slots=True, kw_only=True)
class KeyPair:
    public: bytes  # Z85, 40 bytes
    secret: bytes  # Z85, 40 bytes


def _check_z85(key: bytes, what: str, path: str | Path) -> bytes:
    from zmq.utils import z85

    try:
        ok = len(key) == KEY_CHARS and len(z85.decode(key)) == 32
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise ValueError(f"{path}: the {what} key is not a CURVE key (40 Z85 characters)")
    return key


def _load(path: str | Path) -> tuple[bytes, bytes | None]:
    from zmq.auth import load_certificate

    if not Path(path).is_file():
        raise ValueError(f"CURVE key file not found: {path}")
    try:
        public, secret = load_certificate(path)
    except ValueError:
        raise ValueError(f"{path}: no public-key in this CURVE key file") from None
    return (_check_z85(public, "public", path),
            None if secret is None else _check_z85(secret, "secret", path))


def load_keypair(path: str | Path) -> KeyPair:
    """A ``.key_secret`` file's public and secret keys; ValueError if it has no secret."""
    public, secret = _load(path)
    if secret is None:
        raise ValueError(f"{path} holds no secret key: give the .key_secret file")
    return KeyPair(public=public, secret=secret)


def load_public_key(path: str | Path) -> bytes:
    """The public key of a ``.key`` (or ``.key_secret``) file."""
    return _load(path)[0]


def load_public_keys(path: str | Path) -> frozenset[bytes]:
    """The public keys of one key file, or of every ``*.key`` file in a directory;
    ValueError if there are none (a node that admits no one is a mistake, not a setting)."""
    p = Path(path)
    if p.is_dir():
        keys = frozenset(load_public_key(f) for f in sorted(p.glob("*.key")) if f.is_file())
        if not keys:
            raise ValueError(f"no *.key files (CURVE public keys) in {path}")
        return keys
    return frozenset({load_public_key(p)})


_BANNER = ("#   ****  Generated on {when} by kvstore  ****\n"
           "#   ZeroMQ CURVE {kind} Certificate\n"
           "#   {advice}\n\n")


def _write(path: Path, kind: str, advice: str, body: str, mode: int) -> None:
    text = (_BANNER.format(when=datetime.datetime.now().isoformat(timespec="seconds"),
                           kind=kind, advice=advice) + "metadata\ncurve\n" + body)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)


def write_keypair(directory: str | Path, name: str) -> tuple[Path, Path]:
    """Creates ``directory/NAME.key`` (public, mode 0644) and ``NAME.key_secret`` (0600)
    from a fresh key pair; FileExistsError if either exists. Returns both paths."""
    import zmq

    if not name or "/" in name or name.startswith("."):
        raise ValueError(f"key name must be a plain file name, got {name!r}")
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    public_file, secret_file = d / f"{name}.key", d / f"{name}.key_secret"
    for p in (public_file, secret_file):
        if p.exists():
            raise FileExistsError(f"{p} exists: not overwriting a key")
    public, secret = zmq.curve_keypair()
    # The secret first: a crash between the two leaves no public key without its secret.
    _write(secret_file, "Secret", "DO NOT PROVIDE THIS FILE TO OTHER USERS nor change its "
           "permissions.", f'    public-key = "{public.decode()}"\n'
           f'    secret-key = "{secret.decode()}"\n', 0o600)
    _write(public_file, "Public", "Exchange securely, or verify its contents after the "
           "exchange.", f'    public-key = "{public.decode()}"\n', 0o644)
    return public_file, secret_file
