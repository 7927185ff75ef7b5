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
PYTHON=${PYTHON:-python3}
RECIPE=1  # bump when the build steps below change
# What `import lmcache.v1.cache_engine` (engine, local CPU and remote backends, the plugin
# loader) needs on CPU; found by importing and adding each missing module. Versions:
# constraints-lmcache.txt.
LMCACHE_DEPS="numpy prometheus-client py-cpuinfo psutil aiohttp requests cachetools numba
transformers aiofile msgspec pyzmq cryptography"

hash=$(RECIPE=$RECIPE DEPS="$LMCACHE_DEPS" "$PYTHON" - <<'PY'
import hashlib, os, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
h = hashlib.sha256((os.environ["RECIPE"] + os.environ["DEPS"]).encode())
h.update(open("constraints-lmcache.txt", "rb").read())
h.update(repr(p["dependencies"]).encode())
for extra in ("dev", "lmcache"):
    h.update(repr(p["optional-dependencies"].get(extra)).encode())
print(h.hexdigest()[:12])
PY
)
VENV=${LMCACHE_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/venv-lmcache-$hash}
if [ "${1:-}" = "--path" ]; then echo "$VENV"; exit 0; fi

log() { echo "setup-lmcache-env: $*" >&2; }
mkdir -p "$(dirname "$VENV")"
exec 9>"$VENV.lock"
flock 9  # one build at a time; a second caller waits and then reuses it

pip_q() {  # quiet pip; its output goes to VENV.log and is shown only on failure
  if ! "$VENV/bin/python" -m pip "$@" >>"$VENV.log" 2>&1; then
    log "pip $* failed; last lines of $VENV.log:"
    tail -n 40 "$VENV.log" >&2
    exit 1
  fi
}

if [ ! -f "$VENV/.complete" ]; then
  log "building $VENV (the first time: about a minute and ~1.7 GB, most of it torch)"
  t0=$(date +%s)
  rm -rf "$VENV"
  if [ -z "${LMCACHE_VENV:-}" ]; then  # environments of older pins
    for old in "$(dirname "$VENV")"/venv-lmcache-*; do
      case "$old" in "$VENV"*) continue ;; esac
      [ -d "$old" ] || continue
      log "removing $old (other pins)"; rm -rf "$old" "$old.log" "$old.lock"
    done
  fi
  : >"$VENV.log"
  "$PYTHON" -m venv "$VENV"
  pip_q install --upgrade pip
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
  touch "$VENV/.complete"
  log "built in $(( $(date +%s) - t0 )) s, $(du -sh "$VENV" | cut -f1)"
fi
# The editable kvstore must be this work tree (a fresh clone lives elsewhere).
here=$(pwd -P)
there=$(cd / && "$VENV/bin/python" -I -c 'import kvstore, pathlib; print(pathlib.Path(kvstore.__file__).resolve().parent.parent)' 2>/dev/null || true)
if [ "$there" != "$here" ]; then
  log "pointing the environment's kvstore at $here"
  pip_q install --no-deps -e .
fi
echo "$VENV"
