"""The native block table and live table against the Python ones, operation by operation
(Hypothesis), and the C side's bounds checks; the TierManager's own tests run on both (conftest)."""

from __future__ import annotations

import itertools
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvstore.core.keys import BlockKey
from tiers.allocator import Extent
from tiers.block_table import BlockTable, PyBlockTable
from tiers.errors import LeaseNotHeld
from tiers.index_budget import NATIVE_BYTES_PER_BLOCK
from tiers.index_kind import native_available
from tiers.live_table import NativeLiveTable
from tiers.policy import Eligibility, EvictionQueue, make_policy
from tiers.records import MOVING, PINNED, UNLINKED, BlockEntry

pytestmark = pytest.mark.skipif(not native_available(), reason="native index not built")

if native_available():
    from tiers._block_index import ffi, lib

    from tiers.native_index import NativeBlockTable, NativeEntry, NativeIndexError

KEYS = [BlockKey(bytes([i % 7]) * 8 + i.to_bytes(8, "big")) for i in range(40)]
FIELDS = ("key", "parent", "nbytes", "level", "flags", "readers", "children", "hits",
          "tier_hits", "last_access", "queue_seq", "place", "length", "extent", "location")


class Location:
    """A durable tier's location record (any Python object)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Location) and other.n == self.n

    def __hash__(self) -> int:
        return self.n


class TableMachine(RuleBasedStateMachine):
    """The same operations on a ``PyBlockTable`` (the reference) and a ``NativeBlockTable``;
    every answer and every field must be equal."""

    def __init__(self) -> None:
        super().__init__()
        self.tables: list[Any] = []
        self.queues: list[list[EvictionQueue]] = []
        self.held: dict[BlockKey, list[BlockEntry]] = {}  # unlinked but leased entries

    @initialize(policy=st.sampled_from(["lru", "lfu", "prefix"]))
    def build(self, policy: str) -> None:
        for table in (PyBlockTable(), NativeBlockTable()):
            clock = itertools.count(1)
            self.tables.append(table)
            self.queues.append([table.make_queue(make_policy(policy), clock=clock, level=i)
                                for i in range(2)])

    def each(self) -> list[tuple[BlockTable, list[EvictionQueue]]]:
        return list(zip(self.tables, self.queues, strict=True))

    @rule(i=st.integers(0, len(KEYS) - 1), parent=st.none() | st.integers(0, len(KEYS) - 1),
          nbytes=st.integers(1, 1 << 40), level=st.integers(0, 1),
          place=st.none() | st.integers(0, 1 << 50) | st.integers(0, 5).map(Location),
          pinned=st.booleans())
    def add(self, i: int, parent: int | None, nbytes: int, level: int, place: Any,
            pinned: bool) -> None:
        key = KEYS[i]
        if key in self.tables[0]:
            return
        for table, queues in self.each():
            extent = Extent(place, 64) if isinstance(place, int) and place % 2 else None
            e = table.new_entry(key=key, parent=None if parent is None else KEYS[parent],
                                nbytes=nbytes, level=level, extent=extent,
                                location=None if extent else place, pinned=pinned,
                                children=i % 3, last_access=i)
            table[key] = e
            if not pinned:
                queues[level].push(key, e)

    @rule(i=st.integers(0, len(KEYS) - 1), leased=st.booleans())
    def remove(self, i: int, leased: bool) -> None:
        key = KEYS[i]
        if key not in self.tables[0]:
            return
        entries = []
        for table, _ in self.each():
            e = table[key]
            del table[key]
            e.flags |= UNLINKED
            e.queue_seq = 0
            if leased:
                e.readers += 1
                entries.append(e)
            else:
                table.retire(e)
        if leased:
            self.held.setdefault(key, []).append(entries)  # type: ignore[arg-type]

    @precondition(lambda self: self.held)
    @rule(data=st.data())
    def release(self, data: st.DataObject) -> None:
        key = data.draw(st.sampled_from(sorted(self.held)))
        pair = self.held[key].pop()
        if not self.held[key]:
            del self.held[key]
        for (table, _), e in zip(self.each(), pair, strict=True):  # type: ignore[call-overload]
            assert e.flags & UNLINKED and e.readers == 1
            e.readers -= 1
            table.retire(e)
            assert e.readers == 0

    @rule(i=st.integers(0, len(KEYS) - 1), push=st.booleans())
    def access(self, i: int, push: bool) -> None:
        key = KEYS[i]
        for table, queues in self.each():
            e = table.get(key)
            if e is None:
                continue
            e.hits += 1
            e.tier_hits += 1
            e.last_access += 1000
            if push and not e.flags:
                queues[e.level].push(key, e)

    @rule(i=st.integers(0, len(KEYS) - 1), bit=st.sampled_from([PINNED, MOVING]))
    def flag(self, i: int, bit: int) -> None:
        for table, _ in self.each():
            e = table.get(KEYS[i])
            if e is not None:
                e.flags ^= bit

    @rule(i=st.integers(0, len(KEYS) - 1))
    def forget(self, i: int) -> None:
        for table, _ in self.each():
            e = table.get(KEYS[i])
            if e is not None:
                EvictionQueue.forget(e)

    @rule(i=st.integers(0, len(KEYS) - 1), level=st.integers(0, 1))
    def move(self, i: int, level: int) -> None:
        for table, queues in self.each():
            e = table.get(KEYS[i])
            if e is not None and not e.flags:
                e.level = level
                e.place, e.length = 64 * i, 64
                queues[level].push(e.key, e)

    @rule(level=st.integers(0, 1), rounds=st.integers(1, 6),
          defer=st.sets(st.integers(0, len(KEYS) - 1)),
          drop=st.sets(st.integers(0, len(KEYS) - 1)))
    def evict(self, level: int, rounds: int, defer: set[int], drop: set[int]) -> None:
        deferred_keys = {KEYS[i] for i in defer}
        dropped_keys = {KEYS[i] for i in drop}

        def eligibility(e: BlockEntry) -> Eligibility:
            if e.key in dropped_keys:
                return Eligibility.DROP
            if e.key in deferred_keys:
                return Eligibility.DEFER
            return Eligibility.EVICT

        answers = []
        for table, queues in self.each():
            deferred: list[Any] = []
            got = [queues[level].pop_victim(table, eligibility, deferred)
                   for _ in range(rounds)]
            queues[level].restore(deferred)
            answers.append(got)
        assert answers[0] == answers[1]

    @rule(picks=st.lists(st.integers(0, len(KEYS) - 1), max_size=10))
    def prefix(self, picks: list[int]) -> None:
        keys = [KEYS[i] for i in picks]
        assert self.tables[0].prefix_length(keys) == self.tables[1].prefix_length(keys)

    @invariant()
    def same(self) -> None:
        if not self.tables:
            return
        py, native = self.tables
        assert list(py) == list(native)  # insertion order
        assert len(py) == len(native)
        for key in KEYS:
            a, b = py.get(key), native.get(key)
            assert (a is None) == (b is None)
            if a is not None:
                assert b is native.get(key)  # one handle per record
                for f in FIELDS:
                    assert getattr(a, f) == getattr(b, f), f
                assert a.queue_priority == b.queue_priority


TableMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=60,
                                          deadline=None)
TestTableMachine = TableMachine.TestCase


def test_key_table_survives_growth_and_deletion_in_any_order() -> None:
    """Thousands of keys through the table's growths and backward-shift deletions."""
    t = NativeBlockTable()
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(20_000)]
    for k in keys:
        t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    for k in keys[::3]:
        e = t[k]
        del t[k]
        e.flags |= UNLINKED
        t.retire(e)
    kept = [k for i, k in enumerate(keys) if i % 3]
    assert list(t) == kept and len(t) == len(kept)
    assert all(k in t for k in kept) and not any(k in t for k in keys[::3])
    for k in keys[::3]:  # reused slots
        t[k] = t.new_entry(key=k, parent=None, nbytes=2, level=0)
    assert list(t) == kept + keys[::3]
    assert t.prefix_length([*kept[:50], BlockKey(b"z" * 16), *kept]) == 50


