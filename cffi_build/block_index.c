/* The tier index in native memory (issue #24): 16-byte keys to slots, one fixed-size
 * record per block, insertion order, and one indexed min-heap per tier level.
 *
 * Records live in chunks of KVB_CHUNK entries that are never moved or freed while the
 * table is open, so a pointer to a record (what Python holds for a leased block, read
 * outside the owner's lock) stays valid. A retired slot goes to the back of a FIFO and is
 * reused only once KVB_QUARANTINE other slots wait there, so a stale pointer sees the
 * old block's fields for a long while rather than another block at once.
 *
 * The key table is a progressive hash table (probe_table.c): growing it never rehashes
 * every key at once. The allocators' live tables (extent offset -> length) are in
 * block_map.c.
 *
 * Single owner: every call is made under the owner's lock (cffi releases the GIL around
 * each call; nothing here touches Python objects). Every slot and level argument is
 * bounds-checked; a bad one returns KVB_EBAD and changes nothing.
 */
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define KVB_KEY 16
#define KVB_CHUNK_BITS 16
#define KVB_CHUNK (1u << KVB_CHUNK_BITS)
#define KVB_NONE 0xFFFFFFFFu
#define KVB_LEVELS 8
#define KVB_QUARANTINE 4096u
#define KVB_EBAD (-2)
#define KVB_ENOMEM (-3)

struct kvb_entry {
    uint8_t key[KVB_KEY];
    uint8_t parent[KVB_KEY];
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
    uint32_t heap_pos;  /* index in heaps[heap_id], KVB_NONE when in no heap */
    uint32_t gen;       /* bumped when the slot is retired */
    uint32_t prev;      /* insertion order (linked records only) */
    uint32_t next;
    uint8_t level;
    uint8_t flags;
    uint8_t has_parent;
    uint8_t pkind;      /* 0: no place, 1: int place, 2: place kept by the owner */
    uint8_t heap_id;
    uint8_t linked;     /* in the key table */
    uint8_t used;       /* allocated, not retired */
    uint8_t pad;
};

struct kvb_heap {
    uint32_t *a;
    uint32_t n;
    uint32_t cap;
};

struct kvb_table {
    struct kvb_entry **chunks;
    uint32_t nchunks;
    uint32_t chunk_cap;
    uint32_t nslots;      /* slots handed out so far (high water) */
    uint32_t *freeq;      /* FIFO ring of retired slots */
    uint32_t fq_head;
    uint32_t fq_len;
    uint32_t fq_cap;
    /* Key table, one word a bucket: (slot + 1) << 32 | the low 32 bits of the key's hash
     * (which place it: 2**32 buckets at most). */
    struct kvp_table keys;
    uint32_t head;
    uint32_t tail;
    struct kvb_heap heaps[KVB_LEVELS];
};

int kvb_api_version(void) { return 5; }

static uint64_t kvb_hash(const uint8_t *key) {
    uint64_t a, b;
    memcpy(&a, key, 8);
    memcpy(&b, key + 8, 8);
    uint64_t h = a * 0x9E3779B97F4A7C15ull ^ (b + 0x632BE59BD9B4E019ull);
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    h *= 0xD6E8FEB86659FD93ull;
    h ^= h >> 32;
    return h;
}

static inline struct kvb_entry *at(const struct kvb_table *t, uint32_t slot) {
    return &t->chunks[slot >> KVB_CHUNK_BITS][slot & (KVB_CHUNK - 1)];
}

static inline int valid(const struct kvb_table *t, int64_t slot) {
    return slot >= 0 && slot < (int64_t)t->nslots && at(t, (uint32_t)slot)->used;
}

struct kvb_table *kvb_open(void) {
    struct kvb_table *t = calloc(1, sizeof *t);
    if (t == NULL)
        return NULL;
    if (kvp_init(&t->keys, 1) != 0) {
        free(t);
        return NULL;
    }
    t->head = t->tail = KVB_NONE;
    return t;
}

void kvb_close(struct kvb_table *t) {
    if (t == NULL)
        return;
    for (uint32_t i = 0; i < t->nchunks; i++)
        kvb_big_free(t->chunks[i], KVB_CHUNK * sizeof(struct kvb_entry));
    free(t->chunks);
    free(t->freeq);
    kvp_free(&t->keys);
    for (int i = 0; i < KVB_LEVELS; i++)
        kvb_big_free(t->heaps[i].a, (size_t)t->heaps[i].cap * sizeof(uint32_t));
    free(t);
}

