"""The steps every native helper's build shares: whether a C compiler is there, and
compiling a cffi builder into the package that imports the module.

Each ``*_build.py`` describes its own module (sources, flags, the C declarations) and calls
these; a build that cannot run warns and returns None, so a machine without a compiler
installs and runs on the pure-Python fallbacks.
"""

from __future__ import annotations

import shutil
import sys
import sysconfig
import tempfile
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
