/* An open-addressing hash table (linear probing, backward-shift deletion) that grows
 * progressively (issue #24): the native index's key table and the allocators' live
 * tables are both one. Compiled first in the unit of cffi_build/block_index_build.py.
 *
 * Why progressive: doubling a table at once rehashes every entry under the owner's lock
 * (at ten million blocks, a few hundred ms during which no get is served). Here a growth
 * only allocates the bigger table; every later insert moves KVP_STEP buckets of the old
 * one, and lookups search the new table, then what is left of the old.
 *
 * Buckets are ``width`` 64-bit words; word 0 is the owner's and must be >= 2 for a stored
 * entry (0: empty; KVP_MOVED marks an old bucket already moved or removed, so a probe
 * in the old table goes past it). The owner tells the hash of a stored bucket and how a
 * query matches one (``struct kvp_ops``).
 *
 * Invariants: entries are never in both tables. The old table only loses entries (a
 * moved or removed one becomes KVP_MOVED) and its empty buckets stay empty, so a probe
 * there still ends at one (at most 7/8 full, it has some); its pages below the last
 * empty bucket the moves passed go back to the kernel and read as empty
 * (``kvp_release_drained`` says why that is safe). The growth completes before
 * the new table is 7/8 full again: it doubles, which leaves room for 7/8 of the old
 * size in inserts, and each insert moves KVP_STEP >= 2 buckets. Single owner: every
 * call under the owner's lock.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE  /* mremap */
#endif
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

/* ---- big arrays: records' chunks, heaps, hash tables ----------------------------------
 * Straight from mmap: the kernel zeroes a page when it is first touched, and mremap grows
 * an array by moving page tables, so neither making nor growing one copies or clears
 * megabytes under the owner's lock. (malloc would: once a large free has raised its mmap
 * threshold, an 8 MiB calloc comes from the heap and is cleared at once, and a realloc
 * copies; at ten million blocks those were 5-13 ms holds.) Under AddressSanitizer they
 * come from calloc and realloc, so that overflows are caught; so they do off Linux. */

#if defined(__SANITIZE_ADDRESS__) || !defined(__linux__)
#define KVB_BIG_MALLOC 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define KVB_BIG_MALLOC 1
#endif
#endif

/* ``bytes`` zeroed bytes, or NULL. */
static void *kvb_big_zalloc(size_t bytes) {
#ifdef KVB_BIG_MALLOC
    return calloc(1, bytes);
#else
    void *p = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
    return p == MAP_FAILED ? NULL : p;
#endif
}

/* ``p`` (``old_bytes``, or NULL) grown to ``new_bytes``, the new part zeroed; NULL (and
 * ``p`` unchanged) if there is no memory. */
static void *kvb_big_grow(void *p, size_t old_bytes, size_t new_bytes) {
    if (p == NULL)
        return kvb_big_zalloc(new_bytes);
#ifdef KVB_BIG_MALLOC
    unsigned char *q = realloc(p, new_bytes);
    if (q != NULL)
        memset(q + old_bytes, 0, new_bytes - old_bytes);
    return q;
#else
    void *q = mremap(p, old_bytes, new_bytes, MREMAP_MAYMOVE);
    return q == MAP_FAILED ? NULL : q;
#endif
}

#define KVB_RELEASE_BYTES (1u << 20)

/* Gives the pages of ``p``'s first ``bytes`` (a multiple of the page size) back to the
 * kernel if it takes them; reading them again reads zeros (off Linux and under ASan,
 * they are zeroed: the same reads). Best effort: pages it keeps read as they were. */
static void kvb_big_release(void *p, size_t bytes) {
#ifdef KVB_BIG_MALLOC
    memset(p, 0, bytes);
#else
    (void)madvise(p, bytes, MADV_DONTNEED);
#endif
}

static void kvb_big_free(void *p, size_t bytes) {
    if (p == NULL)
        return;
#ifdef KVB_BIG_MALLOC
    (void)bytes;
    free(p);
#else
    munmap(p, bytes);
#endif
}

/* ---- the table ------------------------------------------------------------------------ */

#define KVP_MOVED 1u
#define KVP_STEP 16u
#define KVP_MIN_BUCKETS 1024u
#define KVP_ENOMEM (-3)

struct kvp_ops {
    uint64_t (*hash)(const uint64_t *bucket, const void *ctx);
    int (*match)(const uint64_t *bucket, const void *query, const void *ctx);
};

struct kvp_table {
    uint64_t *b;        /* the table inserts go to */
    uint64_t mask;      /* its buckets - 1 (a power of two - 1) */
    uint64_t *old;      /* the table being drained into ``b``, or NULL */
    uint64_t old_mask;
    uint64_t cursor;    /* the next old bucket to move */
    uint64_t last_empty;  /* the last empty old bucket the cursor passed, + 1 (0: none) */
    size_t released;    /* bytes at the old table's start given back to the kernel (or
                         * that it kept: they read as they were, which is as right) */
    uint64_t count;     /* entries, both tables */
    uint32_t width;     /* words per bucket */
};

