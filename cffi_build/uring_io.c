/*
 * Positional I/O through io_uring for the SSD tier (tiers/ssd/).
 *
 * kv_queue (below): one ring per tier shared by every caller, owned by a completion
 * thread written in C (so it never takes the GIL). Callers queue groups of
 * readv/writev ops and wait for them (kv_queue_submit, kv_group_wait: cffi releases
 * the GIL around both); the thread keeps the ring up to its depth across all
 * callers, refills it as ops complete, and verifies each read in C before its
 * caller hears of it.
 *
 * Reads are verified without the GIL: given an op's expected xxh3-64 checksum
 * (XXH3_64bits, seed 0: what Python's xxhash.xxh3_64_intdigest computes) and how
 * many leading bytes of its iovec hold the value, a read that transferred its whole
 * iovec gets a verdict (1 good, 0 mismatch); -1 (short, failed, not asked) leaves
 * the check to the caller. Built without <xxhash.h> (KV_HAVE_XXHASH undefined), no
 * verdict is ever given and kv_have_verify() returns 0.
 *
 * kv_op_sync: one op in the calling thread, no ring (a lone op's round trip through
 * the completion thread costs more than its syscall).
 *
 * kv_ring (uring_ring.c): a plain ring for one caller that runs a batch to completion;
 * the benchmark's raw io_uring baseline (no checksum, no index, no thread).
 */
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/uio.h>
#include <time.h>
#include <unistd.h>
#include <liburing.h>
#ifdef KV_HAVE_XXHASH
#ifdef KV_XXH_DISPATCH
/* libxxhash's XXH3 picks SSE2/AVX2/AVX-512 at run time: on cold 64 KiB reads here it
 * hashes ~1.6x faster than the inline build (which is SSE2 only without -march), and
 * hashing sits on the completion thread's path. (STATIC_LINKING_ONLY: XXH3_state_t's
 * layout, for hashing a multi-buffer iovec on the stack.) */
#define XXH_STATIC_LINKING_ONLY
#include <xxh_x86dispatch.h>
#else
#define XXH_INLINE_ALL
#include <xxhash.h>
#endif
#endif