def test_prefix_length_fetched_ahead_in_windows_stops_at_the_first_absent_key() -> None:
    """``kvb_prefix_length`` looks keys up a window (16) at a time after fetching ahead:
    its answer is the first absent key's position wherever that falls (inside a window,
    on a window's edge, past the last), also while the key table is growing (lookups in
    both its halves)."""
    t = NativeBlockTable()
    keys = [BlockKey(i.to_bytes(16, "big")) for i in range(1, 3000)]
    absent = BlockKey(b"\xff" * 16)
    growing_seen = False
    for n, k in enumerate(keys, 1):
        t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
        growing_seen |= t.moving_buckets() > 0
        if n % 97 == 0 or (t.moving_buckets() > 0 and n % 7 == 0):
            chain = keys[max(0, n - 40):n]
            for cut in (0, 1, 15, 16, 17, 31, 32, 33, len(chain) - 1, len(chain)):
                cut = min(cut, len(chain))
                probe = [*chain[:cut], absent, *chain[cut:]]
                assert t.prefix_length(probe) == cut
            assert t.prefix_length(chain) == len(chain)
    assert growing_seen  # some lookups ran while the table was growing


def test_a_handle_nobody_holds_is_dropped_and_one_held_is_kept() -> None:
    t = NativeBlockTable()
    keys = [BlockKey(i.to_bytes(16, "big")) for i in range(5000)]
    for k in keys:
        t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    held = t[keys[7]]
    for k in keys:  # sweeps run as handles are made
        t.get(k)
    assert t[keys[7]] is held
    assert len(t._handles) < len(keys)


