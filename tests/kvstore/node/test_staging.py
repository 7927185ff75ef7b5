"""Staging areas (kvstore/node/staging.py): a live slot is landed into the region, an expired
one is never handed out again, and its area takes no new reservation."""

from __future__ import annotations

import mmap
import os

from kvstore.node.staging import KEEP_RESIDENT, Staging, StagingArea
from tiers.allocator import Extent

MiB = 1 << 20


def grant(staging: Staging, nbytes: int) -> tuple[StagingArea, Extent]:
    got = staging.grant(nbytes)
    assert got is not None
    return got


def sent(staging: Staging) -> tuple[int, int]:
    got = staging.to_send()
    assert got is not None
    return got


def _client_map(fd: int) -> mmap.mmap:
    return mmap.mmap(fd, 0, flags=mmap.MAP_SHARED)


def test_a_live_slot_lands_and_is_carved_again() -> None:
    staging = Staging(64 * MiB)
    fd, generation = sent(staging)
    assert generation == 1 and staging.to_send() is None  # sent once
    client = _client_map(fd)
    area, slot = grant(staging, 3000)
    client[slot.offset:slot.offset + 3000] = b"v" * 3000
    dest = bytearray(3000)
    area.land(slot, memoryview(dest))
    assert dest == b"v" * 3000
    staging.done(area, slot, expired=False)
    again, slot2 = grant(staging, 3000)
    assert (again, slot2) == (area, slot)  # the same pages: no fault on a steady stream
    staging.done(again, slot2, expired=False)
    client.close()
    staging.close()


def test_an_expired_slot_is_never_granted_again_and_nobody_reads_it() -> None:
    staging = Staging(64 * MiB)
    first_fd, _ = sent(staging)
    late = _client_map(first_fd)
    area, slot = grant(staging, MiB)
    other_area, other = grant(staging, MiB)  # before the expiry
    staging.done(area, slot, expired=True)
    fresh, slot2 = grant(staging, MiB)
    assert fresh is not area and fresh.generation == 2
    fd2, generation = sent(staging)
    assert (fd2, generation) == (fresh.fd, 2)
    new = _client_map(fd2)
    new[slot2.offset:slot2.offset + MiB] = b"n" * MiB
    late[slot.offset:slot.offset + MiB] = b"L" * MiB  # the late writer
    dest = bytearray(MiB)
    fresh.land(slot2, memoryview(dest))
    assert dest == b"n" * MiB
    # The retired area still serves what was granted in it before, at other offsets.
    late[other.offset:other.offset + MiB] = b"o" * MiB
    other_area.land(other, memoryview(dest))
    assert dest == b"o" * MiB
    staging.done(other_area, other, expired=False)
    assert area.fd == -1  # retired and unused: closed
    staging.done(fresh, slot2, expired=False)
    late.close()
    new.close()
    staging.close()


def test_pages_past_the_resident_budget_are_given_back() -> None:
    staging = Staging(2 * KEEP_RESIDENT)
    fd, _ = sent(staging)
    client = _client_map(fd)
    area, low = grant(staging, KEEP_RESIDENT)
    _, high = grant(staging, 4 * MiB)
    assert high.offset >= KEEP_RESIDENT
    client[low.offset:low.end] = b"a" * low.length
    client[high.offset:high.end] = b"b" * high.length
    used = os.fstat(fd).st_blocks
    staging.done(area, high, expired=False)
    assert os.fstat(fd).st_blocks == used - high.length // 512  # punched
    staging.done(area, low, expired=False)
    assert os.fstat(fd).st_blocks == used - high.length // 512  # kept for reuse
    client.close()
    staging.close()
