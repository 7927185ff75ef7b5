#!/usr/bin/env bash
# Builds (once) the environment the Mooncake reference tests run in, and prints its path.
#
# A virtualenv of its own, never .venv: Mooncake Store's real wheel
# (mooncake-transfer-engine-non-cuda 0.3.13.post1, the `mooncake` extra; its Python module
# `mooncake.store` and its `mooncake_master` binary) plus kvstore with its dev and torch
# extras (the wheel's tensor methods take torch tensors: CPU torch), pinned by constraints.txt.
# The wheel's binaries link libibverbs even for TCP: Debian's libibverbs1
# (scripts/install-system-deps.sh).
# It lives in a cache outside the work tree (default ~/.cache/kvstore/venv-mooncake-HASH;
# MOONCAKE_VENV=DIR overrides), named by a hash of what decides its contents (RECIPE, the
# constraints, pyproject's dependency lists), so every clone on the machine reuses it and a
# change of pins builds a new one (older ones are removed then). A run from another clone
# re-points the editable kvstore there (seconds). The pip log is kept as VENV.log.
#
#   scripts/setup-mooncake-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-mooncake-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=mooncake
CONSTRAINTS=constraints.txt
EXTRAS="dev torch mooncake"
RECIPE=1  # bump the leading 1 when the build steps below change
BUILD_NOTE="the first time: about a minute, most of it CPU torch"

build_engine() {
  pip_q install -c constraints.txt -e '.[dev,torch,mooncake]'
  "$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
import pathlib
import mooncake.store
import torch
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
v = md.version("mooncake-transfer-engine-non-cuda")
assert v == "0.3.13.post1", v
master = pathlib.Path(mooncake.__file__).parent / "mooncake_master"
assert master.is_file(), f"no {master}"
print(f"setup-mooncake-env: mooncake {v}, master {master}")
PY
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
