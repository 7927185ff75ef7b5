/* The allocators' live tables in native memory (issue #24): extent offset -> length, an
 * open-addressing hash table with backward-shift deletion (no tombstones). Compiled in
 * one unit with block_index.c (cffi_build/block_index_build.py), whose KVB_EBAD and
 * KVB_ENOMEM it returns. Single owner: every call under the owner's lock.
 */
#include <stdint.h>
#include <stdlib.h>

/* ---- the allocator's live table: extent offset -> length ---------------------------- */

struct kvb_pair {
    uint64_t key;   /* offset + 1; 0: empty */
    int64_t value;
};

struct kvb_map {
    struct kvb_pair *b;
    uint64_t mask;
    uint64_t count;
};

static uint64_t mix64(uint64_t x) {
    x ^= x >> 33;
    x *= 0xFF51AFD7ED558CCDull;
    x ^= x >> 33;
    x *= 0xC4CEB9FE1A85EC53ull;
    x ^= x >> 33;
    return x;
}

struct kvb_map *kvb_map_open(void) {
    struct kvb_map *m = calloc(1, sizeof *m);
    if (m == NULL)
        return NULL;
    m->mask = 1023;
    m->b = calloc(m->mask + 1, sizeof *m->b);
    if (m->b == NULL) {
        free(m);
        return NULL;
    }
    return m;
}

void kvb_map_close(struct kvb_map *m) {
    if (m == NULL)
        return;
    free(m->b);
    free(m);
}

uint64_t kvb_map_count(const struct kvb_map *m) { return m->count; }

uint64_t kvb_map_bytes(const struct kvb_map *m) {
    return sizeof *m + (m->mask + 1) * sizeof *m->b;
}

static uint64_t map_find(const struct kvb_map *m, uint64_t k) {
    uint64_t i = mix64(k) & m->mask;
    while (m->b[i].key != 0 && m->b[i].key != k)
        i = (i + 1) & m->mask;
    return i;
}

/* The length at ``offset``, or -1. */
int64_t kvb_map_get(const struct kvb_map *m, int64_t offset) {
    if (offset < 0)
        return -1;
    const struct kvb_pair *p = &m->b[map_find(m, (uint64_t)offset + 1)];
    return p->key ? p->value : -1;
}

/* Sets ``offset`` -> ``value`` (value >= 0); 0, KVB_EBAD or KVB_ENOMEM. */
int kvb_map_set(struct kvb_map *m, int64_t offset, int64_t value) {
    if (offset < 0 || value < 0)
        return KVB_EBAD;
    if ((m->count + 1) * 8 > (m->mask + 1) * 7) {
        uint64_t cap = (m->mask + 1) * 2;
        struct kvb_pair *nb = calloc(cap, sizeof *nb);
        if (nb == NULL)
            return KVB_ENOMEM;
        for (uint64_t i = 0; i <= m->mask; i++) {
            if (m->b[i].key == 0)
                continue;
            uint64_t j = mix64(m->b[i].key) & (cap - 1);
            while (nb[j].key != 0)
                j = (j + 1) & (cap - 1);
            nb[j] = m->b[i];
        }
        free(m->b);
        m->b = nb;
        m->mask = cap - 1;
    }
    uint64_t k = (uint64_t)offset + 1;
    struct kvb_pair *p = &m->b[map_find(m, k)];
    if (p->key == 0) {
        p->key = k;
        m->count++;
    }
    p->value = value;
    return 0;
}

/* Removes ``offset``; its length, or -1 if absent (backward-shift deletion). */
int64_t kvb_map_del(struct kvb_map *m, int64_t offset) {
    if (offset < 0)
        return -1;
    uint64_t i = map_find(m, (uint64_t)offset + 1);
    if (m->b[i].key == 0)
        return -1;
    int64_t value = m->b[i].value;
    for (uint64_t j = (i + 1) & m->mask;; j = (j + 1) & m->mask) {
        if (m->b[j].key == 0)
            break;
        uint64_t home = mix64(m->b[j].key) & m->mask;
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            m->b[i] = m->b[j];
            i = j;
        }
    }
    m->b[i].key = 0;
    m->b[i].value = 0;
    m->count--;
    return value;
}

/* Up to ``cap`` (offset, length) pairs in table order from bucket ``*from``; ``*from``
 * becomes the next bucket to read (past the end: done). */
uint64_t kvb_map_items(const struct kvb_map *m, uint64_t *from, int64_t *offsets,
                       int64_t *values, uint64_t cap) {
    uint64_t n = 0, i = *from;
    for (; i <= m->mask && n < cap; i++) {
        if (m->b[i].key == 0)
            continue;
        offsets[n] = (int64_t)(m->b[i].key - 1);
        values[n++] = m->b[i].value;
    }
    *from = i;
    return n;
}