static inline uint64_t *kvp_at(uint64_t *a, uint32_t width, uint64_t i) {
    return a + i * width;
}

/* Bytes of a table of ``mask + 1`` buckets. */
static inline size_t kvp_size(uint64_t mask, uint32_t width) {
    return (size_t)(mask + 1) * width * sizeof(uint64_t);
}

static int kvp_init(struct kvp_table *t, uint32_t width) {
    memset(t, 0, sizeof *t);
    t->width = width;
    t->mask = KVP_MIN_BUCKETS - 1;
    t->b = kvb_big_zalloc(kvp_size(KVP_MIN_BUCKETS - 1, width));
    return t->b == NULL ? KVP_ENOMEM : 0;
}

static void kvp_free(struct kvp_table *t) {
    kvb_big_free(t->b, kvp_size(t->mask, t->width));
    if (t->old != NULL)
        kvb_big_free(t->old, kvp_size(t->old_mask, t->width));
    t->b = t->old = NULL;
}

/* Bytes of both tables. */
static uint64_t kvp_bytes(const struct kvp_table *t) {
    uint64_t buckets = t->mask + 1 + (t->old != NULL ? t->old_mask + 1 : 0);
    return buckets * t->width * sizeof(uint64_t);
}

/* Old buckets not moved yet (0: not growing). */
static uint64_t kvp_moving(const struct kvp_table *t) {
    return t->old != NULL ? t->old_mask + 1 - t->cursor : 0;
}

/* The stored bucket of ``a`` (``mask + 1`` buckets) matching ``query``, probing from
 * ``h``'s home past KVP_MOVED marks (only an old table has them) to an empty bucket. */
static uint64_t *kvp_probe(uint64_t *a, uint64_t mask, uint32_t width, uint64_t h,
                           const void *query, const struct kvp_ops *ops, const void *ctx) {
    for (uint64_t i = h & mask;; i = (i + 1) & mask) {
        uint64_t *p = kvp_at(a, width, i);
        if (p[0] == 0)
            return NULL;
        if (p[0] != KVP_MOVED && ops->match(p, query, ctx))
            return p;
    }
}

/* The stored bucket matching ``query`` (whose hash is ``h``), or NULL. */
static uint64_t *kvp_find(const struct kvp_table *t, uint64_t h, const void *query,
                          const struct kvp_ops *ops, const void *ctx) {
    uint64_t *p = kvp_probe(t->b, t->mask, t->width, h, query, ops, ctx);
    if (p == NULL && t->old != NULL)
        p = kvp_probe(t->old, t->old_mask, t->width, h, query, ops, ctx);
    return p;
}

/* Asks the CPU to fetch the home bucket of hash ``h`` in both tables (a hint: no fault,
 * no change), so that a caller about to look up several keys has their cache misses
 * overlap instead of taking them one after another. */
static inline void kvp_prefetch_home(const struct kvp_table *t, uint64_t h) {
    __builtin_prefetch(kvp_at(t->b, t->width, h & t->mask));
    if (t->old != NULL)
        __builtin_prefetch(kvp_at(t->old, t->width, h & t->old_mask));
}

/* The empty bucket of the new table where an entry of hash ``h`` goes. */
static uint64_t *kvp_empty_for(const struct kvp_table *t, uint64_t h) {
    uint64_t i = h & t->mask;
    while (kvp_at(t->b, t->width, i)[0] != 0)
        i = (i + 1) & t->mask;
    return kvp_at(t->b, t->width, i);
}

/* Gives back the old table's pages below its last empty bucket the cursor passed, a
 * megabyte at a time, so that freeing a drained table of hundreds of megabytes at once
 * (12 ms at ten million blocks) is spread over the growth. Safe to read as empty: an
 * entry whose home is below an empty bucket E that the cursor passed sits below E (its
 * probe run from its home has no empty bucket), so it was moved already, and a probe
 * there may end early; an entry further on is never looked for below E. */
static void kvp_release_drained(struct kvp_table *t) {
    if (t->last_empty == 0)
        return;
    static size_t page;
    if (page == 0) {
        long got = sysconf(_SC_PAGESIZE);
        page = got > 0 ? (size_t)got : 4096;
    }
    size_t below = (size_t)(t->last_empty - 1) * t->width * sizeof(uint64_t);
    size_t want = below / page * page;
    if (want < t->released + KVB_RELEASE_BYTES)
        return;
    kvb_big_release((unsigned char *)t->old + t->released, want - t->released);
    t->released = want;
}

