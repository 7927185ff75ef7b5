#!/usr/bin/env bash
# Builds (once) the environment the LMCache remote-storage-plugin tests run in, and prints
# its path.
#
# A virtualenv of its own, never .venv: CPU torch 2.13.0 first, then lmcache 0.5.6 with
# --no-deps (its wheel requires CUDA-only packages, cupy-cuda13x, cuda-python, cufile,
# nvtx, and protobuf<7, which kvstore's gRPC code cannot use), then the packages LMCache's
# standalone engine and remote backend import (LMCACHE_DEPS below), then kvstore editable
# with its dev extra; every version pinned by constraints-lmcache.txt. It lives in a cache
# outside the work tree (default ~/.cache/kvstore/venv-lmcache-HASH; LMCACHE_VENV=DIR
# overrides), named by a hash of what decides its contents (RECIPE, LMCACHE_DEPS, the
# constraints, pyproject's dependency lists), so every clone on the machine reuses it and a
# change of pins builds a new one (older ones are removed then). A run from another clone
# re-points the editable kvstore there (seconds). The pip log is kept as VENV.log.
#
#   scripts/setup-lmcache-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-lmcache-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
# What `import lmcache.v1.cache_engine` (engine, local CPU and remote backends, the plugin
# loader) needs on CPU; found by importing and adding each missing module. Versions:
# constraints-lmcache.txt.
LMCACHE_DEPS="numpy prometheus-client py-cpuinfo psutil aiohttp requests cachetools numba
transformers aiofile msgspec pyzmq cryptography"
NAME=lmcache
CONSTRAINTS=constraints-lmcache.txt
EXTRAS="dev lmcache"
RECIPE="1$LMCACHE_DEPS"  # bump the leading 1 when the build steps below change
BUILD_NOTE="the first time: about a minute and ~1.7 GB, most of it torch"

build_engine() {
  pip_q install -c constraints-lmcache.txt torch  # CPU torch first
  pip_q install -c constraints-lmcache.txt --no-deps lmcache
  # shellcheck disable=SC2086
  pip_q install -c constraints-lmcache.txt $LMCACHE_DEPS
  pip_q install -c constraints-lmcache.txt -e '.[dev]'
  "$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
import torch
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
v = md.version("lmcache")
assert v == "0.5.6", v
import lmcache.v1.cache_engine  # noqa: F401  (the engine imports without CUDA)
print(f"setup-lmcache-env: lmcache {v}, torch {torch.__version__}")
PY
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
