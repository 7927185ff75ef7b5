"""The SSD tier's data region: checking, creating, sizing and opening the file or block device.

The region carries no header: every byte of it belongs to blocks. Invariants:

* A regular file is never shrunk: a file larger than the capacity is another
  configuration's data, and truncating it would destroy blocks.
* A created or grown file is made durable (``fsync`` of the file, and of its directory
  when the file is new) before the tier writes a format record promising its size.
* Data goes through ``O_DIRECT`` when the filesystem honours it; one that refuses it
  (``EINVAL``, at open or on the first aligned read) gets a buffered descriptor, and
  :func:`open_data` says why.
"""

from __future__ import annotations

import errno
import os
import stat

from tiers.ssd.buffers import ArenaPool
from tiers.ssd.types import ALIGNMENT, SsdFormatError


def probe_region(path: str, capacity: int) -> tuple[bool, bool]:
    """(``path`` is a block device, ``path`` does not exist yet); raises SsdFormatError for
    a regular file larger than ``capacity``. Changes nothing on disk."""
    try:
        st: os.stat_result | None = os.stat(path)
    except FileNotFoundError:
        st = None
    is_block_device = st is not None and stat.S_ISBLK(st.st_mode)
    if st is not None and not is_block_device and st.st_size > capacity:
        # Never shrink: a larger file is another configuration's data; truncating
        # it would destroy blocks.
        raise SsdFormatError(
            f"{path} is {st.st_size} bytes, larger than capacity {capacity}; "
            "refusing to truncate it")
    return is_block_device, st is None


def size_region(path: str, capacity: int, *, block_device: bool, created: bool,
                preallocate: bool) -> None:
    """Makes the region at least ``capacity`` bytes, durably (a device must already be)."""
    # Size the region with a plain descriptor.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
    try:
        if block_device:
            device_size = os.lseek(fd, 0, os.SEEK_END)
            if capacity > device_size:
                raise ValueError(
                    f"capacity {capacity} exceeds the size of {path} ({device_size})")
        else:
            size = os.fstat(fd).st_size
            if size < capacity:
                os.ftruncate(fd, capacity)
                if preallocate:
                    try:
                        os.posix_fallocate(fd, 0, capacity)
                    except OSError as exc:
                        if exc.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                            raise
                os.fsync(fd)
            if created:
                # The new directory entry must survive a crash too.
                fsync_dir(os.path.dirname(os.path.abspath(path)))
    finally:
        os.close(fd)


def open_data(path: str, direct: bool, arenas: ArenaPool) -> tuple[int, bool, str | None]:
    """The descriptor data moves through, whether it is O_DIRECT, and if not why."""
    if direct:
        return _open_direct(path, arenas)
    return os.open(path, os.O_RDWR | os.O_CLOEXEC), False, "disabled by the direct=False flag"


def _open_direct(path: str, arenas: ArenaPool) -> tuple[int, bool, str | None]:
    """An O_DIRECT descriptor if the filesystem honours it, else a buffered one and why."""
    plain = os.O_RDWR | os.O_CLOEXEC
    try:
        fd = os.open(path, plain | os.O_DIRECT)
    except OSError as exc:
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, plain), False, "open(O_DIRECT) failed with EINVAL"
    # Some filesystems accept the flag at open and refuse the I/O: probe one
    # aligned read (the region is at least one page).
    arena = arenas.acquire(ALIGNMENT)
    try:
        with memoryview(arena) as view:
            os.preadv(fd, [view[:ALIGNMENT]], 0)
    except OSError as exc:
        os.close(fd)
        if exc.errno != errno.EINVAL:
            raise
        return os.open(path, plain), False, "O_DIRECT read failed with EINVAL"
    finally:
        arenas.release(arena)
    return fd, True, None


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