/* Moves up to ``n`` old buckets into the new table; frees the old one when drained. */
static void kvp_step(struct kvp_table *t, uint64_t n, const struct kvp_ops *ops,
                     const void *ctx) {
    size_t bytes = (size_t)t->width * sizeof(uint64_t);
    while (t->old != NULL && n-- > 0) {
        uint64_t *p = kvp_at(t->old, t->width, t->cursor);
        if (p[0] > KVP_MOVED) {
            memcpy(kvp_empty_for(t, ops->hash(p, ctx)), p, bytes);
            p[0] = KVP_MOVED;  /* a probe for an entry further on goes past it */
        } else if (p[0] == 0) {  /* it stays empty: it ends probes, as before the growth */
            t->last_empty = t->cursor + 1;
        }
        if (++t->cursor > t->old_mask) {
            kvb_big_free(t->old, kvp_size(t->old_mask, t->width));
            t->old = NULL;
            t->cursor = t->last_empty = 0;
            t->released = 0;
        }
    }
    if (t->old != NULL)
        kvp_release_drained(t);
}

/* Room for one more entry: moves KVP_STEP old buckets, and starts a growth when the
 * table would pass 7/8 full. 0, or KVP_ENOMEM (nothing changed but moves). Call before
 * ``kvp_find`` when an insert may follow: a step moves buckets. */
static int kvp_reserve(struct kvp_table *t, const struct kvp_ops *ops, const void *ctx,
                       uint64_t max_buckets) {
    kvp_step(t, KVP_STEP, ops, ctx);
    if ((t->count + 1) * 8 <= (t->mask + 1) * 7)
        return 0;
    /* Unreachable while growing (see the invariants); finish the growth if it were. */
    kvp_step(t, UINT64_MAX, ops, ctx);
    uint64_t cap = (t->mask + 1) * 2;
    if (cap > max_buckets)
        return KVP_ENOMEM;
    uint64_t *nb = kvb_big_zalloc(kvp_size(cap - 1, t->width));
    if (nb == NULL)
        return KVP_ENOMEM;
    t->old = t->b;
    t->old_mask = t->mask;
    t->cursor = t->last_empty = 0;
    t->released = 0;
    t->b = nb;
    t->mask = cap - 1;
    kvp_step(t, KVP_STEP, ops, ctx);
    return 0;
}

/* Stores ``bucket`` (``width`` words, word 0 >= 2) of hash ``h``, after ``kvp_reserve``
 * and a ``kvp_find`` that did not find it. */
static void kvp_insert(struct kvp_table *t, uint64_t h, const uint64_t *bucket) {
    memcpy(kvp_empty_for(t, h), bucket, (size_t)t->width * sizeof(uint64_t));
    t->count++;
}

/* Removes the stored bucket ``p`` (from ``kvp_find``, nothing changed since). */
static void kvp_remove(struct kvp_table *t, uint64_t *p, const struct kvp_ops *ops,
                       const void *ctx) {
    size_t bytes = (size_t)t->width * sizeof(uint64_t);
    t->count--;
    if (t->old != NULL && p >= t->old && p < kvp_at(t->old, t->width, t->old_mask + 1)) {
        memset(p, 0, bytes);
        p[0] = KVP_MOVED;  /* no shift in the old table: moves go on in bucket order */
        return;
    }
    uint64_t i = (uint64_t)(p - t->b) / t->width;
    for (uint64_t j = (i + 1) & t->mask;; j = (j + 1) & t->mask) {
        uint64_t *q = kvp_at(t->b, t->width, j);
        if (q[0] == 0)
            break;
        uint64_t home = ops->hash(q, ctx) & t->mask;
        /* Move q back to i unless its home lies cyclically in (i, j]. */
        int stays = i <= j ? (home > i && home <= j) : (home > i || home <= j);
        if (!stays) {
            memcpy(kvp_at(t->b, t->width, i), q, bytes);
            i = j;
        }
    }
    memset(kvp_at(t->b, t->width, i), 0, bytes);
}

/* Up to ``cap`` stored buckets from position ``*from`` (the old table's buckets first,
 * then the new one's); ``*from`` becomes the next position, past the end when done.
 * Positions shift when a table changes: no insert or remove between calls. */
static uint64_t kvp_items(const struct kvp_table *t, uint64_t *from, const uint64_t **out,
                          uint64_t cap) {
    uint64_t olds = t->old != NULL ? t->old_mask + 1 : 0, end = olds + t->mask + 1;
    uint64_t n = 0, i = *from;
    for (; i < end && n < cap; i++) {
        const uint64_t *p = i < olds ? kvp_at(t->old, t->width, i)
                                     : kvp_at(t->b, t->width, i - olds);
        if (p[0] > KVP_MOVED)
            out[n++] = p;
    }
    *from = i;
    return n;
}