def test_a_retired_records_stale_handle_has_no_readers() -> None:
    t = NativeBlockTable()
    k = BlockKey(b"a" * 16)
    e = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    t[k] = e
    e.readers += 1
    del t[k]
    e.flags |= UNLINKED
    e.readers -= 1
    t.retire(e)
    assert e.readers == 0 and e.unlinked


def test_wrong_keys_are_refused_or_absent() -> None:
    t = NativeBlockTable()
    with pytest.raises(ValueError, match="16-byte keys"):
        t.new_entry(key=BlockKey(b"short"), parent=None, nbytes=1, level=0)
    assert BlockKey(b"short") not in t and t.get(BlockKey(b"short")) is None
    assert t.prefix_length([BlockKey(b"short")]) == 0
    with pytest.raises(ValueError, match="16-byte keys"):
        t.new_entry(key=BlockKey(b"a" * 16), parent=BlockKey(b"short"), nbytes=1, level=0)
    with pytest.raises(NativeIndexError, match="bad argument"):
        t.new_entry(key=BlockKey(b"a" * 16), parent=None, nbytes=1, level=lib.KVB_LEVELS)
    with pytest.raises(KeyError):
        del t[BlockKey(b"b" * 16)]


def test_linking_an_indexed_key_again_or_retiring_an_indexed_entry_is_refused() -> None:
    t = NativeBlockTable()
    k = BlockKey(b"a" * 16)
    e = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    t[k] = e
    with pytest.raises(NativeIndexError):
        t[k] = e
    twin = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    with pytest.raises(NativeIndexError):
        t[k] = twin
    with pytest.raises(NativeIndexError):
        t.retire(e)
    with pytest.raises(TypeError):
        t.retire(BlockEntry(key=k, parent=None, nbytes=1))


