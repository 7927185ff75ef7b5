/*
 * Batched positional I/O through io_uring for the SSD tier (tiers/ssd.py).
 *
 * A batch of N readv/writev operations against one fd is started with
 * kv_ring_start and advanced with kv_ring_step, which submits up to the in-flight
 * limit in one io_uring_enter, waits for at least one completion and reaps all
 * posted ones in bulk, returning which operations finished: the caller can verify
 * those while the rest are still in flight. The caller must keep stepping until
 * the batch is complete (step returns 0 or -errno) before it releases the
 * buffers: only then does the kernel no longer touch them. kv_ring_run does the
 * whole batch in one call.
 *
 * Reads can be verified here, without the GIL: given each op's expected xxh3-64
 * checksum (XXH3_64bits, seed 0: what Python's xxhash.xxh3_64_intdigest computes)
 * and how many leading bytes of its iovec hold the value, a step hashes the reads
 * that completed in full while the ring is already refilled, and records a verdict
 * per op (1 good, 0 mismatch, -1 not checked: short, failed or never submitted,
 * left to the caller). Built without <xxhash.h> (KV_HAVE_XXHASH undefined), no
 * verdict is ever given and kv_have_verify() returns 0.
 *
 * A ring is not thread-safe; the Python side keeps one ring per concurrent
 * caller (a small pool), so no locking is done here.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <liburing.h>
#ifdef KV_HAVE_XXHASH
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif

/* Bumped whenever a signature changes: Python refuses a stale build. */
int kv_ring_api_version(void)
{
    return 2;
}

int kv_have_verify(void)
{
#ifdef KV_HAVE_XXHASH
    return 1;
#else
    return 0;
#endif
}

#ifdef KV_HAVE_XXHASH
/* xxh3-64 of the first len bytes of the iovec (len <= its total). */
static uint64_t hash_iov(const struct iovec *iov, int cnt, int64_t len)
{
    XXH3_state_t st;

    if (cnt <= 1 || (int64_t)iov[0].iov_len >= len)
        return XXH3_64bits(cnt > 0 ? iov[0].iov_base : "", (size_t)len);
    XXH3_64bits_reset(&st);
    for (int k = 0; k < cnt && len > 0; k++) {
        size_t take = (int64_t)iov[k].iov_len < len ? iov[k].iov_len : (size_t)len;
        XXH3_64bits_update(&st, iov[k].iov_base, take);
        len -= (int64_t)take;
    }
    return XXH3_64bits_digest(&st);
}
#endif

/* xxh3-64 of the first len bytes of the iovec; 0 if built without xxhash (tests). */
uint64_t kv_xxh3_iov(const struct iovec *iov, int cnt, int64_t len)
{
#ifdef KV_HAVE_XXHASH
    return hash_iov(iov, cnt, len);
#else
    (void)iov; (void)cnt; (void)len;
    return 0;
#endif
}

struct kv_ring {
    struct io_uring ring;
    unsigned depth;
    /* The batch in progress (kv_ring_start .. kv_ring_step returning <= 0). */
    int fd, n, limit, next, done, inflight, err;
    size_t iov_pos;
    const unsigned char *is_write;
    const int64_t *offsets;
    const struct iovec *iovs;
    const int *iov_counts;
    int64_t *results;
    /* Verification (all NULL: none). */
    const uint64_t *want;
    const int64_t *verify_len;
    signed char *verdict;
    /* The ops the last reap saw (at most depth: never more are in flight). */
    int *reaped_op;
    uint32_t *reaped_iov;
    int reaped;
};