uint64_t kvb_count(const struct kvb_table *t) { return t->keys.count; }

/* Buckets of the key table's old half still to move (0: not growing). */
uint64_t kvb_moving(const struct kvb_table *t) { return kvp_moving(&t->keys); }

uint32_t kvb_nchunks(const struct kvb_table *t) { return t->nchunks; }

struct kvb_entry *kvb_chunk(const struct kvb_table *t, uint32_t i) {
    return i < t->nchunks ? t->chunks[i] : NULL;
}

/* Bytes of native memory the table holds (records, key table, heaps, free ring). */
uint64_t kvb_native_bytes(const struct kvb_table *t) {
    uint64_t n = sizeof *t + (uint64_t)t->nchunks * KVB_CHUNK * sizeof(struct kvb_entry)
        + (uint64_t)t->chunk_cap * sizeof *t->chunks + kvp_bytes(&t->keys)
        + (uint64_t)t->fq_cap * sizeof *t->freeq;
    for (int i = 0; i < KVB_LEVELS; i++)
        n += (uint64_t)t->heaps[i].cap * sizeof(uint32_t);
    return n;
}

/* ---- slots ------------------------------------------------------------------------ */

static int add_chunk(struct kvb_table *t) {
    if (t->nchunks == t->chunk_cap) {
        uint32_t cap = t->chunk_cap ? t->chunk_cap * 2 : 16;
        if (cap > (KVB_NONE >> KVB_CHUNK_BITS))
            cap = KVB_NONE >> KVB_CHUNK_BITS;
        if (cap <= t->nchunks)
            return KVB_ENOMEM;
        struct kvb_entry **c = realloc(t->chunks, cap * sizeof *c);
        if (c == NULL)
            return KVB_ENOMEM;
        t->chunks = c;
        t->chunk_cap = cap;
    }
    struct kvb_entry *chunk = kvb_big_zalloc(KVB_CHUNK * sizeof *chunk);
    if (chunk == NULL)
        return KVB_ENOMEM;
    t->chunks[t->nchunks++] = chunk;
    return 0;
}

/* A fresh record for ``key`` (not yet in the key table) with its fields (``parent``:
 * NULL for none; ``pkind`` as the record's); its slot, KVB_ENOMEM, or KVB_EBAD for a level
 * or place kind out of range or a negative size or length. */
int64_t kvb_new(struct kvb_table *t, const uint8_t *key, const uint8_t *parent, int64_t nbytes,
                int level, int64_t place, int64_t length, int pkind, int flags,
                uint32_t children, uint64_t last_access) {
    if (level < 0 || level >= KVB_LEVELS || pkind < 0 || pkind > 2 || nbytes < 0
            || length < 0 || flags < 0 || flags > 0xFF)
        return KVB_EBAD;
    uint32_t slot;
    if (t->fq_len > KVB_QUARANTINE) {
        slot = t->freeq[t->fq_head];
        t->fq_head = (t->fq_head + 1) % t->fq_cap;
        t->fq_len--;
    } else {
        if (t->nslots == KVB_NONE - 1)
            return KVB_ENOMEM;
        if ((t->nslots >> KVB_CHUNK_BITS) >= t->nchunks && add_chunk(t) != 0)
            return KVB_ENOMEM;
        slot = t->nslots++;
    }
    struct kvb_entry *e = at(t, slot);
    uint32_t gen = e->gen;
    memset(e, 0, sizeof *e);
    e->gen = gen;
    memcpy(e->key, key, KVB_KEY);
    if (parent != NULL) {
        memcpy(e->parent, parent, KVB_KEY);
        e->has_parent = 1;
    }
    e->nbytes = nbytes;
    e->level = (uint8_t)level;
    e->place = place;
    e->length = length;
    e->pkind = (uint8_t)pkind;
    e->flags = (uint8_t)flags;
    e->children = children;
    e->last_access = last_access;
    e->heap_pos = e->prev = e->next = KVB_NONE;
    e->used = 1;
    return slot;
}

static void heap_remove(struct kvb_table *t, uint32_t slot);
int kvb_unlink(struct kvb_table *t, int64_t slot);

