/* The allocators' live tables in native memory (issue #24): extent offset -> length, an
 * open-addressing table that grows progressively (probe_table.c). Compiled in one unit
 * after probe_table.c and block_index.c (cffi_build/block_index_build.py), whose
 * KVB_EBAD and KVB_ENOMEM it returns. Single owner: every call under the owner's lock.
 */
#include <stdint.h>
#include <stdlib.h>

/* ---- the allocator's live table: extent offset -> length ---------------------------- */

/* Two bucket layouts.
 * Wide (kvb_map_open): two words, offset + 2 (probe_table.c keeps 0 and 1) and the length.
 * Compact (kvb_map_open_units): one word, (offset >> shift) + 1 in the high half and
 * length >> shift in the low half, for an allocator whose offsets and lengths are all
 * multiples of 2**shift and whose region holds fewer than 2**32 - 2 such units: half the
 * memory a live extent costs (8 bytes a bucket, issue #24). The word is >= 2**32, so never
 * one of probe_table.c's marks. A compact map refuses (KVB_EBAD) what it cannot hold
 * exactly, and answers "absent" for an offset no live extent can have. */
struct kvb_map {
    struct kvp_table t;
    int compact;
    unsigned shift;
};

#define KVB_UNITS_MAX 0xFFFFFFFEull  /* compact: offset >> shift below it (+1 fits 32 bits) */

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

static uint64_t map_bucket_hash(const uint64_t *bucket, const void *ctx) {
    (void)ctx;
    return mix64(bucket[0]);
}

static int map_bucket_match(const uint64_t *bucket, const void *query, const void *ctx) {
    (void)ctx;
    return bucket[0] == *(const uint64_t *)query;
}

static const struct kvp_ops map_ops = {map_bucket_hash, map_bucket_match};

/* Compact: the hash and the query are of the high half, (offset >> shift) + 1. */
static uint64_t unit_bucket_hash(const uint64_t *bucket, const void *ctx) {
    (void)ctx;
    return mix64(bucket[0] >> 32);
}

static int unit_bucket_match(const uint64_t *bucket, const void *query, const void *ctx) {
    (void)ctx;
    return bucket[0] >> 32 == *(const uint64_t *)query;
}

static const struct kvp_ops unit_ops = {unit_bucket_hash, unit_bucket_match};

static const struct kvp_ops *ops_of(const struct kvb_map *m) {
    return m->compact ? &unit_ops : &map_ops;
}

/* The word a query for ``offset`` matches (wide: offset + 2; compact: its unit + 1), or 0
 * when a compact map can hold no extent at ``offset`` (misaligned or past its units). */
static uint64_t query_of(const struct kvb_map *m, int64_t offset) {
    if (!m->compact)
        return (uint64_t)offset + 2;
    uint64_t o = (uint64_t)offset;
    if (o & ((1ull << m->shift) - 1) || o >> m->shift >= KVB_UNITS_MAX)
        return 0;
    return (o >> m->shift) + 1;
}

static uint64_t *map_find(const struct kvb_map *m, int64_t offset) {
    uint64_t k = query_of(m, offset);
    if (k == 0)
        return NULL;
    return kvp_find(&m->t, mix64(k), &k, ops_of(m), NULL);
}

static int64_t value_of(const struct kvb_map *m, const uint64_t *bucket) {
    if (!m->compact)
        return (int64_t)bucket[1];
    return (int64_t)((bucket[0] & 0xFFFFFFFFull) << m->shift);
}

static int64_t offset_of(const struct kvb_map *m, const uint64_t *bucket) {
    if (!m->compact)
        return (int64_t)(bucket[0] - 2);
    return (int64_t)(((bucket[0] >> 32) - 1) << m->shift);
}

static struct kvb_map *map_open(int compact, unsigned shift) {
    struct kvb_map *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    m->compact = compact;
    m->shift = shift;
    if (kvp_init(&m->t, compact ? 1 : 2) != 0) {
        free(m);
        return NULL;
    }
    return m;
}