int kv_ring_open(unsigned depth, struct kv_ring **out)
{
    struct kv_ring *r;
    int ret;

    *out = NULL;
    if (depth == 0)
        return -EINVAL;
    r = calloc(1, sizeof(*r));
    if (!r)
        return -ENOMEM;
    r->reaped_op = calloc(depth, sizeof(*r->reaped_op));
    r->reaped_iov = calloc(depth, sizeof(*r->reaped_iov));
    if (!r->reaped_op || !r->reaped_iov) {
        free(r->reaped_op);
        free(r->reaped_iov);
        free(r);
        return -ENOMEM;
    }
    ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        /* seccomp, io_uring_disabled or an old kernel: the caller falls back. */
        free(r->reaped_op);
        free(r->reaped_iov);
        free(r);
        return ret;
    }
    r->depth = depth;
    *out = r;
    return 0;
}

void kv_ring_close(struct kv_ring *r)
{
    if (!r)
        return;
    io_uring_queue_exit(&r->ring);
    free(r->reaped_op);
    free(r->reaped_iov);
    free(r);
}

/*
 * Starts a batch of n operations (nothing is submitted until kv_ring_step).
 * With verdict non-NULL, every verdict[i] starts at -1; a read i with
 * verify_len[i] >= 0 that transfers its whole iovec gets verdict[i] = 1 if the
 * xxh3-64 of its first verify_len[i] bytes equals want[i], else 0.
 * Operation i is a write if is_write[i], at offsets[i], over the next
 * iov_counts[i] entries of iovs (operations consume iovs in order). results[i]
 * receives the bytes transferred or -errno; operations never submitted because
 * of a ring failure get that failure's -errno. At most max_inflight operations
 * are in flight at once (0 or more than the ring's depth: the ring's depth). The
 * arrays must stay valid until the batch is complete.
 */
void kv_ring_start(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                   const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                   int64_t *results, int max_inflight, const uint64_t *want,
                   const int64_t *verify_len, signed char *verdict)
{
    r->fd = fd;
    r->n = n;
    r->is_write = is_write;
    r->offsets = offsets;
    r->iovs = iovs;
    r->iov_counts = iov_counts;
    r->results = results;
    r->limit = (max_inflight <= 0 || max_inflight > (int)r->depth) ? (int)r->depth
                                                                    : max_inflight;
    r->next = r->done = r->inflight = r->err = 0;
    r->iov_pos = 0;
#ifdef KV_HAVE_XXHASH
    r->want = want;
    r->verify_len = verify_len;
    r->verdict = verdict;
#else
    (void)want; (void)verify_len;
    r->want = NULL;
    r->verify_len = NULL;
    r->verdict = NULL;
#endif
    if (verdict)
        memset(verdict, -1, (size_t)n);
}

/* Records a completion: its result, and its index in done_idx (if room). */
static unsigned reap(struct kv_ring *r, int *done_idx, int room)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;

    io_uring_for_each_cqe(&r->ring, head, cqe) {
        int i = (int)(uint32_t)cqe->user_data;
        r->results[i] = cqe->res;
        if ((int)seen < room)
            done_idx[seen] = i;
        if (seen < r->depth) {
            r->reaped_op[seen] = i;
            r->reaped_iov[seen] = (uint32_t)(cqe->user_data >> 32);
        }
        seen++;
    }
    io_uring_cq_advance(&r->ring, seen);
    r->reaped = seen < r->depth ? (int)seen : (int)r->depth;
    r->inflight -= (int)seen;
    r->done += (int)seen;
    return seen;
}

/* Prepares operations up to the in-flight limit (submitted by the caller). */
static void prep(struct kv_ring *r)
{
    while (r->next < r->n && r->inflight < r->limit) {
        struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
        int i = r->next;
        if (!sqe)
            break;
        if (r->is_write[i])
            io_uring_prep_writev(sqe, r->fd, &r->iovs[r->iov_pos], r->iov_counts[i],
                                 (uint64_t)r->offsets[i]);
        else
            io_uring_prep_readv(sqe, r->fd, &r->iovs[r->iov_pos], r->iov_counts[i],
                                (uint64_t)r->offsets[i]);
        io_uring_sqe_set_data64(sqe, (uint64_t)(uint32_t)i | ((uint64_t)r->iov_pos << 32));
        r->iov_pos += (size_t)r->iov_counts[i];
        r->next++;
        r->inflight++;
    }
}