/* The record of ``slot`` is done with: out of its heap, slot queued for reuse. */
int kvb_retire(struct kvb_table *t, int64_t slot) {
    if (!valid(t, slot) || at(t, (uint32_t)slot)->linked)
        return KVB_EBAD;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    heap_remove(t, (uint32_t)slot);
    if (t->fq_len == t->fq_cap) {
        uint32_t cap = t->fq_cap ? t->fq_cap * 2 : 1024;
        uint32_t *q = malloc((size_t)cap * sizeof *q);
        if (q == NULL)
            return KVB_ENOMEM;  /* the slot stays used: leaked, never reused */
        for (uint32_t i = 0; i < t->fq_len; i++)
            q[i] = t->freeq[(t->fq_head + i) % t->fq_cap];
        free(t->freeq);
        t->freeq = q;
        t->fq_head = 0;
        t->fq_cap = cap;
    }
    t->freeq[(t->fq_head + t->fq_len) % t->fq_cap] = (uint32_t)slot;
    t->fq_len++;
    e->used = 0;
    e->gen++;
    return 0;
}

/* ---- the key table ----------------------------------------------------------------- */

struct key_query {
    const uint8_t *key;
    uint64_t h;  /* the low 32 bits of its hash */
};

static uint64_t key_bucket_hash(const uint64_t *bucket, const void *ctx) {
    (void)ctx;
    return bucket[0] & 0xFFFFFFFFull;
}

static int key_bucket_match(const uint64_t *bucket, const void *query, const void *ctx) {
    const struct key_query *q = query;
    if ((bucket[0] & 0xFFFFFFFFull) != q->h)
        return 0;
    uint32_t slot = (uint32_t)(bucket[0] >> 32) - 1;
    return memcmp(at(ctx, slot)->key, q->key, KVB_KEY) == 0;
}

static const struct kvp_ops key_ops = {key_bucket_hash, key_bucket_match};

static struct key_query key_query_of(const uint8_t *key) {
    struct key_query q = {key, kvb_hash(key) & 0xFFFFFFFFull};
    return q;
}

static uint64_t *find_query(const struct kvb_table *t, const struct key_query *q) {
    return kvp_find(&t->keys, q->h, q, &key_ops, t);
}

static uint64_t *find_bucket(const struct kvb_table *t, const uint8_t *key) {
    struct key_query q = key_query_of(key);
    return find_query(t, &q);
}

static int64_t find(const struct kvb_table *t, const uint8_t *key) {
    const uint64_t *b = find_bucket(t, key);
    return b == NULL ? -1 : (int64_t)(uint32_t)((b[0] >> 32) - 1);
}

int64_t kvb_find(const struct kvb_table *t, const uint8_t *key) {
    return find(t, key);
}

/* Adds ``delta`` (+1 or -1) to the children of the block indexed under ``key``: its
 * count after, -1 if ``key`` is not indexed, KVB_EBAD (nothing changed) if the count would
 * leave 0..2**32-1 or ``delta`` is neither. */
int64_t kvb_child(struct kvb_table *t, const uint8_t *key, int delta) {
    int64_t slot = find(t, key);
    if (slot < 0)
        return -1;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    if (delta == 1 && e->children < 0xFFFFFFFFu)
        e->children++;
    else if (delta == -1 && e->children > 0)
        e->children--;
    else
        return KVB_EBAD;
    return e->children;
}

/* A bucket whose low 32 bits are the query's hash: the first candidate of a lookup,
 * found without reading its record (what ``kvb_prefix_length`` fetches ahead). */
static int key_hash_match(const uint64_t *bucket, const void *query, const void *ctx) {
    (void)ctx;
    return (bucket[0] & 0xFFFFFFFFull) == ((const struct key_query *)query)->h;
}

static const struct kvp_ops key_hash_ops = {key_bucket_hash, key_hash_match};

#define KVB_PREFIX_WINDOW 16u

/* How many of the ``n`` keys (16 bytes each, back to back) are present before the
 * first absent one.
 *
 * Why in windows: at tens of millions of blocks each lookup misses the caches twice (its
 * bucket, then its record's key), and one key after another those misses queue. Per
 * window of keys this first asks for every home bucket, then for the record of every
 * first hash match, and only then looks the keys up in order, mostly from cache: the
 * misses overlap. The answer is the plain lookups', whatever the hints fetched; at most
 * one window is looked at past the first absent key. */
uint64_t kvb_prefix_length(const struct kvb_table *t, const uint8_t *keys, uint64_t n) {
    struct key_query q[KVB_PREFIX_WINDOW];
    for (uint64_t base = 0; base < n; base += KVB_PREFIX_WINDOW) {
        uint32_t m = n - base < KVB_PREFIX_WINDOW ? (uint32_t)(n - base) : KVB_PREFIX_WINDOW;
        for (uint32_t j = 0; j < m; j++) {
            q[j] = key_query_of(keys + (base + j) * KVB_KEY);
            kvp_prefetch_home(&t->keys, q[j].h);
        }
        for (uint32_t j = 0; j < m; j++) {
            const uint64_t *b = kvp_find(&t->keys, q[j].h, &q[j], &key_hash_ops, t);
            if (b != NULL)
                __builtin_prefetch(at(t, (uint32_t)(b[0] >> 32) - 1)->key);
        }
        for (uint32_t j = 0; j < m; j++)
            if (find_query(t, &q[j]) == NULL)
                return base + j;
    }
    return n;
}

