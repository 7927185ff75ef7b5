#!/usr/bin/env bash
# Builds (once) the environment the SGLang HiCache tests run in, and prints its path.
#
# A virtualenv of its own, never .venv: CPU torch 2.13.0 first, then sglang 0.5.23 with
# --no-deps (its wheel requires torch 2.14.1 and CUDA-only kernels that cannot install on
# a machine without a GPU), then the packages sglang's HiCache import path needs
# (SGLANG_DEPS below), then kvstore editable with its dev extra; every version pinned by
# constraints-sglang.txt. It lives in a cache outside the work tree (default
# ~/.cache/kvstore/venv-sglang-HASH; SGLANG_VENV=DIR overrides), named by a hash of what
# decides its contents (RECIPE, SGLANG_DEPS, the constraints, pyproject's dependency
# lists), so every clone on the machine reuses it and a change of pins builds a new one
# (older ones are removed then). A run from another clone re-points the editable kvstore
# there (seconds). The pip log is kept as VENV.log.
#
#   scripts/setup-sglang-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-sglang-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RECIPE=1  # bump when the build steps below change
# What `import sglang.srt.mem_cache...` (HiCache storage, host and device pools) needs on
# CPU; found by importing and adding each missing module. Versions: constraints-sglang.txt.
SGLANG_DEPS="orjson psutil pybase64 requests triton packaging pillow starlette msgspec
pydantic pyzmq tqdm ipython aiohttp transformers torchvision dill apache-tvm-ffi
sentencepiece compressed-tensors gguf"

hash=$(RECIPE=$RECIPE DEPS="$SGLANG_DEPS" "$PYTHON" - <<'PY'
import hashlib, os, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
h = hashlib.sha256((os.environ["RECIPE"] + os.environ["DEPS"]).encode())
h.update(open("constraints-sglang.txt", "rb").read())
h.update(repr(p["dependencies"]).encode())
for extra in ("dev", "sglang"):
    h.update(repr(p["optional-dependencies"].get(extra)).encode())
print(h.hexdigest()[:12])
PY
)
VENV=${SGLANG_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/venv-sglang-$hash}
if [ "${1:-}" = "--path" ]; then echo "$VENV"; exit 0; fi

log() { echo "setup-sglang-env: $*" >&2; }
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
  log "building $VENV (the first time: a few minutes and ~3.5 GB, most of it triton)"
  t0=$(date +%s)
  rm -rf "$VENV"
  if [ -z "${SGLANG_VENV:-}" ]; then  # environments of older pins
    for old in "$(dirname "$VENV")"/venv-sglang-*; do
      case "$old" in "$VENV"*) continue ;; esac
      [ -d "$old" ] || continue
      log "removing $old (other pins)"; rm -rf "$old" "$old.log" "$old.lock"
    done
  fi
  : >"$VENV.log"
  "$PYTHON" -m venv "$VENV"
  pip_q install --upgrade pip
  pip_q install -c constraints-sglang.txt torch  # CPU torch first
  pip_q install -c constraints-sglang.txt --no-deps sglang
  # shellcheck disable=SC2086
  pip_q install -c constraints-sglang.txt $SGLANG_DEPS
  pip_q install -c constraints-sglang.txt -e '.[dev]'
  "$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
import torch
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
v = md.version("sglang")
assert v == "0.5.23", v
print(f"setup-sglang-env: sglang {v}, torch {torch.__version__}")
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
