"""cffi (API mode) build of ``tiers._uring``: batched io_uring block I/O for the SSD tier.

Run from the repository root::

    python -m cffi_build.uring_build

It compiles ``cffi_build/uring_io.c`` against liburing and places the extension
next to ``tiers/ssd/tier.py`` (``tiers/_uring*.so``). The native module is optional:
``tiers/ssd/tier.py`` falls back to a pure-Python thread-pool backend, so when
liburing or a C compiler is missing this script warns and exits 0.
"""

from __future__ import annotations

import ctypes.util
import platform
import sys
from pathlib import Path

from cffi import FFI

from cffi_build.compile import compile_into, no_compiler

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_C_SOURCE = _HERE / "uring_io.c"

# The helper's functions, as Python sees them.
PROTOTYPES = """
struct kv_ring;
struct kv_queue;
struct kv_group;
int kv_ring_api_version(void);
int kv_have_verify(void);
uint64_t kv_xxh3_iov(const struct iovec *iov, int cnt, int64_t len);
int kv_ring_open(unsigned depth, struct kv_ring **out);
void kv_ring_close(struct kv_ring *r);
int kv_ring_run(struct kv_ring *r, int fd, int n, const unsigned char *is_write,
                const int64_t *offsets, const struct iovec *iovs, const int *iov_counts,
                int64_t *results, int max_inflight);
int kv_queue_open(unsigned depth, int fd, struct kv_queue **out);
void kv_queue_close(struct kv_queue *q);
int kv_queue_error(struct kv_queue *q);
int kv_queue_submit(struct kv_queue *q, struct kv_op *ops, int n, int max_inflight,
                    struct kv_group **out);
int kv_group_wait(struct kv_group *g, int *idx, int room, int min_new, int timeout_ms);
void kv_group_cancel(struct kv_group *g);
void kv_group_free(struct kv_group *g);
int kv_queue_run(struct kv_queue *q, struct kv_op *ops, int n, int max_inflight);
void kv_op_sync(int fd, struct kv_op *op);
"""
# What tiers/ssd/io.py expects of a build (kv_ring_api_version()).
API_VERSION = 4
# struct iovec and struct kv_op are declared with "..." so cffi takes their real
# layout from the compiler (kv_op has private fields Python never touches).
CDEF = ("struct iovec { void *iov_base; size_t iov_len; ...; };\n"
        "struct kv_op { const struct iovec *iov; int64_t offset; int64_t result; "
        "uint64_t want; int64_t verify_len; int iov_count; unsigned char is_write; "
        "signed char verdict; ...; };\n" + PROTOTYPES)

# The generated module includes the helper's source (one translation unit), so the
# compiler sees the real struct kv_op that cffi's "..." declaration refers to.
_PREAMBLE = '#include "uring_io.c"\n'

_INCLUDE_DIRS = ["/usr/include", "/usr/local/include"]


def _have_header(name: str) -> bool:
    return any((Path(d) / name).exists() for d in _INCLUDE_DIRS)


def _xxh_dispatch() -> bool:
    """Whether libxxhash with run-time SIMD dispatch (Debian's x86-64 build) can be
    linked: faster hashing than the inline build, which is SSE2 only without -march."""
    return (platform.machine() in ("x86_64", "AMD64") and _have_header("xxh_x86dispatch.h")
            and ctypes.util.find_library("xxhash") is not None)


def _make_builder(verify: bool) -> FFI:
    """The cffi builder; ``verify`` compiles the xxh3 read verification in: libxxhash's
    dispatching XXH3 where available, else header-only xxHash (XXH_INLINE_ALL)."""
    dispatch = verify and _xxh_dispatch()
    macros = [("KV_HAVE_XXHASH", "1")] if verify else []
    if dispatch:
        macros.append(("KV_XXH_DISPATCH", "1"))
    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        "tiers._uring",
        _PREAMBLE,
        include_dirs=[str(_HERE)],
        depends=[str(_C_SOURCE), str(_HERE / "uring_ring.c")],
        libraries=["uring", "pthread", *(["xxhash"] if dispatch else [])],
        define_macros=macros,
        extra_compile_args=["-O2", "-std=gnu11", "-Wall"],
    )
    return builder


# Without libxxhash-dev the helper still builds: reads are then verified in Python.
ffibuilder = _make_builder(_have_header("xxhash.h"))


def _have_liburing() -> str | None:
    """None if the build can be attempted, else why not."""
    reason = no_compiler()
    if reason is not None:
        return reason
    if not _have_header("liburing.h"):
        return "liburing.h not found (install liburing-dev)"
    return None


def build(dest_dir: Path = _ROOT / "tiers", *, verify: bool | None = None) -> Path | None:
    """Builds the extension into ``dest_dir``; returns its path, or None (with a warning).

    ``verify``: compile the in-C checksum verification (default: if ``xxhash.h`` is
    installed, from libxxhash-dev).
    """
    reason = _have_liburing()
    if reason is not None:
        print(f"warning: not building tiers._uring: {reason}", file=sys.stderr)
        return None
    if verify is None:
        verify = _have_header("xxhash.h")
        if not verify:
            print("warning: xxhash.h not found (install libxxhash-dev): tiers._uring "
                  "will leave read checksums to Python", file=sys.stderr)
    builder = _make_builder(verify)
    return compile_into(builder, dest_dir, module="tiers._uring")


def main() -> int:
    target = build()
    if target is not None:
        print(f"built {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