@pytest.mark.parametrize("slot", [-1, 1, 1 << 20, (1 << 32) - 1])
def test_c_calls_check_their_slot_and_level(slot: int) -> None:
    t = NativeBlockTable()
    k = BlockKey(b"a" * 16)
    t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)  # slot 0 is the only one
    c = t.c
    assert lib.kvb_link(c, slot) == lib.KVB_EBAD
    assert lib.kvb_unlink(c, slot) == lib.KVB_EBAD
    assert lib.kvb_retire(c, slot) == lib.KVB_EBAD
    assert lib.kvb_heap_push(c, 0, slot, 1.0, 1) == lib.KVB_EBAD
    assert lib.kvb_heap_remove(c, slot) == lib.KVB_EBAD
    assert lib.kvb_release_read(c, slot, 0, UNLINKED) == lib.KVB_EBAD
    assert lib.kvb_unlink_entry(c, slot, UNLINKED) == lib.KVB_EBAD
    assert lib.kvb_unlink_entry(c, 0, 256) == lib.KVB_EBAD
    other = b"b" * 16
    for nbytes, level, length, pkind, flags in [(-1, 0, 0, 0, 0), (1, -1, 0, 0, 0),
                                                (1, lib.KVB_LEVELS, 0, 0, 0), (1, 0, -1, 1, 0),
                                                (1, 0, 0, 3, 0), (1, 0, 0, 0, 256)]:
        assert lib.kvb_new(c, other, ffi.NULL, nbytes, level, 0, length, pkind, flags, 0,
                           0) == lib.KVB_EBAD
    for level in (-1, lib.KVB_LEVELS):
        assert lib.kvb_heap_push(c, level, 0, 1.0, 1) == lib.KVB_EBAD
        assert lib.kvb_heap_pop(c, level) == lib.KVB_EBAD
        assert lib.kvb_heap_len(c, level) == lib.KVB_EBAD
    assert lib.kvb_heap_pop(c, 0) == -1
    cursor = ffi.new("uint32_t *", 12345)  # not a linked slot: nothing, cursor at the end
    assert lib.kvb_slots(c, cursor, ffi.new("uint32_t[]", 4), 4) == 0
    assert cursor[0] == lib.KVB_NONE
    assert list(t) == [k]


def test_a_read_hit_counts_requeues_and_says_when_to_promote_in_one_call() -> None:
    t = NativeBlockTable()
    a, b = BlockKey(b"a" * 16), BlockKey(b"b" * 16)
    for key in (a, b):
        t[key] = t.new_entry(key=key, parent=None, nbytes=7, level=1)
    assert t.read_hit(BlockKey(b"c" * 16), 5, leaves_only=False, promote_after=2) is None
    assert t.read_hit(BlockKey(b"short"), 5, leaves_only=False, promote_after=2) is None
    hit = t.read_hit(a, 5, leaves_only=False, promote_after=2)
    assert hit is not None
    e, level, promote = hit
    assert e is t.get(a) and level == 1 and not promote
    assert (e.readers, e.hits, e.tier_hits, e.last_access, e.queue_seq,
            e.queue_priority) == (1, 1, 1, 5, 5, 5.0)
    assert t.read_hit(a, 6, leaves_only=False, promote_after=2) == (e, 1, True)
    e.flags |= MOVING  # moving: neither requeued nor due for promotion
    assert t.read_hit(a, 7, leaves_only=False, promote_after=2) == (e, 1, False)
    assert (e.readers, e.hits, e.last_access, e.queue_seq) == (3, 3, 7, 6)
    f = t.get(b)
    assert f is not None
    f.children = 1  # with leaves_only, a block with children is not requeued
    t.read_hit(b, 8, leaves_only=True, promote_after=2)
    assert (f.last_access, f.queue_seq) == (8, 0)
    t.read_hit(b, 9, leaves_only=False, promote_after=2)
    assert f.queue_seq == 9
    queue = t.make_queue(make_policy("lru"), clock=itertools.count(100), level=1)
    assert len(queue) == 2  # a stays where it was (popped, its flag drops it), b requeued
    f.hits = f.tier_hits = (1 << 32) - 1  # counts stop at their top
    t.read_hit(b, 10, leaves_only=False, promote_after=2)
    assert (f.hits, f.tier_hits, f.readers) == ((1 << 32) - 1, (1 << 32) - 1, 3)
    f.readers = (1 << 32) - 1  # no lease past the top: refused, nothing changed
    with pytest.raises(NativeIndexError, match="bad argument"):
        t.read_hit(b, 11, leaves_only=False, promote_after=2)
    assert (f.readers, f.last_access) == ((1 << 32) - 1, 10)


@pytest.mark.parametrize("make_table", [PyBlockTable, NativeBlockTable])
def test_end_read_frees_on_the_last_lease_of_an_unlinked_entry_and_refuses_a_double_end(
        make_table: Any) -> None:
    t = make_table()
    k = BlockKey(b"a" * 16)
    e = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    t[k] = e
    e.readers += 2
    assert not t.end_read(e)
    del t[k]
    e.flags |= UNLINKED
    assert t.end_read(e)  # the last lease of an unlinked entry: the caller frees it
    with pytest.raises(LeaseNotHeld):
        t.end_read(e)
    t.retire(e)
    with pytest.raises(LeaseNotHeld):  # a retired record's handle holds nothing
        t.end_read(e)