/* Bumped whenever a signature changes: Python refuses a stale build. */
int kv_ring_api_version(void)
{
    return 4;
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

#include "uring_ring.c"

/* ------------------------------------------------------------------ shared queue */

/*
 * A kv_queue is one ring per tier, shared by every caller, owned by one completion
 * thread (a pthread: it never takes the GIL). Callers hand it groups of operations
 * (kv_queue_submit, which only links them in under the mutex and, if the thread
 * sleeps, pokes it through an eventfd); the thread alone prepares SQEs, submits,
 * reaps, verifies reads, and reports each finished op to its group, whose caller
 * waits in kv_group_wait (GIL released, as every cffi call here). So concurrent
 * callers' reads share one ring kept up to `depth` deep, and a caller with several
 * groups outstanding keeps it full across its own batches.
 *
 * Invariants (under q->mu): q->inflight counts submitted-or-prepared ops not yet
 * reaped (<= depth); a group is on the ready list iff it may have unsubmitted ops;
 * an op is reported to its group exactly once, after which the kernel no longer
 * touches its buffers. A group is freed only when complete, and the queue memory
 * only when closed and every group is freed (q->refs).
 */

#define KV_WAKE ((uint64_t)1) /* user_data of the eventfd read (ops are pointers) */

struct kv_op {
    const struct iovec *iov;
    int64_t offset;
    int64_t result;     /* out: bytes transferred or -errno */
    uint64_t want;      /* reads: expected xxh3-64 of the first verify_len bytes */
    int64_t verify_len; /* < 0: no check */
    int iov_count;
    unsigned char is_write;
    signed char verdict; /* out: 1 good, 0 mismatch, -1 not checked */
    struct kv_group *group;
    int index;
};

struct kv_group {
    struct kv_queue *q;
    struct kv_op *ops;
    int n, next, inflight, limit, completed, reported, waiting;
    int want; /* the waiter wakes once this many are unreported (or all done) */
    int on_ready;
    struct kv_group *link;
    int *done; /* op indices in completion order */
    pthread_cond_t cond;
};

struct kv_queue {
    struct io_uring ring;
    pthread_mutex_t mu;
    pthread_t thread;
    int fd, efd, depth, inflight, closing, err, sleeping, refs;
    int wake_armed;
    uint64_t wake_buf;
    struct kv_group *ready_head, *ready_tail;
    /* user_data of prepared SQEs the kernel has not consumed yet, oldest first. */
    uint64_t *sq_fifo;
    int sq_len;
    struct kv_op **batch; /* scratch for one reap */
};

static void queue_unref(struct kv_queue *q)
{
    /* Called with q->mu held; unlocks it. */
    int last = --q->refs == 0;
    pthread_mutex_unlock(&q->mu);
    if (last) {
        pthread_mutex_destroy(&q->mu);
        free(q->sq_fifo);
        free(q->batch);
        free(q);
    }
}

/* Reports op to its group (q->mu held). */
static void report(struct kv_op *op)
{
    struct kv_group *g = op->group;
    g->done[g->completed++] = op->index;
    /* Wake the waiter only when it has what it asked for: a cross-CPU wake-up
     * (and the GIL hand-off after it) per op would cost more than the op. */
    if (g->waiting && (g->completed - g->reported >= g->want || g->completed == g->n))
        pthread_cond_signal(&g->cond);
}

/* Fails every op not yet prepared, of every group (q->mu held). */
static void fail_unsubmitted(struct kv_queue *q, int err)
{
    for (struct kv_group *g = q->ready_head; g; g = g->link) {
        g->on_ready = 0;
        for (; g->next < g->n; g->next++) {
            g->ops[g->next].result = err;
            report(&g->ops[g->next]);
        }
    }
    q->ready_head = q->ready_tail = NULL;
}

static void ready_push(struct kv_queue *q, struct kv_group *g)
{
    if (g->on_ready || g->next >= g->n)
        return;
    g->on_ready = 1;
    g->link = NULL;
    if (q->ready_tail)
        q->ready_tail->link = g;
    else
        q->ready_head = g;
    q->ready_tail = g;
}

/* Unlinks g from the ready list if it is on it (q->mu held). A group leaves the list
 * lazily (fill() drops one with nothing left to prepare), so one that a cancel or its
 * last completion finished may still be linked when its caller frees it. */
static void ready_remove(struct kv_queue *q, struct kv_group *g)
{
    struct kv_group *prev = NULL;

    if (!g->on_ready)
        return;
    for (struct kv_group *cur = q->ready_head; cur; prev = cur, cur = cur->link) {
        if (cur != g)
            continue;
        if (prev)
            prev->link = g->link;
        else
            q->ready_head = g->link;
        if (q->ready_tail == g)
            q->ready_tail = prev;
        break;
    }
    g->on_ready = 0;
    g->link = NULL;
}

/* Prepares ops up to the depth, one per ready group in turn (q->mu held). */
static void fill(struct kv_queue *q)
{
    while (q->inflight < q->depth && q->ready_head) {
        struct kv_group *g = q->ready_head;
        struct io_uring_sqe *sqe;
        struct kv_op *op;

        q->ready_head = g->link;
        if (!q->ready_head)
            q->ready_tail = NULL;
        g->on_ready = 0;
        if (g->next >= g->n || g->inflight >= g->limit)
            continue; /* re-queued when one of its ops completes */
        sqe = io_uring_get_sqe(&q->ring);
        if (!sqe) {
            ready_push(q, g);
            break;
        }
        op = &g->ops[g->next++];
        if (op->is_write)
            io_uring_prep_writev(sqe, q->fd, op->iov, (unsigned)op->iov_count,
                                 (uint64_t)op->offset);
        else
            io_uring_prep_readv(sqe, q->fd, op->iov, (unsigned)op->iov_count,
                                (uint64_t)op->offset);
        io_uring_sqe_set_data64(sqe, (uint64_t)(uintptr_t)op);
        q->sq_fifo[q->sq_len++] = (uint64_t)(uintptr_t)op;
        g->inflight++;
        q->inflight++;
        ready_push(q, g); /* round robin between concurrent groups */
    }
}

static void arm_wake(struct kv_queue *q)
{
    struct io_uring_sqe *sqe = io_uring_get_sqe(&q->ring);
    if (!sqe)
        return; /* the next loop iteration retries */
    io_uring_prep_read(sqe, q->efd, &q->wake_buf, sizeof(q->wake_buf), 0);
    io_uring_sqe_set_data64(sqe, KV_WAKE);
    q->sq_fifo[q->sq_len++] = KV_WAKE;
    q->wake_armed = 1;
}

/* Drops the SQ entries the kernel consumed from the FIFO. */
static void consumed(struct kv_queue *q)
{
    int left = (int)io_uring_sq_ready(&q->ring);
    int took = q->sq_len - left;
    if (took > 0) {
        memmove(q->sq_fifo, q->sq_fifo + took, (size_t)left * sizeof(*q->sq_fifo));
        q->sq_len = left;
    }
}

/*
 * The ring refused a submission for good: the ops whose SQEs it never consumed
 * fail with err (they never reach the kernel: nothing submits this ring again),
 * as does every op not yet prepared; new submissions get err (q->mu held).
 */
static void break_queue(struct kv_queue *q, int err)
{
    unsigned head = *q->ring.sq.khead, mask = *q->ring.sq.kring_mask;

    q->err = err;
    for (int k = 0; k < q->sq_len; k++) {
        /* Still in the SQ: make it a harmless no-op, in case anything submits it. */
        struct io_uring_sqe *sqe = &q->ring.sq.sqes[q->ring.sq.array[(head + k) & mask]];
        io_uring_prep_nop(sqe);
        io_uring_sqe_set_data64(sqe, 0);
        if (q->sq_fifo[k] == KV_WAKE) {
            q->wake_armed = 0;
            continue;
        }
        struct kv_op *op = (struct kv_op *)(uintptr_t)q->sq_fifo[k];
        op->result = err;
        op->group->inflight--;
        q->inflight--;
        report(op);
    }
    q->sq_len = 0;
    fail_unsubmitted(q, err);
}

#ifdef KV_HAVE_XXHASH
static void verify_op(struct kv_op *op)
{
    int64_t total = 0;
    for (int j = 0; j < op->iov_count; j++)
        total += (int64_t)op->iov[j].iov_len;
    if (op->result != total || op->verify_len > total)
        return; /* short or failed: the caller finishes and checks it */
    op->verdict = hash_iov(op->iov, op->iov_count, op->verify_len) == op->want;
}
#endif

/*
 * Runs op in the calling thread: one preadv/pwritev (retried on EINTR), then a read's
 * verdict as the queue gives it. op->result: bytes moved (a short count is left to the
 * caller to finish) or -errno. The ring is not involved, so a closed queue is the
 * caller's check to make.
 */
void kv_op_sync(int fd, struct kv_op *op)
{
    ssize_t n;

    op->verdict = -1;
    do {
        n = op->is_write ? pwritev(fd, op->iov, op->iov_count, (off_t)op->offset)
                         : preadv(fd, op->iov, op->iov_count, (off_t)op->offset);
    } while (n < 0 && errno == EINTR);
    op->result = n < 0 ? -(int64_t)errno : (int64_t)n;
#ifdef KV_HAVE_XXHASH
    if (!op->is_write && op->verify_len >= 0)
        verify_op(op);
#endif
}

/* After a submission returned ret: drop what the kernel took; a refusal that will not
 * pass by waiting breaks the queue (q->mu held). */
static void submitted(struct kv_queue *q, int ret)
{
    if (q->err)
        return;
    consumed(q);
    if (ret < 0 && ret != -EINTR && ret != -EAGAIN && ret != -EBUSY && ret != -ETIME)
        break_queue(q, ret);
    else if (ret < 0 && ret != -EINTR && q->sq_len &&
             q->inflight - q->sq_len + q->wake_armed == 0)
        break_queue(q, ret); /* nothing in the kernel to wait for */
}

/* Ops reaped: free their slots and refill (q->mu held); reporting comes later. */
static void account(struct kv_queue *q, int got)
{
    for (int k = 0; k < got; k++) {
        struct kv_group *g = q->batch[k]->group;
        g->inflight--;
        q->inflight--;
        ready_push(q, g);
    }
    if (!q->err)
        fill(q);
}

static void *queue_loop(void *arg)
{
    struct kv_queue *q = arg;
    int got = 0, accounted = 0;

    for (;;) {
        int ret;

        /* Report what the last reap finished, refill, and decide whether to stop. */
        pthread_mutex_lock(&q->mu);
        if (!accounted)
            account(q, got);
        for (int k = 0; k < got; k++)
            report(q->batch[k]);
        got = accounted = 0;
        if (q->closing && q->inflight == 0) {
            pthread_mutex_unlock(&q->mu);
            return NULL;
        }
        if (!q->err) {
            fill(q);
            if (!q->wake_armed)
                arm_wake(q);
        }
        q->sleeping = 1;
        pthread_mutex_unlock(&q->mu);

        if (!q->err && q->sq_len) {
            ret = io_uring_submit_and_wait(&q->ring, 1);
        } else if (q->err) {
            /* Broken: only reap (never submit); poll so close() is seen. */
            struct __kernel_timespec ts = {.tv_sec = 0, .tv_nsec = 50 * 1000 * 1000};
            struct io_uring_cqe *cqe;
            ret = io_uring_wait_cqe_timeout(&q->ring, &cqe, &ts);
            if (ret == -ETIME)
                ret = 0;
        } else {
            struct io_uring_cqe *cqe;
            ret = io_uring_wait_cqe(&q->ring, &cqe);
        }
        pthread_mutex_lock(&q->mu);
        q->sleeping = 0;
        submitted(q, ret);
        pthread_mutex_unlock(&q->mu);

        /* Reap without the lock: only this thread touches the CQ. */
        struct io_uring_cqe *cqe;
        unsigned head, seen = 0;
        int hash = 0;
        io_uring_for_each_cqe(&q->ring, head, cqe) {
            seen++;
            if (cqe->user_data == 0)
                continue; /* a neutralized entry (break_queue) */
            if (cqe->user_data == KV_WAKE) {
                q->wake_armed = 0; /* (read without the lock: only this thread sets it) */
                continue;
            }
            struct kv_op *op = (struct kv_op *)(uintptr_t)cqe->user_data;
            op->result = cqe->res;
            q->batch[got++] = op;
            hash |= !op->is_write && op->verify_len >= 0;
        }
        io_uring_cq_advance(&q->ring, seen);
#ifdef KV_HAVE_XXHASH
        if (hash) {
            /* Refill the ring first, so the hashing overlaps the next reads. */
            pthread_mutex_lock(&q->mu);
            account(q, got);
            accounted = 1;
            if (!q->err && io_uring_sq_ready(&q->ring))
                submitted(q, io_uring_submit(&q->ring));
            pthread_mutex_unlock(&q->mu);
            /* Hash without the lock, before the caller hears of the op. */
            for (int k = 0; k < got; k++)
                if (!q->batch[k]->is_write && q->batch[k]->verify_len >= 0)
                    verify_op(q->batch[k]);
        }
#else
        (void)hash;
#endif
    }
}

int kv_queue_open(unsigned depth, int fd, struct kv_queue **out)
{
    struct kv_queue *q;
    int ret;

    *out = NULL;
    if (depth == 0 || depth > 4096)
        return -EINVAL;
    q = calloc(1, sizeof(*q));
    if (!q)
        return -ENOMEM;
    q->sq_fifo = calloc(2 * depth + 2, sizeof(*q->sq_fifo));
    q->batch = calloc(2 * depth + 2, sizeof(*q->batch));
    q->efd = eventfd(0, EFD_CLOEXEC);
    if (!q->sq_fifo || !q->batch || q->efd < 0) {
        ret = q->efd < 0 ? -errno : -ENOMEM;
        goto fail;
    }
    /* depth ops plus the eventfd read; the CQ (twice the SQ) never overflows. */
    ret = io_uring_queue_init(depth + 1, &q->ring, 0);
    if (ret < 0)
        goto fail; /* seccomp, io_uring_disabled or an old kernel: the caller falls back */
    q->fd = fd;
    q->depth = (int)depth;
    q->refs = 1;
    pthread_mutex_init(&q->mu, NULL);
    ret = -pthread_create(&q->thread, NULL, queue_loop, q);
    if (ret < 0) {
        io_uring_queue_exit(&q->ring);
        pthread_mutex_destroy(&q->mu);
        goto fail;
    }
    *out = q;
    return 0;
fail:
    if (q->efd > 0)
        close(q->efd);
    free(q->sq_fifo);
    free(q->batch);
    free(q);
    return ret;
}

/* Wakes the completion thread if it sleeps (q->mu held). */
static void poke(struct kv_queue *q)
{
    uint64_t one = 1;
    if (!q->sleeping)
        return;
    q->sleeping = 0; /* one poke per sleep is enough */
    if (write(q->efd, &one, sizeof(one)) < 0) {
        /* Cannot fail for a counter far below its maximum; nothing to do. */
    }
}

/*
 * Queues n ops as one group with at most max_inflight of them in flight (0: the
 * queue's depth) and returns it in *out; each op's buffers must stay valid until
 * the group reports it (kv_group_wait). Returns 0, -ECANCELED once the queue is
 * closing, or the error that broke the ring (then open a new queue).
 */
int kv_queue_submit(struct kv_queue *q, struct kv_op *ops, int n, int max_inflight,
                    struct kv_group **out)
{
    struct kv_group *g;

    *out = NULL;
    g = calloc(1, sizeof(*g));
    if (!g || !(g->done = malloc((size_t)(n > 0 ? n : 1) * sizeof(int)))) {
        free(g);
        return -ENOMEM;
    }
    pthread_condattr_t attr;
    pthread_condattr_init(&attr);
    pthread_condattr_setclock(&attr, CLOCK_MONOTONIC);
    pthread_cond_init(&g->cond, &attr);
    pthread_condattr_destroy(&attr);
    g->q = q;
    g->ops = ops;
    g->n = n;
    g->limit = (max_inflight <= 0 || max_inflight > q->depth) ? q->depth : max_inflight;
    for (int i = 0; i < n; i++) {
        ops[i].group = g;
        ops[i].index = i;
        ops[i].result = 0;
        ops[i].verdict = -1;
    }
    pthread_mutex_lock(&q->mu);
    if (q->closing || q->err) {
        int err = q->closing ? -ECANCELED : q->err;
        pthread_mutex_unlock(&q->mu);
        pthread_cond_destroy(&g->cond);
        free(g->done);
        free(g);
        return err;
    }
    q->refs++;
    ready_push(q, g);
    poke(q);
    pthread_mutex_unlock(&q->mu);
    *out = g;
    return 0;
}

/*
 * Waits (up to timeout_ms; < 0: no limit) until at least min_new ops (at least 1,
 * at most all that are left) the caller has not been told of have finished, writes
 * up to room of their indices to idx and returns how many; 0 once every op was
 * reported; -ETIMEDOUT if too few finished in time (then none are returned).
 */
int kv_group_wait(struct kv_group *g, int *idx, int room, int min_new, int timeout_ms)
{
    struct kv_queue *q = g->q;
    struct timespec until;
    int got;

    if (timeout_ms >= 0) {
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_sec += timeout_ms / 1000;
        until.tv_nsec += (long)(timeout_ms % 1000) * 1000000L;
        if (until.tv_nsec >= 1000000000L) {
            until.tv_sec++;
            until.tv_nsec -= 1000000000L;
        }
    }
    pthread_mutex_lock(&q->mu);
    if (min_new < 1)
        min_new = 1;
    if (min_new > g->n - g->reported)
        min_new = g->n - g->reported;
    g->want = min_new;
    while (g->completed - g->reported < min_new) {
        g->waiting = 1;
        if (timeout_ms < 0) {
            pthread_cond_wait(&g->cond, &q->mu);
        } else if (pthread_cond_timedwait(&g->cond, &q->mu, &until) == ETIMEDOUT &&
                   g->completed - g->reported < min_new) {
            g->waiting = 0;
            pthread_mutex_unlock(&q->mu);
            return -ETIMEDOUT;
        }
        g->waiting = 0;
    }
    got = g->completed - g->reported;
    if (got > room)
        got = room;
    memcpy(idx, g->done + g->reported, (size_t)got * sizeof(int));
    g->reported += got;
    pthread_mutex_unlock(&q->mu);
    return got;
}

/* Fails the group's ops not yet prepared with -ECANCELED (its in-flight ones finish). */
void kv_group_cancel(struct kv_group *g)
{
    struct kv_queue *q = g->q;

    pthread_mutex_lock(&q->mu);
    for (; g->next < g->n; g->next++) {
        g->ops[g->next].result = -ECANCELED;
        report(&g->ops[g->next]);
    }
    pthread_mutex_unlock(&q->mu);
}

/* Frees a group; waits first until none of its ops is in flight. */
void kv_group_free(struct kv_group *g)
{
    struct kv_queue *q;

    if (!g)
        return;
    q = g->q;
    pthread_mutex_lock(&q->mu);
    g->want = g->n;
    while (g->completed < g->n) {
        g->waiting = 1;
        pthread_cond_wait(&g->cond, &q->mu);
    }
    g->waiting = 0;
    ready_remove(q, g); /* never leave a freed group linked for fill() to touch */
    pthread_cond_destroy(&g->cond);
    free(g->done);
    free(g);
    queue_unref(q); /* unlocks */
}

/* The error that broke the queue's ring (0: healthy). */
int kv_queue_error(struct kv_queue *q)
{
    int err;
    pthread_mutex_lock(&q->mu);
    err = q->err;
    pthread_mutex_unlock(&q->mu);
    return err;
}

/*
 * Closes the queue: ops not yet prepared fail with -ECANCELED, in-flight ones run
 * to completion, then the thread and the ring go. Groups stay valid until freed.
 */
void kv_queue_close(struct kv_queue *q)
{
    if (!q)
        return;
    pthread_mutex_lock(&q->mu);
    q->closing = 1;
    fail_unsubmitted(q, -ECANCELED);
    q->sleeping = 1; /* poke even if the thread is mid-loop: harmless */
    poke(q);
    pthread_mutex_unlock(&q->mu);
    pthread_join(q->thread, NULL);
    io_uring_queue_exit(&q->ring);
    close(q->efd);
    pthread_mutex_lock(&q->mu);
    queue_unref(q);
}

/*
 * kv_queue_submit, then waits until every op is reported, and frees the group: one
 * call (one GIL release) for a caller that needs no per-op progress. Returns 0 or
 * what kv_queue_submit returned (then no op ran).
 */
int kv_queue_run(struct kv_queue *q, struct kv_op *ops, int n, int max_inflight)
{
    struct kv_group *g;
    int ret = kv_queue_submit(q, ops, n, max_inflight, &g);

    if (ret == 0)
        kv_group_free(g); /* waits for completion */
    return ret;
}
