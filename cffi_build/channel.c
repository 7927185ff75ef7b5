/*
 * The transfer channel's per-call work in C (kvstore/protocol/native_channel.py wraps it;
 * the format is kvstore/protocol/wire.py's, unchanged): framing, parsing, and the socket
 * I/O of both ends, on blocking sockets. cffi releases the GIL around every call, so a
 * whole request (its header, metadata and values) moves without it.
 *
 * Every length a peer sends is checked before it is used: an op's metadata must be
 * exactly count x its item size, count at most the caller's bound, and nothing is read
 * past a buffer's capacity. A reply or request that breaks a bound returns a KVC_* code
 * with the parsed header fields filled in, so the caller can say what was wrong.
 *
 * Return values: >= 0 success (a count, see each function), -errno for a socket error
 * (EAGAIN/EWOULDBLOCK: SO_RCVTIMEO/SO_SNDTIMEO ran out, a stalled peer), or a KVC_* code.
 * EINTR is retried: a signal handler in Python runs once the call returns.
 */
#include <errno.h>
#include <limits.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>

#define KVC_API_VERSION 2
#define KVC_HEADER 16
#define KVC_MISS UINT64_MAX
#define KVC_CHUNK (1u << 30) /* most bytes one recv is asked for */
#ifndef IOV_MAX
#define IOV_MAX 1024
#endif

enum {
    KVC_EOF = -100000,      /* the peer closed the stream at a frame boundary */
    KVC_SHORT = -100001,    /* the stream ended inside a frame */
    KVC_BAD_OP = -100002,   /* request: op unknown or not served on this stream */
    KVC_BAD_COUNT = -100003,/* request: more items than the bound */
    KVC_BAD_META = -100004, /* request: meta_len is not count x item size, or too large */
    KVC_STATUS = -100005,   /* reply: non-zero status (its message is not read) */
    KVC_PROTO = -100006,    /* reply: count or meta length do not match the request */
    KVC_META_BIG = -100007, /* meta larger than the buffer given: header consumed only */
    KVC_BAD_ARG = -100008,  /* the caller passed an impossible argument */
};

struct kvc_reader {
    char *buf;      /* the caller's buffer (a bytearray it keeps alive) */
    uint64_t cap;
    uint64_t start; /* buffered bytes are buf[start:end] */
    uint64_t end;
};

struct kvc_frame {
    uint32_t code;     /* op (request) or status (reply) */
    uint32_t count;
    uint64_t meta_len;
    uint64_t meta_at;  /* request: offset of the meta in the reader's buffer */
};

int kvc_api_version(void)
{
    return KVC_API_VERSION;
}