@pytest.mark.parametrize("make_table", [PyBlockTable, NativeBlockTable])
def test_unlink_unindexes_dequeues_and_flags_an_entry_that_lives_on(make_table: Any) -> None:
    t = make_table()
    queue = t.make_queue(make_policy("lru"), clock=itertools.count(1), level=0)
    a, b = BlockKey(b"a" * 16), BlockKey(b"b" * 16)
    for key in (a, b):
        t[key] = e = t.new_entry(key=key, parent=None, nbytes=1, level=0, last_access=1)
        queue.push(key, e)
    e = t[a]
    e.readers += 1
    t.unlink(e)
    assert list(t) == [b] and a not in t
    assert e.flags == UNLINKED and e.queue_seq == 0 and e.readers == 1
    got = queue.pop_victim(t, lambda _: Eligibility.EVICT, [])
    assert got == b and queue.pop_victim(t, lambda _: Eligibility.EVICT, []) is None
    assert t.end_read(e)
    t.retire(e)


@pytest.mark.parametrize("make_table", [PyBlockTable, NativeBlockTable])
def test_children_are_counted_on_an_indexed_parent_only_and_never_below_zero(
        make_table: Any) -> None:
    t = make_table()
    p, absent = BlockKey(b"p" * 16), BlockKey(b"q" * 16)
    t[p] = t.new_entry(key=p, parent=None, nbytes=1, level=0, children=1)
    assert not t.add_child(absent) and t.drop_child(absent) == -1
    assert not t.add_child(BlockKey(b"short")) and t.drop_child(BlockKey(b"short")) == -1
    assert t.add_child(p) and t[p].children == 2
    assert [t.drop_child(p), t.drop_child(p)] == [1, 0]
    with pytest.raises(ValueError, match="no child"):
        t.drop_child(p)
    assert t[p].children == 0


def test_the_c_child_count_refuses_a_bad_delta_or_an_overflow() -> None:
    t = NativeBlockTable()
    p = BlockKey(b"p" * 16)
    t[p] = t.new_entry(key=p, parent=None, nbytes=1, level=0, children=(1 << 32) - 1)
    for delta in (0, 2, -2, 1):  # 1: past 2**32 - 1
        assert lib.kvb_child(t.c, p, delta) == lib.KVB_EBAD
    assert lib.kvb_child(t.c, p, -1) == (1 << 32) - 2


def test_an_insert_indexes_counts_the_parent_and_queues_in_one_call() -> None:
    t = NativeBlockTable()
    a, b, c, absent = (BlockKey(bytes([n]) * 16) for n in b"abcz")
    queue = t.make_queue(make_policy("lru"), clock=itertools.count(100), level=1)
    assert not t.insert(key=a, parent=None, nbytes=7, level=1, tick=5, location=Location(1))
    assert t.insert(key=b, parent=a, nbytes=8, level=1, tick=6, extent=Extent(64, 128),
                    children=2)  # its parent is indexed: counted there
    assert not t.insert(key=c, parent=absent, nbytes=9, level=1, tick=7, pinned=True)
    ea, eb, ec = t[a], t[b], t[c]
    assert [(e.key, e.parent, e.nbytes, e.level, e.children, e.last_access, e.queue_seq,
             e.flags, e.extent, e.location) for e in (ea, eb, ec)] == [
        (a, None, 7, 1, 1, 5, 5, 0, None, Location(1)),
        (b, a, 8, 1, 2, 6, 6, 0, Extent(64, 128), None),
        (c, absent, 9, 1, 0, 7, 0, PINNED, None, None)]  # pinned: not queued
    assert list(t) == [a, b, c] and len(queue) == 2 and eb.queue_priority == 6.0
    assert queue.pop_victim(t, lambda e: Eligibility.EVICT, []) == a
    with pytest.raises(NativeIndexError, match="bad argument"):  # indexed: nothing changed
        t.insert(key=b, parent=a, nbytes=1, level=1, tick=8)
    with pytest.raises(NativeIndexError, match="bad argument"):  # no such level
        t.insert(key=absent, parent=None, nbytes=1, level=lib.KVB_LEVELS, tick=8)
    with pytest.raises(ValueError, match="16-byte keys"):
        t.insert(key=BlockKey(b"short"), parent=None, nbytes=1, level=1, tick=8)
    ea.children = (1 << 32) - 1  # a parent at the top of its count: refused, nothing changed
    with pytest.raises(NativeIndexError, match="bad argument"):
        t.insert(key=absent, parent=a, nbytes=1, level=1, tick=8)
    assert (len(t), ea.children, absent in t, len(queue)) == (3, (1 << 32) - 1, False, 1)


