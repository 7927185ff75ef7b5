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

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from cffi import FFI

from cffi_build.compile import compile_into, no_compiler

_HERE = Path(__file__).resolve().parent
_ROOT = _HERE.parent
_C_SOURCE = _HERE / "channel.c"

# What kvstore/protocol/native_channel.py expects of a build (kvc_api_version()).
API_VERSION = 1
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
int kvc_recv_exact(int fd, char *buf, uint64_t n);
"""
MODULE = "kvstore.protocol._channel"
ASAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]


def make_builder(*, asan: bool = False) -> FFI:
    builder = FFI()
    builder.cdef(CDEF)
    builder.set_source(
        MODULE,
        '#include "channel.c"\n',
        include_dirs=[str(_HERE)],
        depends=[str(_C_SOURCE)],
        extra_compile_args=(ASAN_FLAGS if asan else ["-O2"]) + ["-std=gnu11", "-Wall"],
        extra_link_args=["-fsanitize=address,undefined"] if asan else [],
    )
    return builder


ffibuilder = make_builder()


def build(dest_dir: Path = _ROOT / "kvstore" / "protocol", *, asan: bool = False) -> Path | None:
    """Builds the extension into ``dest_dir``; returns its path, or None (with a warning)."""
    reason = no_compiler()
    if reason is not None:
        print(f"warning: not building {MODULE}: {reason}", file=sys.stderr)
        return None
    builder = make_builder(asan=asan)
    return compile_into(builder, dest_dir, module=MODULE)


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m cffi_build.channel_build")
    p.add_argument(
        "--asan",
        action="store_true",
        help="AddressSanitizer + UBSan build (run with LD_PRELOAD=$(gcc "
        "-print-file-name=libasan.so))",
    )
    args = p.parse_args(argv)
    target = build(asan=args.asan)
    if target is not None:
        print(f"built {target}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
