"""What makes the SSD tier's data region readable without its index: block headers, and the
witness file beside the index.

Block header (format 2)
-----------------------
Every block written by format 2 starts with one page (:data:`HEADER_BYTES`) before its
value: magic, key, parent, value length, extent length, the value's xxh3-64 checksum, the
write's sequence number, the retention it was written with, and a keyed BLAKE2b MAC of
all of them. The rest of the page is zeros. A scan of the region (:mod:`tiers.ssd.scan`)
finds blocks by their headers; the MAC is what lets it trust one: a tenant's value can
hold bytes that look like a header (it chooses them), but without the node's key it
cannot make one that verifies, so a rebuild can never index attacker-chosen bytes under
another key. Deleting a block zeroes its header page before its space is reused.

Witness file (``<index>.witness``)
----------------------------------
48 bytes: magic, the MAC key (32 random bytes, made once, written atomically), and the
highest sequence number whose write was acknowledged (rewritten in place after each
write batch's index entries are durable; not synced). Two jobs: it holds the key a
rebuild needs, and it witnesses the index: an index whose highest sequence number is
below the witness's lost entries it had acknowledged (RocksDB's own recovery reads a
cut write-ahead log or manifest as an older, consistent database and says nothing).
Since the witness is updated only after the index write returned, it is never ahead of
an intact index; a lost witness update (power loss) only weakens the check.
"""

from __future__ import annotations

import hashlib
import os
import secrets
import struct
from dataclasses import dataclass

from kvstore.core.keys import KEY_BYTES, BlockKey
from tiers.ssd.types import HEADER_BYTES, Retention

MAGIC = b"KVSBLK2\n"
# magic, has_parent, key, parent, value length, extent length, checksum, seq,
# retention deadline (wall clock; 0: none), retention seconds.
_FIELDS = struct.Struct("<8sB7x16s16sQQQQdd")
_MAC_BYTES = 32
HEADER_USED = _FIELDS.size + _MAC_BYTES  # the header's bytes; the rest of its page is zero
_NO_PARENT = bytes(KEY_BYTES)

_WITNESS_MAGIC = b"KVSWIT1\n"
_WITNESS = struct.Struct("<8s32sQ")
_ACKED_AT = 40  # offset of the acknowledged sequence number in the witness file
_U64 = struct.Struct("<Q")
KEY_LEN = 32

assert HEADER_USED <= HEADER_BYTES


@dataclass(frozen=True, slots=True, kw_only=True)
class BlockHeader:
    """One verified block header."""

    key: BlockKey
    parent: BlockKey | None
    nbytes: int
    extent_length: int
    checksum: int
    seq: int
    retention: Retention | None


def _mac(mac_key: bytes, fields: bytes) -> bytes:
    return hashlib.blake2b(fields, key=mac_key, digest_size=_MAC_BYTES).digest()


def encode_header(mac_key: bytes, into: memoryview, *, key: bytes, parent: bytes | None,
                  nbytes: int, extent_length: int, checksum: int, seq: int,
                  retention: Retention | None) -> None:
    """Writes the header page of one block into ``into`` (HEADER_BYTES, zeros after it)."""
    until, seconds = (retention.until, retention.seconds) if retention is not None else (0, 0)
    fields = _FIELDS.pack(MAGIC, parent is not None, bytes(key),
                          bytes(parent) if parent is not None else _NO_PARENT, nbytes,
                          extent_length, checksum, seq, until, seconds)
    into[:_FIELDS.size] = fields
    into[_FIELDS.size:HEADER_USED] = _mac(mac_key, fields)
    into[HEADER_USED:HEADER_BYTES] = bytes(HEADER_BYTES - HEADER_USED)


def decode_header(mac_key: bytes, page: memoryview | bytes) -> BlockHeader | None:
    """The header at the start of ``page``, or None if there is none or it fails its MAC."""
    if bytes(page[:len(MAGIC)]) != MAGIC:
        return None
    fields = bytes(page[:_FIELDS.size])
    if not secrets.compare_digest(bytes(page[_FIELDS.size:HEADER_USED]),
                                  _mac(mac_key, fields)):
        return None
    (_, has_parent, key, parent, nbytes, extent_length, checksum, seq, until,
     seconds) = _FIELDS.unpack(fields)
    return BlockHeader(key=BlockKey(key), parent=BlockKey(parent) if has_parent else None,
                       nbytes=nbytes, extent_length=extent_length, checksum=checksum, seq=seq,
                       retention=Retention(until=until, seconds=seconds) if until else None)


def looks_like_header(page: memoryview | bytes) -> bool:
    """Whether ``page`` starts with the magic (verified or not)."""
    return bytes(page[:len(MAGIC)]) == MAGIC


class Witness:
    """The open witness file (see the module docstring). Not thread-safe: the tier calls
    :meth:`record` under its lock."""

    def __init__(self, path: str, fd: int, mac_key: bytes, acked: int) -> None:
        self.path = path
        self._fd = fd
        self.mac_key = mac_key
        self.acked = acked

    @classmethod
    def load(cls, path: str) -> Witness | None:
        """The witness at ``path``; None if there is none or it is unreadable."""
        try:
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        except FileNotFoundError:
            return None
        raw = os.pread(fd, _WITNESS.size, 0)
        if len(raw) != _WITNESS.size or raw[:len(_WITNESS_MAGIC)] != _WITNESS_MAGIC:
            os.close(fd)
            return None
        _, mac_key, acked = _WITNESS.unpack(raw)
        return cls(path, fd, mac_key, acked)

    @classmethod
    def create(cls, path: str, acked: int) -> Witness:
        """A new witness with a fresh key, written atomically and durably (it replaces an
        unreadable one)."""
        mac_key = secrets.token_bytes(KEY_LEN)
        tmp = path + ".tmp"
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, _WITNESS.pack(_WITNESS_MAGIC, mac_key, acked))
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        dfd = os.open(os.path.dirname(os.path.abspath(path)),
                      os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        loaded = cls.load(path)
        assert loaded is not None
        return loaded

    def record(self, seq: int) -> None:
        """Notes that writes up to ``seq`` were acknowledged (page cache: a process crash
        keeps it, a power loss may not)."""
        if seq > self.acked:
            self.acked = seq
            os.pwrite(self._fd, _U64.pack(seq), _ACKED_AT)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1
