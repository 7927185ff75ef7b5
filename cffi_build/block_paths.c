/* The TierManager's one-call paths over the native tier index (issue #24): a new block's
 * indexing, a read hit and a lease's end, each one C call instead of a dozen Python-level
 * field accesses. Compiled in one unit after block_index.c (cffi_build/block_index_build.py),
 * whose records, key table and heaps they work on, under the same single-owner rule:
 * every call under the owner's lock, every argument bounds-checked.
 */
#include <stdint.h>

/* ---- a new block in one call: TierManager's commit and adopt ------------------------ */

/* Indexes a new block (TierManager's commit and adopt, for a policy whose priority is the
 * last access): a record with kvb_new's fields, linked last in insertion order, one more
 * child counted on the block indexed under ``parent`` (after the link, as the manager
 * counts it), and, with no flag set, queued in its level's heap at (last_access,
 * last_access). Room for the key, the record and the heap place is reserved first:
 * KVB_EBAD (bad arguments, ``key`` already indexed, a parent with 2**32 - 1 children)
 * and KVB_ENOMEM change nothing. Returns slot | parent_counted << 32, where
 * parent_counted says a block was indexed under ``parent`` (else it is an orphan's). */
int64_t kvb_insert(struct kvb_table *t, const uint8_t *key, const uint8_t *parent,
                   int64_t nbytes, int level, int64_t place, int64_t length, int pkind,
                   int flags, uint32_t children, uint64_t last_access) {
    if (level < 0 || level >= KVB_LEVELS || find(t, key) >= 0)
        return KVB_EBAD;
    if (parent != NULL) {
        int self_parent = memcmp(parent, key, KVB_KEY) == 0;
        int64_t p = self_parent ? -1 : find(t, parent);
        if (self_parent ? children == UINT32_MAX
                        : p >= 0 && at(t, (uint32_t)p)->children == UINT32_MAX)
            return KVB_EBAD;
    }
    if (kvp_reserve(&t->keys, &key_ops, t, 1ull << 32) != 0)
        return KVB_ENOMEM;
    if (flags == 0 && heap_reserve(t, level) != 0)
        return KVB_ENOMEM;
    int64_t slot = kvb_new(t, key, parent, nbytes, level, place, length, pkind, flags,
                           children, last_access);
    if (slot < 0)
        return slot;  /* its own checks and its record: nothing linked yet */
    kvb_link(t, slot);  /* cannot fail: a fresh record, a key not indexed, room reserved */
    int64_t counted = parent != NULL && kvb_child(t, parent, 1) >= 0;
    if (flags == 0) {
        struct kvb_entry *e = at(t, (uint32_t)slot);
        e->queue_priority = (double)last_access;
        e->queue_seq = last_access;
        heap_insert(t, level, (uint32_t)slot);  /* cannot fail: room reserved */
    }
    return slot | counted << 32;
}

/* ---- leases: TierManager's read path in one call each ------------------------------ */

/* A read hit on ``key`` at ``tick`` (TierManager.acquire_read's hit path, for a policy
 * whose priority is the last access): one more reader, hit and tier hit, last access
 * ``tick`` (the hit counts stop at 2**32 - 1); queued again in its level's heap at
 * (tick, tick) unless a flag is set or, with ``leaves_only``, it has children. KVB_EBAD
 * (nothing changed) if it has 2**32 - 1 readers already. Returns -1 if ``key`` is not
 * indexed, else
 * slot | level << 32 | promote << 40, where promote says it is below the top level,
 * has ``promote_after`` tier hits or more and has no ``moving`` flag bit. */
int64_t kvb_read_hit(struct kvb_table *t, const uint8_t *key, uint64_t tick, int leaves_only,
                     uint32_t promote_after, uint32_t moving) {
    int64_t found = find(t, key);
    if (found < 0)
        return -1;
    uint32_t slot = (uint32_t)found;
    struct kvb_entry *e = at(t, slot);
    if (e->level >= KVB_LEVELS || e->readers == UINT32_MAX)
        return KVB_EBAD;
    int queue = !(e->flags || (leaves_only && e->children > 0));
    if (queue && heap_reserve(t, e->level) != 0)
        return KVB_ENOMEM;  /* before any change: nothing is leased */
    e->readers++;
    if (e->hits < UINT32_MAX)  /* counts that stop at their top, as statistics */
        e->hits++;
    if (e->tier_hits < UINT32_MAX)
        e->tier_hits++;
    e->last_access = tick;
    if (queue) {
        heap_remove(t, slot);
        e->queue_priority = (double)tick;
        e->queue_seq = tick;
        heap_insert(t, e->level, slot);  /* cannot fail: room reserved */
    }
    int64_t promote = e->level > 0 && e->tier_hits >= promote_after && !(e->flags & moving);
    return (int64_t)slot | (int64_t)e->level << 32 | promote << 40;
}

/* Ends one read lease of ``slot`` in generation ``gen``: KVB_EBAD if none is held (a
 * retired or reused record, or no readers), 1 if it was the last of a record whose
 * ``unlinked`` flag bit is set (its space is the caller's to free), else 0. */
int kvb_release_read(struct kvb_table *t, int64_t slot, uint32_t gen, uint32_t unlinked) {
    if (!valid(t, slot))
        return KVB_EBAD;
    struct kvb_entry *e = at(t, (uint32_t)slot);
    if (e->gen != gen || e->readers == 0)
        return KVB_EBAD;
    e->readers--;
    return e->readers == 0 && (e->flags & unlinked) != 0;
}
