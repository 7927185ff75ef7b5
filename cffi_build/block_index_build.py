"""cffi (API mode) build of ``tiers._block_index``: the tier index in native memory
(``cffi_build/block_index.c``, the manager's one-call paths over it in ``block_paths.c``, and
the allocators' live tables in ``block_map.c``, all over the
hash tables ``probe_table.c``; issue #24).

Run from the repository root::

    python -m cffi_build.block_index_build            # the extension, -O2
    python -m cffi_build.block_index_build --asan     # AddressSanitizer + UBSan

It places the extension next to ``tiers/native_index.py``. The native module is optional:
``tiers.block_table`` falls back to the pure-Python index (the same semantics, run by the
same tests), so without a C compiler this script warns and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cffi import FFI

from cffi_build.compile import build_main, build_module, sources_builder

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent

# What tiers/native_index.py expects of a build (kvb_api_version()).
API_VERSION = 5
CDEF = """
#define KVB_NONE 4294967295
#define KVB_EBAD -2
#define KVB_ENOMEM -3
#define KVB_CHUNK_BITS 16
#define KVB_LEVELS 8
#define KVP_STEP 16
#define KVP_MIN_BUCKETS 1024
struct kvb_entry {
    uint8_t key[16];
    uint8_t parent[16];
    int64_t nbytes;
    int64_t place;
    int64_t length;
    uint64_t last_access;
    uint64_t queue_seq;
    double queue_priority;
    uint32_t readers;
    uint32_t children;
    uint32_t hits;
    uint32_t tier_hits;
    uint32_t heap_pos;
    uint32_t gen;
    uint8_t level;
    uint8_t flags;
    uint8_t has_parent;
    uint8_t pkind;
    uint8_t used;
    ...;
};
struct kvb_table;
int kvb_api_version(void);
struct kvb_table *kvb_open(void);
void kvb_close(struct kvb_table *t);
uint64_t kvb_count(const struct kvb_table *t);
uint64_t kvb_moving(const struct kvb_table *t);
uint32_t kvb_nchunks(const struct kvb_table *t);
struct kvb_entry *kvb_chunk(const struct kvb_table *t, uint32_t i);
uint64_t kvb_native_bytes(const struct kvb_table *t);
int64_t kvb_new(struct kvb_table *t, const uint8_t *key, const uint8_t *parent, int64_t nbytes,
                int level, int64_t place, int64_t length, int pkind, int flags,
                uint32_t children, uint64_t last_access);
int kvb_retire(struct kvb_table *t, int64_t slot);
int64_t kvb_find(const struct kvb_table *t, const uint8_t *key);
int64_t kvb_child(struct kvb_table *t, const uint8_t *key, int delta);
uint64_t kvb_prefix_length(const struct kvb_table *t, const uint8_t *keys, uint64_t n);
int kvb_link(struct kvb_table *t, int64_t slot);
int kvb_unlink(struct kvb_table *t, int64_t slot);
int kvb_unlink_entry(struct kvb_table *t, int64_t slot, int flag);
uint64_t kvb_slots(const struct kvb_table *t, uint32_t *from, uint32_t *out, uint64_t cap);
int kvb_heap_push(struct kvb_table *t, int level, int64_t slot, double priority,
                  uint64_t seq);
int kvb_heap_restore(struct kvb_table *t, int level, int64_t slot, uint64_t seq);
int kvb_heap_remove(struct kvb_table *t, int64_t slot);
int64_t kvb_heap_pop(struct kvb_table *t, int level);
int64_t kvb_heap_len(const struct kvb_table *t, int level);
int64_t kvb_read_hit(struct kvb_table *t, const uint8_t *key, uint64_t tick, int leaves_only,
                     uint32_t promote_after, uint32_t moving);
int kvb_release_read(struct kvb_table *t, int64_t slot, uint32_t gen, uint32_t unlinked);
int64_t kvb_insert(struct kvb_table *t, const uint8_t *key, const uint8_t *parent,
                   int64_t nbytes, int level, int64_t place, int64_t length, int pkind,
                   int flags, uint32_t children, uint64_t last_access);
struct kvb_map;
struct kvb_map *kvb_map_open(void);
struct kvb_map *kvb_map_open_units(int shift);
int kvb_map_compact(const struct kvb_map *m);
void kvb_map_close(struct kvb_map *m);
uint64_t kvb_map_count(const struct kvb_map *m);
uint64_t kvb_map_bytes(const struct kvb_map *m);
uint64_t kvb_map_moving(const struct kvb_map *m);
uint64_t kvb_map_released(const struct kvb_map *m);
int64_t kvb_map_get(const struct kvb_map *m, int64_t offset);
int kvb_map_set(struct kvb_map *m, int64_t offset, int64_t value);
int64_t kvb_map_del(struct kvb_map *m, int64_t offset);
uint64_t kvb_map_items(const struct kvb_map *m, uint64_t *from, int64_t *offsets,
                       int64_t *values, uint64_t cap);
"""
MODULE = "tiers._block_index"
SOURCES = ["probe_table.c", "block_index.c", "block_paths.c", "block_map.c"]


def make_builder(asan: bool = False) -> FFI:
    return sources_builder(module=MODULE, cdef=CDEF, sources=SOURCES, asan=asan)


ffibuilder = make_builder()


def build(dest_dir: Path = _ROOT / "tiers", *, asan: bool = False) -> Path | None:
    """Builds the extension into ``dest_dir``; returns its path, or None (with a warning)."""
    return build_module(make_builder, dest_dir, module=MODULE, asan=asan)


def main(argv: Sequence[str] | None = None) -> int:
    return build_main("python -m cffi_build.block_index_build", lambda asan: build(asan=asan), argv)


if __name__ == "__main__":
    sys.exit(main())