#ifdef KV_HAVE_XXHASH
/* Verifies the reads the last reap saw (see kv_ring_start). */
static void verify(struct kv_ring *r)
{
    for (int k = 0; k < r->reaped; k++) {
        int i = r->reaped_op[k];
        size_t pos = r->reaped_iov[k];
        int64_t total = 0;
        const struct iovec *iov = &r->iovs[pos];

        if (r->is_write[i] || r->verify_len[i] < 0)
            continue;
        for (int j = 0; j < r->iov_counts[i]; j++)
            total += (int64_t)iov[j].iov_len;
        if (r->results[i] != total || r->verify_len[i] > total)
            continue; /* short or failed: the caller finishes and checks it */
        r->verdict[i] = hash_iov(iov, r->iov_counts[i], r->verify_len[i]) == r->want[i];
    }
}
#endif

/*
 * Advances the batch: prepares operations up to the in-flight limit, submits them
 * all with one io_uring_enter that also waits for at least one completion, then
 * reaps every completion already posted (with verification on, it then refills
 * and submits the ring and verifies the completed reads before returning). Writes the indices of the operations
 * that completed into done_idx (room for n - done entries is enough) and returns
 * how many, 0 once the batch is complete. Returns -errno if the ring failed: then
 * every submitted operation has completed (no buffer is in use), the results of
 * the never-submitted ones hold the error, the batch is over and the ring holds
 * stale entries: the caller must close it, not reuse it.
 */
int kv_ring_step(struct kv_ring *r, int *done_idx, int room)
{
    int got = 0;

    if (r->err)
        return r->err;
    if (r->done >= r->n)
        return 0;
    prep(r);
    for (;;) {
        int ret = io_uring_submit_and_wait(&r->ring, 1);
        if (ret >= 0 || ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) {
            got = (int)reap(r, done_idx, room);
            if (got > 0) {
#ifdef KV_HAVE_XXHASH
                if (r->verdict) {
                    /* Refill the ring first, so the hashing overlaps the I/O. A failed
                     * submit leaves the entries queued: the next step reports it. */
                    prep(r);
                    if (io_uring_sq_ready(&r->ring))
                        io_uring_submit(&r->ring);
                    verify(r);
                }
#endif
                return got;
            }
            if (r->inflight > 0)
                continue; /* interrupted before anything completed: wait again */
            /* Nothing in flight and nothing could be queued (no SQE): give up. */
            ret = -EIO;
        }
        /*
         * The ring refused to submit. The SQ is FIFO and the kernel consumed its
         * head: the last `pending` prepared entries were never taken and never
         * will be. Every consumed entry posts a completion, so wait for exactly
         * those: no buffer is in use when we return.
         */
        unsigned pending = io_uring_sq_ready(&r->ring);
        r->err = ret;
        r->inflight -= (int)pending;
        r->next -= (int)pending;
        while (r->inflight > 0) {
            struct io_uring_cqe *cqe;
            int w = io_uring_wait_cqe(&r->ring, &cqe);
            if (w == -EINTR)
                continue;
            if (w < 0)
                break;
            got += (int)reap(r, done_idx + got, room - got);
        }
        for (int i = r->next; i < r->n; i++)
            r->results[i] = ret;
        return ret;
    }
}

/*
 * Runs n operations to completion (kv_ring_start, then kv_ring_step until done).
 * Returns 0, or -errno if the ring itself failed (results are still filled); after
 * a failure the ring holds stale entries and must be closed, not reused.
 */
int kv_ring_run(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                int64_t *results, int max_inflight, const uint64_t *want,
                const int64_t *verify_len, signed char *verdict)
{
    int scratch[64];

    kv_ring_start(r, fd, n, is_write, offsets, iovs, iov_counts, results, max_inflight,
                  want, verify_len, verdict);
    for (;;) {
        int got = kv_ring_step(r, scratch, 64);
        if (got < 0)
            return got;
        if (got == 0)
            return 0;
    }
}