/* Puts ``slot`` in the key table, last in insertion order. KVB_EBAD if its key is
 * already there (or the slot is not a fresh record). */
int kvb_link(struct kvb_table *t, int64_t slot) {
    if (!valid(t, slot) || at(t, (uint32_t)slot)->linked)
        return KVB_EBAD;
    /* At most 7/8 full; the hash's low 32 bits place a key, so 2**32 buckets at most. */
    if (kvp_reserve(&t->keys, &key_ops, t, 1ull << 32) != 0)
        return KVB_ENOMEM;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    struct key_query q = key_query_of(e->key);
    if (find_query(t, &q) != NULL)
        return KVB_EBAD;
    uint64_t bucket = ((uint64_t)slot + 1) << 32 | q.h;
    kvp_insert(&t->keys, q.h, &bucket);
    e->linked = 1;
    e->prev = t->tail;
    e->next = KVB_NONE;
    if (t->tail != KVB_NONE)
        at(t, t->tail)->next = (uint32_t)slot;
    else
        t->head = (uint32_t)slot;
    t->tail = (uint32_t)slot;
    return 0;
}

/* Takes ``slot`` out of the key table and the insertion order. */
int kvb_unlink(struct kvb_table *t, int64_t slot) {
    if (!valid(t, slot) || !at(t, (uint32_t)slot)->linked)
        return KVB_EBAD;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    uint64_t *b = find_bucket(t, e->key);
    if (b == NULL || (int64_t)(uint32_t)((b[0] >> 32) - 1) != slot)
        return KVB_EBAD;
    kvp_remove(&t->keys, b, &key_ops, t);
    e->linked = 0;
    if (e->prev != KVB_NONE)
        at(t, e->prev)->next = e->next;
    else
        t->head = e->next;
    if (e->next != KVB_NONE)
        at(t, e->next)->prev = e->prev;
    else
        t->tail = e->prev;
    e->prev = e->next = KVB_NONE;
    return 0;
}

/* Unindexes ``slot`` for good: out of the key table, the insertion order and its heap
 * (its seq forgotten), with ``flag`` set in its flags; its record lives on until retired
 * (leases). */
int kvb_unlink_entry(struct kvb_table *t, int64_t slot, int flag) {
    if (flag < 0 || flag > 0xFF)
        return KVB_EBAD;
    int rc = kvb_unlink(t, slot);
    if (rc != 0)
        return rc;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    heap_remove(t, (uint32_t)slot);
    e->queue_seq = 0;
    e->flags = (uint8_t)(e->flags | flag);
    return 0;
}

/* Up to ``cap`` linked slots in insertion order from the cursor ``*from`` (KVB_NONE:
 * the first); ``*from`` becomes the next slot to read, KVB_NONE at the end. */
uint64_t kvb_slots(const struct kvb_table *t, uint32_t *from, uint32_t *out, uint64_t cap) {
    uint32_t s = *from == KVB_NONE ? t->head : *from;
    uint64_t n = 0;
    if (s != KVB_NONE && !(s < t->nslots && at(t, s)->linked)) {
        *from = KVB_NONE;
        return 0;
    }
    while (s != KVB_NONE && n < cap) {
        out[n++] = s;
        s = at(t, s)->next;
    }
    *from = s;
    return n;
}

/* ---- heaps: (queue_priority, queue_seq) min-first, one per level ------------------- */

static inline int less(const struct kvb_table *t, uint32_t a, uint32_t b) {
    const struct kvb_entry *x = at(t, a), *y = at(t, b);
    if (x->queue_priority != y->queue_priority)
        return x->queue_priority < y->queue_priority;
    return x->queue_seq < y->queue_seq;
}

static void place_at(struct kvb_table *t, struct kvb_heap *h, uint32_t i, uint32_t slot) {
    h->a[i] = slot;
    at(t, slot)->heap_pos = i;
}