def test_a_native_entry_is_a_block_entry() -> None:
    t = NativeBlockTable()
    k = BlockKey(b"a" * 16)
    e = t.new_entry(key=k, parent=BlockKey(b"p" * 16), nbytes=5, level=1,
                    extent=Extent(128, 64), pinned=True)
    assert isinstance(e, NativeEntry) and isinstance(e, BlockEntry)
    assert (e.parent, e.extent, e.location, e.pinned, e.tier) == (
        BlockKey(b"p" * 16), Extent(128, 64), None, True, 1)
    e.location = Location(3)
    assert (e.extent, e.location, e.place) == (None, Location(3), Location(3))


def test_the_native_budget_covers_what_the_tables_hold() -> None:
    """``NATIVE_BYTES_PER_BLOCK`` against the native memory of the block table (records,
    key table, heap) and the live table, filled to two whole record chunks."""
    n = 2 << lib.KVB_CHUNK_BITS
    t, live = NativeBlockTable(), NativeLiveTable()
    queue = t.make_queue(make_policy("lru"), clock=itertools.count(1), level=0)
    for i in range(n):
        k = BlockKey(i.to_bytes(16, "big"))
        e = t.new_entry(key=k, parent=None, nbytes=1, level=0, extent=Extent(i, 1))
        t[k] = e
        queue.push(k, e)
        live[i] = 1
    per_block = (t.native_bytes() + live.native_bytes()) / n
    assert 160 < per_block <= NATIVE_BYTES_PER_BLOCK


# ---- progressive growth of the hash tables (cffi_build/probe_table.c) ------------------------


def _grow_at() -> int:
    """Entries after which the first growth starts (the table passes 7/8 of its buckets)."""
    return lib.KVP_MIN_BUCKETS * 7 // 8


