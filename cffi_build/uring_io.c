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
 * A ring is not thread-safe; the Python side keeps one ring per concurrent
 * caller (a small pool), so no locking is done here.
 */
#include <errno.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <liburing.h>

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
    ret = io_uring_queue_init(depth, &r->ring, 0);
    if (ret < 0) {
        /* seccomp, io_uring_disabled or an old kernel: the caller falls back. */
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
    free(r);
}

/*
 * Starts a batch of n operations (nothing is submitted until kv_ring_step).
 * Operation i is a write if is_write[i], at offsets[i], over the next
 * iov_counts[i] entries of iovs (operations consume iovs in order). results[i]
 * receives the bytes transferred or -errno; operations never submitted because
 * of a ring failure get that failure's -errno. At most max_inflight operations
 * are in flight at once (0 or more than the ring's depth: the ring's depth). The
 * arrays must stay valid until the batch is complete.
 */
void kv_ring_start(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                   const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                   int64_t *results, int max_inflight)
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
}

/* Records a completion: its result, and its index in done_idx (if room). */
static unsigned reap(struct kv_ring *r, int *done_idx, int room)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;

    io_uring_for_each_cqe(&r->ring, head, cqe) {
        r->results[cqe->user_data] = cqe->res;
        if ((int)seen < room)
            done_idx[seen] = (int)cqe->user_data;
        seen++;
    }
    io_uring_cq_advance(&r->ring, seen);
    r->inflight -= (int)seen;
    r->done += (int)seen;
    return seen;
}

/*
 * Advances the batch: prepares operations up to the in-flight limit, submits them
 * all with one io_uring_enter that also waits for at least one completion, then
 * reaps every completion already posted. Writes the indices of the operations
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
        io_uring_sqe_set_data64(sqe, (uint64_t)i);
        r->iov_pos += (size_t)r->iov_counts[i];
        r->next++;
        r->inflight++;
    }
    for (;;) {
        int ret = io_uring_submit_and_wait(&r->ring, 1);
        if (ret >= 0 || ret == -EINTR || ret == -EAGAIN || ret == -EBUSY) {
            got = (int)reap(r, done_idx, room);
            if (got > 0)
                return got;
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
                int64_t *results, int max_inflight)
{
    int scratch[64];

    kv_ring_start(r, fd, n, is_write, offsets, iovs, iov_counts, results, max_inflight);
    for (;;) {
        int got = kv_ring_step(r, scratch, 64);
        if (got < 0)
            return got;
        if (got == 0)
            return 0;
    }
}
