"""The steps every native helper's build shares: whether a C compiler is there, and
compiling a cffi builder into the package that imports the module.

Each ``*_build.py`` describes its own module (sources, flags, the C declarations) and calls
these; a build that cannot run warns and returns None, so a machine without a compiler
installs and runs on the pure-Python fallbacks.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import sysconfig
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

from cffi import FFI


def no_compiler() -> str | None:
    """None if a build can be attempted, else why not."""
    cc = (sysconfig.get_config_var("CC") or "cc").split()[0]
    if shutil.which(cc) is None and shutil.which("gcc") is None:
        return f"no C compiler ({cc!r} not found)"
    return None


def compile_into(builder: FFI, dest_dir: Path, *, module: str) -> Path | None:
    """Compiles ``builder`` in a scratch directory (the generated .c/.o files stay out of
    the tree) and puts the extension into ``dest_dir``; its path, or None with a warning
    naming ``module`` when the compiler fails."""
    with tempfile.TemporaryDirectory(prefix="kvstore-build-") as tmp:
        try:
            built = Path(builder.compile(tmpdir=tmp, verbose=False))
        except Exception as exc:  # cffi raises distutils/setuptools errors of varying types
            print(f"warning: not building {module}: {exc}", file=sys.stderr)
            return None
        dest_dir.mkdir(parents=True, exist_ok=True)
        target = dest_dir / built.name
        # Replace atomically so a process that already mapped the old .so keeps a valid file.
        tmp_target = target.with_name(target.name + ".tmp")
        shutil.copyfile(built, tmp_target)
        tmp_target.replace(target)
    return target


HERE = Path(__file__).resolve().parent
ASAN_FLAGS = ["-fsanitize=address,undefined", "-fno-omit-frame-pointer", "-g", "-O1"]


def sources_builder(*, module: str, cdef: str, sources: Sequence[str], asan: bool) -> FFI:
    """A builder of ``module`` compiling ``sources`` (C files in ``cffi_build/``) as one
    unit: -O2, or with ``asan`` AddressSanitizer + UBSan at -O1 (run the tests with the
    runtime preloaded: ``LD_PRELOAD=$(gcc -print-file-name=libasan.so)``)."""
    builder = FFI()
    builder.cdef(cdef)
    builder.set_source(
        module,
        "".join(f'#include "{name}"\n' for name in sources),
        include_dirs=[str(HERE)],
        depends=[str(HERE / name) for name in sources],
        extra_compile_args=(ASAN_FLAGS if asan else ["-O2"]) + ["-std=gnu11", "-Wall"],
        extra_link_args=["-fsanitize=address,undefined"] if asan else [],
    )
    return builder


def build_module(make_builder: Callable[[bool], FFI], dest_dir: Path, *, module: str,
                 asan: bool) -> Path | None:
    """Builds ``make_builder(asan)`` into ``dest_dir``; its path, or None with a warning
    (no compiler, or the compiler failed)."""
    reason = no_compiler()
    if reason is not None:
        print(f"warning: not building {module}: {reason}", file=sys.stderr)
        return None
    return compile_into(make_builder(asan), dest_dir, module=module)


def build_main(prog: str, build: Callable[[bool], Path | None],
               argv: Sequence[str] | None) -> int:
    """The command line of a sanitizable helper's build: ``[--asan]``; exits 0 even when
    nothing was built (the pure-Python fallback runs then)."""
    p = argparse.ArgumentParser(prog=prog)
    p.add_argument("--asan", action="store_true",
                   help="AddressSanitizer + UBSan build (run with LD_PRELOAD=$(gcc "
                   "-print-file-name=libasan.so))")
    target = build(p.parse_args(argv).asan)
    if target is not None:
        print(f"built {target}")
    return 0
