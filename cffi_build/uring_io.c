/*
 * Batched positional I/O through io_uring for the SSD tier (tiers/ssd.py).
 *
 * One call submits N readv/writev operations against one fd, keeping at most
 * `depth` of them in flight, and returns only when every submitted operation
 * has completed: the caller's buffers are never touched by the kernel after
 * kv_ring_run returns, which is what makes it safe to hand them back to Python.
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

/* Reaps every completion already posted; returns how many. */
static unsigned reap(struct kv_ring *r, int64_t *results)
{
    struct io_uring_cqe *cqe;
    unsigned head, seen = 0;

    io_uring_for_each_cqe(&r->ring, head, cqe) {
        results[cqe->user_data] = cqe->res;
        seen++;
    }
    io_uring_cq_advance(&r->ring, seen);
    return seen;
}

/*
 * Runs n operations. Operation i is a write if is_write[i], at offsets[i], over
 * the next iov_counts[i] entries of iovs (operations consume iovs in order).
 * results[i] receives the bytes transferred or -errno; operations never
 * submitted because of a ring failure get that failure's -errno.
 * Returns 0, or -errno if the ring itself failed (results are still filled); after a
 * failure the ring holds stale entries and must be closed, not reused.
 */
int kv_ring_run(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                int64_t *results)
{
    int next = 0, done = 0, inflight = 0, err = 0;
    size_t iov_pos = 0;

    while (done < n) {
        /* Fill the submission queue up to the queue depth. */
        while (!err && next < n && inflight < (int)r->depth) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe)
                break;
            if (is_write[next])
                io_uring_prep_writev(sqe, fd, &iovs[iov_pos], iov_counts[next],
                                     (uint64_t)offsets[next]);
            else
                io_uring_prep_readv(sqe, fd, &iovs[iov_pos], iov_counts[next],
                                    (uint64_t)offsets[next]);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            iov_pos += (size_t)iov_counts[next];
            next++;
            inflight++;
        }
        if (inflight == 0)
            break; /* only reachable after err: nothing left to wait for */

        int ret = io_uring_submit_and_wait(&r->ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY) {
            /*
             * The ring refused to submit. The SQ is FIFO and the kernel consumed
             * its head: the last `pending` prepared entries were never taken and
             * never will be (the caller must close this ring, see the return
             * value). Every consumed entry posts a completion, so wait for exactly
             * those: no buffer is in use when we return.
             */
            unsigned pending = io_uring_sq_ready(&r->ring);
            err = ret;
            inflight -= (int)pending;
            next -= (int)pending;
            while (inflight > 0) {
                struct io_uring_cqe *cqe;
                int w = io_uring_wait_cqe(&r->ring, &cqe);
                if (w == -EINTR)
                    continue;
                if (w < 0)
                    break;
                unsigned got = reap(r, results);
                inflight -= (int)got;
                done += (int)got;
            }
            break;
        }
        unsigned got = reap(r, results);
        inflight -= (int)got;
        done += (int)got;
    }
    if (err) {
        for (int i = next; i < n; i++)
            results[i] = err;
    }
    return err;
}