static void sift_up(struct kvb_table *t, struct kvb_heap *h, uint32_t i) {
    uint32_t slot = h->a[i];
    while (i > 0) {
        uint32_t p = (i - 1) / 2;
        if (!less(t, slot, h->a[p]))
            break;
        place_at(t, h, i, h->a[p]);
        i = p;
    }
    place_at(t, h, i, slot);
}

static void sift_down(struct kvb_table *t, struct kvb_heap *h, uint32_t i) {
    uint32_t slot = h->a[i];
    for (;;) {
        uint32_t c = 2 * i + 1;
        if (c >= h->n)
            break;
        if (c + 1 < h->n && less(t, h->a[c + 1], h->a[c]))
            c++;
        if (!less(t, h->a[c], slot))
            break;
        place_at(t, h, i, h->a[c]);
        i = c;
    }
    place_at(t, h, i, slot);
}

static void heap_remove(struct kvb_table *t, uint32_t slot) {
    struct kvb_entry *e = at(t, slot);
    if (e->heap_pos == KVB_NONE)
        return;
    struct kvb_heap *h = &t->heaps[e->heap_id];
    uint32_t i = e->heap_pos;
    e->heap_pos = KVB_NONE;
    uint32_t last = h->a[--h->n];
    if (i == h->n)
        return;
    place_at(t, h, i, last);
    sift_up(t, h, i);
    sift_down(t, h, at(t, last)->heap_pos);
}

/* Room for one more slot in ``level``'s heap. */
static int heap_reserve(struct kvb_table *t, int level) {
    struct kvb_heap *h = &t->heaps[level];
    if (h->n == h->cap) {
        uint32_t cap = h->cap ? h->cap * 2 : 1024;
        if (cap <= h->cap)
            return KVB_ENOMEM;
        uint32_t *a = kvb_big_grow(h->a, (size_t)h->cap * sizeof *a, (size_t)cap * sizeof *a);
        if (a == NULL)
            return KVB_ENOMEM;
        h->a = a;
        h->cap = cap;
    }
    return 0;
}

static int heap_insert(struct kvb_table *t, int level, uint32_t slot) {
    if (heap_reserve(t, level) != 0)
        return KVB_ENOMEM;
    struct kvb_heap *h = &t->heaps[level];
    struct kvb_entry *e = at(t, slot);
    e->heap_id = (uint8_t)level;
    h->a[h->n] = slot;
    e->heap_pos = h->n++;
    sift_up(t, h, e->heap_pos);
    return 0;
}

/* Queues ``slot`` in ``level``'s heap at (priority, seq), out of any heap it was in. */
int kvb_heap_push(struct kvb_table *t, int level, int64_t slot, double priority,
                  uint64_t seq) {
    if (level < 0 || level >= KVB_LEVELS || !valid(t, slot))
        return KVB_EBAD;
    heap_remove(t, (uint32_t)slot);
    struct kvb_entry *e = at(t, (uint32_t)slot);
    e->queue_priority = priority;
    e->queue_seq = seq;
    return heap_insert(t, level, (uint32_t)slot);
}

/* Queues ``slot`` again at its kept (priority, seq) if its seq is still ``seq`` and it
 * is in no heap (a deferred victim's return); 1 if queued, 0 if stale. */
int kvb_heap_restore(struct kvb_table *t, int level, int64_t slot, uint64_t seq) {
    if (level < 0 || level >= KVB_LEVELS || slot < 0 || slot >= (int64_t)t->nslots)
        return KVB_EBAD;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    if (!e->used || e->queue_seq != seq || seq == 0 || e->heap_pos != KVB_NONE)
        return 0;
    int rc = heap_insert(t, level, (uint32_t)slot);
    return rc == 0 ? 1 : rc;
}

/* Out of its heap (its seq kept). */
int kvb_heap_remove(struct kvb_table *t, int64_t slot) {
    if (!valid(t, slot))
        return KVB_EBAD;
    heap_remove(t, (uint32_t)slot);
    return 0;
}

/* The slot at the top of ``level``'s heap, taken out of it (its seq kept); -1 if empty. */
int64_t kvb_heap_pop(struct kvb_table *t, int level) {
    if (level < 0 || level >= KVB_LEVELS)
        return KVB_EBAD;
    struct kvb_heap *h = &t->heaps[level];
    if (h->n == 0)
        return -1;
    uint32_t slot = h->a[0];
    heap_remove(t, slot);
    return slot;
}

int64_t kvb_heap_len(const struct kvb_table *t, int level) {
    if (level < 0 || level >= KVB_LEVELS)
        return KVB_EBAD;
    return t->heaps[level].n;
}