struct kvb_map *kvb_map_open(void) { return map_open(0, 0); }

/* A compact map for offsets and lengths that are multiples of 2**shift (shift <= 32); NULL
 * for a bad shift or no memory. */
struct kvb_map *kvb_map_open_units(int shift) {
    if (shift < 0 || shift > 32)
        return NULL;
    return map_open(1, (unsigned)shift);
}

/* 1 if the map is compact, 0 if wide. */
int kvb_map_compact(const struct kvb_map *m) { return m->compact; }

void kvb_map_close(struct kvb_map *m) {
    if (m == NULL)
        return;
    kvp_free(&m->t);
    free(m);
}

uint64_t kvb_map_count(const struct kvb_map *m) { return m->t.count; }

uint64_t kvb_map_bytes(const struct kvb_map *m) {
    return sizeof *m + kvp_bytes(&m->t);
}

/* Buckets of the table's old half still to move (0: not growing). */
uint64_t kvb_map_moving(const struct kvb_map *m) { return kvp_moving(&m->t); }

/* Bytes of the old half already given back to the kernel while it drains. */
uint64_t kvb_map_released(const struct kvb_map *m) { return m->t.released; }

/* The length at ``offset``, or -1. */
int64_t kvb_map_get(const struct kvb_map *m, int64_t offset) {
    if (offset < 0)
        return -1;
    const uint64_t *p = map_find(m, offset);
    return p != NULL ? value_of(m, p) : -1;
}

/* Sets ``offset`` -> ``value`` (value >= 0; a compact map also needs both multiples of its
 * unit, offset within its units and value below 2**32 units); 0, KVB_EBAD or KVB_ENOMEM. */
int kvb_map_set(struct kvb_map *m, int64_t offset, int64_t value) {
    if (offset < 0 || value < 0)
        return KVB_EBAD;
    uint64_t k = query_of(m, offset);
    if (k == 0)
        return KVB_EBAD;
    uint64_t word1 = (uint64_t)value;
    if (m->compact) {
        if (word1 & ((1ull << m->shift) - 1) || word1 >> m->shift > 0xFFFFFFFFull)
            return KVB_EBAD;
        word1 >>= m->shift;
    }
    if (kvp_reserve(&m->t, ops_of(m), NULL, 1ull << 60) != 0)
        return KVB_ENOMEM;
    uint64_t *p = map_find(m, offset);
    if (p != NULL) {
        if (m->compact)
            p[0] = k << 32 | word1;
        else
            p[1] = word1;
        return 0;
    }
    if (m->compact) {
        uint64_t bucket[1] = {k << 32 | word1};
        kvp_insert(&m->t, mix64(k), bucket);
    } else {
        uint64_t bucket[2] = {k, word1};
        kvp_insert(&m->t, mix64(k), bucket);
    }
    return 0;
}

/* Removes ``offset``; its length, or -1 if absent. */
int64_t kvb_map_del(struct kvb_map *m, int64_t offset) {
    if (offset < 0)
        return -1;
    uint64_t *p = map_find(m, offset);
    if (p == NULL)
        return -1;
    int64_t value = value_of(m, p);
    kvp_remove(&m->t, p, ops_of(m), NULL);
    return value;
}

/* Up to ``cap`` (offset, length) pairs in table order from position ``*from`` (0: the
 * first); ``*from`` becomes the next position (past the end: done). No set or delete
 * between calls. */
uint64_t kvb_map_items(const struct kvb_map *m, uint64_t *from, int64_t *offsets,
                       int64_t *values, uint64_t cap) {
    const uint64_t *got[256];
    uint64_t n = 0;
    while (n < cap) {
        uint64_t want = cap - n < 256 ? cap - n : 256;
        uint64_t k = kvp_items(&m->t, from, got, want);
        for (uint64_t i = 0; i < k; i++) {
            offsets[n] = offset_of(m, got[i]);
            values[n++] = value_of(m, got[i]);
        }
        if (k < want)
            break;
    }
    return n;
}
