/* The allocators' live tables in native memory (issue #24): extent offset -> length, an
 * open-addressing table that grows progressively (probe_table.c). Compiled in one unit
 * after probe_table.c and block_index.c (cffi_build/block_index_build.py), whose
 * KVB_EBAD and KVB_ENOMEM it returns. Single owner: every call under the owner's lock.
 */
#include <stdint.h>
#include <stdlib.h>

/* ---- the allocator's live table: extent offset -> length ---------------------------- */

/* A bucket is two words: offset + 2 (probe_table.c keeps 0 and 1), and the length. */
struct kvb_map {
    struct kvp_table t;
};

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

static uint64_t *map_find(const struct kvb_map *m, int64_t offset) {
    uint64_t k = (uint64_t)offset + 2;
    return kvp_find(&m->t, mix64(k), &k, &map_ops, NULL);
}

struct kvb_map *kvb_map_open(void) {
    struct kvb_map *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    if (kvp_init(&m->t, 2) != 0) {
        free(m);
        return NULL;
    }
    return m;
}

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
    return p != NULL ? (int64_t)p[1] : -1;
}

/* Sets ``offset`` -> ``value`` (value >= 0); 0, KVB_EBAD or KVB_ENOMEM. */
int kvb_map_set(struct kvb_map *m, int64_t offset, int64_t value) {
    if (offset < 0 || value < 0)
        return KVB_EBAD;
    if (kvp_reserve(&m->t, &map_ops, NULL, 1ull << 60) != 0)
        return KVB_ENOMEM;
    uint64_t *p = map_find(m, offset);
    if (p != NULL) {
        p[1] = (uint64_t)value;
        return 0;
    }
    uint64_t bucket[2] = {(uint64_t)offset + 2, (uint64_t)value};
    kvp_insert(&m->t, mix64(bucket[0]), bucket);
    return 0;
}

/* Removes ``offset``; its length, or -1 if absent. */
int64_t kvb_map_del(struct kvb_map *m, int64_t offset) {
    if (offset < 0)
        return -1;
    uint64_t *p = map_find(m, offset);
    if (p == NULL)
        return -1;
    int64_t value = (int64_t)p[1];
    kvp_remove(&m->t, p, &map_ops, NULL);
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
            offsets[n] = (int64_t)(got[i][0] - 2);
            values[n++] = (int64_t)got[i][1];
        }
        if (k < want)
            break;
    }
    return n;
}