static uint32_t get_le32(const unsigned char *p)
{
    return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

static uint64_t get_le64(const unsigned char *p)
{
    return (uint64_t)get_le32(p) | (uint64_t)get_le32(p + 4) << 32;
}

static void put_header(unsigned char *h, unsigned code, uint32_t count, uint64_t meta_len)
{
    memset(h, 0, KVC_HEADER);
    h[0] = (unsigned char)code;
    for (int i = 0; i < 4; i++)
        h[4 + i] = (unsigned char)(count >> (8 * i));
    for (int i = 0; i < 8; i++)
        h[8 + i] = (unsigned char)(meta_len >> (8 * i));
}

static void parse_header(const unsigned char *h, struct kvc_frame *f)
{
    f->code = h[0];
    f->count = get_le32(h + 4);
    f->meta_len = get_le64(h + 8);
    f->meta_at = 0;
}

/* Sends every byte of iov[0:cnt] (which it consumes: entries are advanced in place). */
static int64_t send_iov(int fd, struct iovec *iov, int cnt)
{
    int64_t total = 0;
    while (cnt > 0 && iov->iov_len == 0) {
        iov++;
        cnt--;
    }
    while (cnt > 0) {
        struct msghdr m;
        memset(&m, 0, sizeof m);
        m.msg_iov = iov;
        m.msg_iovlen = cnt > IOV_MAX ? IOV_MAX : cnt;
        ssize_t r = sendmsg(fd, &m, MSG_NOSIGNAL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        total += r;
        size_t left = (size_t)r;
        while (cnt > 0 && left >= iov->iov_len) {
            left -= iov->iov_len;
            iov++;
            cnt--;
        }
        if (cnt > 0) {
            iov->iov_base = (char *)iov->iov_base + left;
            iov->iov_len -= left;
        }
    }
    return total;
}

/* Receives exactly n bytes into buf: 0, KVC_EOF (nothing came), KVC_SHORT or -errno. */
static int recv_exact(int fd, char *buf, uint64_t n)
{
    uint64_t got = 0;
    while (got < n) {
        uint64_t ask = n - got;
        ssize_t r = recv(fd, buf + got, ask > KVC_CHUNK ? KVC_CHUNK : (size_t)ask, MSG_WAITALL);
        if (r < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (r == 0)
            return got == 0 ? KVC_EOF : KVC_SHORT;
        got += (uint64_t)r;
    }
    return 0;
}

/* ---- both ends: a frame out ------------------------------------------------------------ */

/* Sends header(code, count, meta_len) + meta + iov[2:cnt] in as few sendmsg calls as the
 * kernel allows; iov[0] and iov[1] are the caller's room for the header and the meta. */
int64_t kvc_send_frame(int fd, unsigned code, uint32_t count, const char *meta,
                       uint64_t meta_len, struct iovec *iov, int cnt)
{
    unsigned char h[KVC_HEADER];
    if (cnt < 2 || code > 255)
        return KVC_BAD_ARG;
    put_header(h, code, count, meta_len);
    iov[0].iov_base = h;
    iov[0].iov_len = KVC_HEADER;
    iov[1].iov_base = (void *)meta;
    iov[1].iov_len = meta_len;
    return send_iov(fd, iov, cnt);
}

/* ---- the server: requests in through a buffer ----------------------------------------- */

/* How far a request's read may run past the bytes it needs: a run of small requests (gets,
 * a batch's meta) still arrives in one recv, while a put's value, which follows its meta,
 * is received mostly straight into its slot by kvc_reader_read_into instead of through
 * this buffer and a copy (a 64 KiB value was copied whole when a read took all it could). */
#define KVC_READ_AHEAD 4096u
/* kvc_reader_read_into: a remainder at least this long is received straight into its
 * destination; a shorter one refills the buffer as far as it holds (one recv for a run of
 * small values rather than one each). */
#define KVC_DIRECT_MIN 16384u

/* Makes at least `need` bytes buffered (need <= cap), reading at most `ahead` bytes past
 * the buffer's start (or `need`, if more; never past cap), keeping what arrived on any
 * error. */
static int fill_upto(int fd, struct kvc_reader *r, uint64_t need, uint64_t ahead)
{
    if (r->end - r->start >= need)
        return 0;
    if (r->start) {
        memmove(r->buf, r->buf + r->start, r->end - r->start);
        r->end -= r->start;
        r->start = 0;
    }
    uint64_t limit = need > ahead ? need : ahead;
    if (limit > r->cap)
        limit = r->cap;
    while (r->end < need) {
        ssize_t got = recv(fd, r->buf + r->end, limit - r->end, 0);
        if (got < 0) {
            if (errno == EINTR)
                continue;
            return -errno;
        }
        if (got == 0)
            return r->end == 0 ? KVC_EOF : KVC_SHORT;
        r->end += (uint64_t)got;
    }
    return 0;
}

static int fill(int fd, struct kvc_reader *r, uint64_t need)
{
    return fill_upto(fd, r, need, KVC_READ_AHEAD);
}

/* The next request: its header checked against item_size (256 entries, one per op code:
 * the size of one meta item, 0 for an op this stream does not serve), max_count and
 * max_meta, then its meta buffered whole (f->meta_at). Nothing is consumed until the
 * frame is complete, so a stall (-EAGAIN) leaves a partial frame buffered (r->end >
 * r->start). A meta larger than the buffer: KVC_META_BIG, with only the header consumed
 * (read the meta with kvc_reader_read_into). */
int kvc_next_request(int fd, struct kvc_reader *r, const uint16_t *item_size,
                     uint32_t max_count, uint64_t max_meta, struct kvc_frame *f)
{
    if (r->cap < KVC_HEADER || r->start > r->end || r->end > r->cap)
        return KVC_BAD_ARG;
    int rc = fill(fd, r, KVC_HEADER);
    if (rc)
        return rc;
    parse_header((const unsigned char *)r->buf + r->start, f);
    uint64_t size = item_size[f->code];
    if (size == 0)
        return KVC_BAD_OP;
    if (f->count > max_count)
        return KVC_BAD_COUNT;
    if (f->meta_len != (uint64_t)f->count * size || f->meta_len > max_meta)
        return KVC_BAD_META;
    if (f->meta_len > r->cap - KVC_HEADER) {
        r->start += KVC_HEADER;
        return KVC_META_BIG;
    }
    rc = fill(fd, r, KVC_HEADER + f->meta_len);
    if (rc)
        return rc == KVC_EOF ? KVC_SHORT : rc;
    f->meta_at = r->start + KVC_HEADER;
    r->start += KVC_HEADER + f->meta_len;
    return 0;
}

/* Fills dst[0:n]: buffered bytes first, then the rest straight from the socket, or, for a
 * rest shorter than KVC_DIRECT_MIN, through the buffer refilled as far as it holds. */
int kvc_reader_read_into(int fd, struct kvc_reader *r, char *dst, uint64_t n)
{
    if (r->start > r->end || r->end > r->cap)
        return KVC_BAD_ARG;
    for (;;) {
        uint64_t k = r->end - r->start;
        if (k > n)
            k = n;
        if (k) {
            memcpy(dst, r->buf + r->start, k);
            r->start += k;
            dst += k;
            n -= k;
        }
        if (n == 0)
            return 0;
        if (n >= KVC_DIRECT_MIN || n > r->cap)
            break;
        /* Buffered from here: at least n bytes (then the loop copies them and returns). */
        int rc = fill_upto(fd, r, n, r->cap);
        if (rc)
            return rc == KVC_EOF ? KVC_SHORT : rc;
    }
    int rc = recv_exact(fd, dst, n);
    return rc == KVC_EOF ? KVC_SHORT : rc;
}

/* Reads and drops n bytes (the values of a refused put), through scratch. */
int kvc_reader_discard(int fd, struct kvc_reader *r, uint64_t n, char *scratch,
                       uint64_t scratch_len)
{
    if (r->start > r->end || r->end > r->cap || scratch_len == 0)
        return KVC_BAD_ARG;
    uint64_t k = r->end - r->start;
    if (k > n)
        k = n;
    r->start += k;
    n -= k;
    while (n) {
        uint64_t chunk = n < scratch_len ? n : scratch_len;
        int rc = recv_exact(fd, scratch, chunk);
        if (rc)
            return rc == KVC_EOF ? KVC_SHORT : rc;
        n -= chunk;
    }
    return 0;
}

/* ---- the client: one request, its reply ------------------------------------------------- */

/* Receives a reply's header into f; checks it is not an error, not past max_meta. */
static int reply_header(int fd, struct kvc_frame *f, uint64_t max_meta)
{
    unsigned char h[KVC_HEADER];
    int rc = recv_exact(fd, (char *)h, KVC_HEADER);
    if (rc)
        return rc;
    parse_header(h, f);
    if (f->code != 0)
        return KVC_STATUS;
    if (f->meta_len > max_meta)
        return KVC_PROTO;
    return 0;
}

/* Sends a request (as kvc_send_frame), then receives its reply's header into f and its
 * meta into meta_out (at most meta_cap bytes). Returns the reply's meta length;
 * KVC_STATUS (an error reply: f holds its header, its message is left unread);
 * KVC_META_BIG (f holds the header, the meta is left unread); KVC_PROTO (meta_len past
 * max_meta); KVC_EOF, KVC_SHORT or -errno. */
int64_t kvc_call(int fd, unsigned op, uint32_t count, const char *meta, uint64_t meta_len,
                 struct iovec *iov, int cnt, struct kvc_frame *f, char *meta_out,
                 uint64_t meta_cap, uint64_t max_meta)
{
    int64_t sent = kvc_send_frame(fd, op, count, meta, meta_len, iov, cnt);
    if (sent < 0)
        return sent;
    int rc = reply_header(fd, f, max_meta);
    if (rc)
        return rc;
    if (f->meta_len > meta_cap)
        return KVC_META_BIG;
    rc = recv_exact(fd, meta_out, f->meta_len);
    if (rc)
        return rc == KVC_EOF ? KVC_SHORT : rc;
    return (int64_t)f->meta_len;
}

int64_t kvc_get_reply(int fd, uint32_t n, char *const *outs, const uint64_t *caps,
                      uint64_t *lengths, struct kvc_frame *f, uint64_t max_value);

/* A GET of n keys (keys: n x 16 bytes): sends it, checks the reply (count n, n x u64
 * lengths, written to lengths[] in host order), then receives each hit whose outs[i] is
 * set and holds caps[i] bytes or more straight into it, in key order. Returns n when
 * every hit landed; i < n: the index of the first hit it left unread (no buffer, or too
 * small; the caller reads from there on); or an error code as kvc_call (KVC_PROTO: the
 * reply does not answer n keys). A length past max_value is KVC_PROTO. */
int64_t kvc_get(int fd, const char *keys, uint32_t n, char *const *outs, const uint64_t *caps,
                uint64_t *lengths, struct kvc_frame *f, uint64_t max_value)
{
    struct iovec iov[3];
    iov[2].iov_base = NULL;
    iov[2].iov_len = 0;
    int64_t sent = kvc_send_frame(fd, 1 /* GET */, n, keys, (uint64_t)n * 16, iov, 2);
    if (sent < 0)
        return sent;
    return kvc_get_reply(fd, n, outs, caps, lengths, f, max_value);
}

/* The reply half of kvc_get, for a GET of n keys already sent (a pipelined get sends
 * several nodes their GETs before it reads any reply). The same checks and returns. */
int64_t kvc_get_reply(int fd, uint32_t n, char *const *outs, const uint64_t *caps,
                      uint64_t *lengths, struct kvc_frame *f, uint64_t max_value)
{
    int rc = reply_header(fd, f, (uint64_t)n * 8);
    if (rc)
        return rc;
    if (f->count != n || f->meta_len != (uint64_t)n * 8)
        return KVC_PROTO;
    rc = recv_exact(fd, (char *)lengths, f->meta_len);
    if (rc)
        return rc == KVC_EOF ? KVC_SHORT : rc;
    for (uint32_t i = 0; i < n; i++) {
        lengths[i] = get_le64((const unsigned char *)&lengths[i]);
        if (lengths[i] != KVC_MISS && lengths[i] > max_value)
            return KVC_PROTO;
    }
    for (uint32_t i = 0; i < n; i++) {
        uint64_t len = lengths[i];
        if (len == KVC_MISS)
            continue;
        if (outs[i] == NULL || caps[i] < len)
            return i;
        rc = recv_exact(fd, outs[i], len);
        if (rc)
            return rc == KVC_EOF ? KVC_SHORT : rc;
    }
    return n;
}

/* Fills buf[0:n] from the socket (a plain recv loop). */
int kvc_recv_exact(int fd, char *buf, uint64_t n)
{
    return recv_exact(fd, buf, n);
}
