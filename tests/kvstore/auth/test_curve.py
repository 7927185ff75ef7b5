"""kvstore.auth.curve: CURVE key files, written and read in czmq's / pyzmq's format."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest
import zmq
from zmq.auth import create_certificates, load_certificate

from kvstore.auth.curve import (
    load_keypair,
    load_public_key,
    load_public_keys,
    write_keypair,
)


def test_write_keypair_makes_a_pair_pyzmq_reads_and_a_private_secret(tmp_path: Path) -> None:
    public, secret = write_keypair(tmp_path / "new" / "dir", "router")
    assert (public.name, secret.name) == ("router.key", "router.key_secret")
    assert stat.S_IMODE(secret.stat().st_mode) == 0o600
    pub, sec = load_certificate(secret)
    assert sec is not None and zmq.curve_public(sec) == pub  # a real pair
    assert load_certificate(public) == (pub, None)
    pair = load_keypair(secret)
    assert (pair.public, pair.secret) == (pub, sec)
    assert load_public_key(public) == load_public_key(secret) == pub
    with pytest.raises(FileExistsError):
        write_keypair(tmp_path / "new" / "dir", "router")
    assert load_keypair(secret) == pair  # untouched


def test_keys_pyzmq_made_load_here(tmp_path: Path) -> None:
    public, secret = create_certificates(tmp_path, "made-by-pyzmq")
    assert load_keypair(secret).public == load_public_key(public)


def test_public_keys_of_a_file_or_a_directory(tmp_path: Path) -> None:
    a, a_secret = write_keypair(tmp_path, "a")
    b, _ = write_keypair(tmp_path, "b")
    (tmp_path / "notes.txt").write_text("not a key")
    both = load_public_keys(tmp_path)  # *.key only: the .key_secret files and notes ignored
    assert both == {load_public_key(a), load_public_key(b)}
    assert load_public_keys(a) == {load_public_key(a)}
    assert load_public_keys(a_secret) == {load_public_key(a)}


def test_bad_key_files_are_value_errors(tmp_path: Path) -> None:
    public, _ = write_keypair(tmp_path / "k", "k")
    with pytest.raises(ValueError, match="holds no secret key"):
        load_keypair(public)
    with pytest.raises(ValueError, match="not found"):
        load_public_key(tmp_path / "missing.key")
    junk = tmp_path / "junk.key"
    junk.write_text("hello\n")
    with pytest.raises(ValueError, match="no public-key"):
        load_public_key(junk)
    short = tmp_path / "short.key"
    short.write_text('curve\n    public-key = "abc"\n')
    with pytest.raises(ValueError, match="not a CURVE key"):
        load_public_key(short)
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"no \*\.key files"):
        load_public_keys(tmp_path / "empty")
    with pytest.raises(ValueError, match="plain file name"):
        write_keypair(tmp_path, "../escape")
