/*
 * kv_ring: a plain io_uring ring for one caller that runs a batch to completion. The
 * benchmark's raw io_uring baseline (benchmarks/ssd_raw.py): no checksum, no index, no
 * thread. Part of the tiers._uring translation unit (included by uring_io.c).
 */

/* One caller's ring: the benchmark's raw io_uring baseline (no checksum, no index). */
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
 * Runs n readv/writev ops (op i: a write if is_write[i], at offsets[i], over the
 * next iov_counts[i] iovecs) with up to max_inflight (0: the depth) in flight,
 * refilling as each completes; results[i] gets bytes or -errno. Returns 0, or the
 * -errno that stopped the ring (after waiting for everything it had taken; never
 * submitted ops get that error). A ring that failed must be closed, not reused.
 */
int kv_ring_run(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                int64_t *results, int max_inflight)
{
    int limit = (max_inflight <= 0 || max_inflight > (int)r->depth) ? (int)r->depth
                                                                     : max_inflight;
    int next = 0, inflight = 0, done = 0, err = 0;
    size_t pos = 0;

    while (done < n) {
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        int ret;

        while (!err && next < n && inflight < limit) {
            struct io_uring_sqe *sqe = io_uring_get_sqe(&r->ring);
            if (!sqe)
                break;
            if (is_write[next])
                io_uring_prep_writev(sqe, fd, &iovs[pos], iov_counts[next],
                                     (uint64_t)offsets[next]);
            else
                io_uring_prep_readv(sqe, fd, &iovs[pos], iov_counts[next],
                                    (uint64_t)offsets[next]);
            io_uring_sqe_set_data64(sqe, (uint64_t)next);
            pos += (size_t)iov_counts[next];
            next++;
            inflight++;
        }
        ret = err ? io_uring_wait_cqe(&r->ring, &cqe) : io_uring_submit_and_wait(&r->ring, 1);
        if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && !err) {
            /* Entries the kernel never took will never complete. */
            unsigned pending = io_uring_sq_ready(&r->ring);
            err = ret;
            inflight -= (int)pending;
            next -= (int)pending;
            for (int i = next; i < n; i++)
                results[i] = err;
            done += n - next;
            next = n;
        }
        io_uring_for_each_cqe(&r->ring, head, cqe) {
            results[cqe->user_data] = cqe->res;
            seen++;
        }
        io_uring_cq_advance(&r->ring, seen);
        inflight -= (int)seen;
        done += (int)seen;
        if (err && inflight == 0)
            break;
    }
    return err;
}
