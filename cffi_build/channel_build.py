"""cffi (API mode) build of ``kvstore.protocol._channel``: the transfer channel's framing,
parsing and socket I/O in C (``cffi_build/channel.c``).

Run from the repository root::

    python -m cffi_build.channel_build            # the extension, -O2
    python -m cffi_build.channel_build --asan     # AddressSanitizer + UBSan (make asan-channel)

It places the extension next to ``kvstore/protocol/wire.py``. The native module is
optional: ``kvstore.protocol.native_channel`` falls back to the pure-Python path (the
same bytes on the wire), so without a C compiler this script warns and exits 0.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from pathlib import Path

from cffi import FFI

from cffi_build.compile import build_main, build_module, sources_builder

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent

# What kvstore/protocol/native_channel.py expects of a build (kvc_api_version()).
API_VERSION = 2
CDEF = """
struct iovec { void *iov_base; size_t iov_len; ...; };
struct kvc_reader { char *buf; uint64_t cap; uint64_t start; uint64_t end; };
struct kvc_frame { uint32_t code; uint32_t count; uint64_t meta_len; uint64_t meta_at; };
enum { KVC_EOF = -100000, KVC_SHORT = -100001, KVC_BAD_OP = -100002, KVC_BAD_COUNT = -100003,
       KVC_BAD_META = -100004, KVC_STATUS = -100005, KVC_PROTO = -100006,
       KVC_META_BIG = -100007, KVC_BAD_ARG = -100008 };
int kvc_api_version(void);
int64_t kvc_send_frame(int fd, unsigned code, uint32_t count, const char *meta,
                       uint64_t meta_len, struct iovec *iov, int cnt);
int kvc_next_request(int fd, struct kvc_reader *r, const uint16_t *item_size,
                     uint32_t max_count, uint64_t max_meta, struct kvc_frame *f);
int kvc_reader_read_into(int fd, struct kvc_reader *r, char *dst, uint64_t n);
int kvc_reader_discard(int fd, struct kvc_reader *r, uint64_t n, char *scratch,
                       uint64_t scratch_len);
int64_t kvc_call(int fd, unsigned op, uint32_t count, const char *meta, uint64_t meta_len,
                 struct iovec *iov, int cnt, struct kvc_frame *f, char *meta_out,
                 uint64_t meta_cap, uint64_t max_meta);
int64_t kvc_get(int fd, const char *keys, uint32_t n, char *const *outs,
                const uint64_t *caps, uint64_t *lengths, struct kvc_frame *f,
                uint64_t max_value);
int64_t kvc_get_reply(int fd, uint32_t n, char *const *outs, const uint64_t *caps,
                      uint64_t *lengths, struct kvc_frame *f, uint64_t max_value);
int kvc_recv_exact(int fd, char *buf, uint64_t n);
"""
MODULE = "kvstore.protocol._channel"
SOURCES = ["channel.c"]


def make_builder(asan: bool = False) -> FFI:
    return sources_builder(module=MODULE, cdef=CDEF, sources=SOURCES, asan=asan)


ffibuilder = make_builder()


def build(dest_dir: Path = _ROOT / "kvstore" / "protocol", *, asan: bool = False) -> Path | None:
    """Builds the extension into ``dest_dir``; returns its path, or None (with a warning)."""
    return build_module(make_builder, dest_dir, module=MODULE, asan=asan)


def main(argv: Sequence[str] | None = None) -> int:
    return build_main("python -m cffi_build.channel_build", lambda asan: build(asan=asan), argv)


if __name__ == "__main__":
    sys.exit(main())