def test_a_key_table_growth_moves_a_bounded_step_per_link_and_frees_the_old_half() -> None:
    """No link rehashes the whole table: the one that passes 7/8 allocates the bigger table
    and moves ``KVP_STEP`` old buckets, every later link as many, until the old is gone."""
    t = NativeBlockTable()
    keys = [BlockKey(i.to_bytes(16, "big")) for i in range(3 * lib.KVP_MIN_BUCKETS)]
    for k in keys[:_grow_at()]:
        t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    assert t.moving_buckets() == 0
    small = t.native_bytes()
    moving, grown = [], []
    for k in keys[_grow_at():]:
        t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
        moving.append(t.moving_buckets())
        grown.append(t.native_bytes() - small)
        if moving[-1] == 0:
            break
    step, old = lib.KVP_STEP, lib.KVP_MIN_BUCKETS
    assert moving == [old - step * i for i in range(1, old // step)] + [0]
    # One word a bucket: both tables while the old drains, then only the doubled one.
    assert grown == [8 * 2 * old] * (len(moving) - 1) + [8 * old]
    assert list(t) == keys[:_grow_at() + len(moving)]


@settings(max_examples=60, deadline=None)
@given(ops=st.lists(st.tuples(st.sampled_from(["link", "unlink", "find", "fill"]),
                              st.integers(0, 4 * 1024)), max_size=120))
def test_the_key_table_answers_as_a_dict_while_it_grows(ops: list[tuple[str, int]]) -> None:
    """Links, unlinks and finds through growths, many of them while an old table is still
    being drained (``fill`` links hundreds of keys at once to reach a growth)."""
    t = NativeBlockTable()
    ref: dict[BlockKey, None] = {}  # insertion-ordered, as the table
    entries: dict[BlockKey, BlockEntry] = {}
    during = 0
    next_fill = 1 << 20

    def link(k: BlockKey) -> None:
        e = t.new_entry(key=k, parent=None, nbytes=1, level=0)
        t[k] = e
        ref[k] = None
        entries[k] = e

    for op, n in ops:
        k = BlockKey(n.to_bytes(16, "big"))
        if op == "fill":
            for i in range(n % 700):
                link(BlockKey((next_fill + i).to_bytes(16, "big")))
            next_fill += 700
        elif op == "link" and k not in ref:
            link(k)
        elif op == "unlink" and k in ref:
            del t[k]
            del ref[k]
            e = entries.pop(k)
            e.flags |= UNLINKED
            t.retire(e)
        elif op == "find":
            assert (k in t) == (k in ref)
        during += t.moving_buckets() > 0
        assert len(t) == len(ref)
    assert list(t) == list(ref)
    assert all(k in t for k in ref)
    if during:  # what was looked up mid-growth was found in either table
        assert all(t.get(k) is entries[k] for k in ref)


def test_a_live_table_growth_is_progressive_and_offset_zero_is_a_key() -> None:
    """Offset 0 is stored as any other (the table keeps two codes of its own below 2)."""
    t = NativeLiveTable()
    for i in range(_grow_at() + 1):
        t[i] = i + 1
    assert t.moving_buckets() == lib.KVP_MIN_BUCKETS - lib.KVP_STEP
    assert t.get(0) == 1 and t.get(_grow_at()) == _grow_at() + 1
    del t[0]
    assert t.get(0) is None and len(t) == _grow_at()
    assert sorted(t.items()) == [(i, i + 1) for i in range(1, _grow_at() + 1)]


def test_keys_unlinked_and_looked_up_while_the_key_table_grows() -> None:
    """Unlinks mid-growth hit both tables (keys not moved yet and keys already moved), and
    every lookup in between answers from whichever table holds the key."""
    t = NativeBlockTable()
    keys = [BlockKey(i.to_bytes(16, "little")) for i in range(_grow_at() + 200)]
    entries = {}
    for k in keys[:_grow_at()]:
        entries[k] = t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
    gone: set[BlockKey] = set()
    for i, k in enumerate(keys[_grow_at():]):
        entries[k] = t[k] = t.new_entry(key=k, parent=None, nbytes=1, level=0)
        if t.moving_buckets():
            victim = keys[(7 * i) % _grow_at()]
            if victim not in gone:
                del t[victim]
                gone.add(victim)
            assert all((t.get(k) is entries[k]) != (k in gone) for k in keys[:_grow_at() + i + 1])
    assert t.moving_buckets() == 0 and len(gone) > 50
    assert list(t) == [k for k in keys if k not in gone]


def test_a_big_growth_gives_the_drained_old_pages_back_and_still_answers() -> None:
    """A table big enough that its drained old half is given back a megabyte at a time
    while it grows (read as empty afterwards): every entry is still found, moved or not,
    and absent ones are absent."""
    t = NativeLiveTable()
    grow_at = (1 << 17) * 7 // 8  # two-word buckets: 2**17 of them is 2 MiB
    for i in range(grow_at):
        t[i * 8] = i
    released, i = [], grow_at
    while t.moving_buckets() or i == grow_at:
        t[i * 8] = i
        if i % 16 == 0:
            del t[(i - grow_at) * 8]  # some of the old half's, moved or not
        released.append(t.released_bytes())
        for j in range(i % 97, i, 4099):
            assert t.get(j * 8) == (None if j % 16 == 0 and j <= i - grow_at else j)
        assert t.get(i * 8 + 3) is None
        i += 1
    assert max(released) >= 1 << 20  # pages were given back while it drained
    gone = {(k - grow_at) * 8 for k in range(grow_at, i) if k % 16 == 0}
    assert sorted(t.items()) == [(k * 8, k) for k in range(i) if k * 8 not in gone]
