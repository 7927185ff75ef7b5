#!/usr/bin/env bash
# Builds (once) what the benchmarks' peer vLLM servers need beyond the vLLM environment,
# and prints its path: a directory to put on those servers' PYTHONPATH (benchmarks/vllm_peers.py).
#
# The vLLM environment (scripts/setup-vllm-env.sh) is shared and is NOT modified: the peers'
# packages are installed with `pip install --no-deps --target` into an overlay of their own,
# by the vLLM environment's pip (so the wheels match its Python), pinned by
# constraints-vllm-peers.txt: Mooncake Store's real wheel (mooncake-transfer-engine-non-cuda
# 0.3.13.post1: `mooncake.store` for vLLM's MooncakeStoreConnector, and its
# `mooncake_master`). It lives in a cache outside the work tree (default
# ~/.cache/kvstore/vllm-peers-HASH; VLLM_PEERS_DIR=DIR overrides), named by a hash of what
# decides its contents (RECIPE, the constraints, the vLLM environment's Python version), so
# every clone on the machine reuses it and a change of pins builds a new one (older ones are
# removed then). One build at a time (flock); the pip log is kept as DIR.log. Needs the
# vLLM environment built (make test-vllm or scripts/setup-vllm-env.sh); VLLM_PYTHON=PATH
# names another vLLM Python.
#
#   scripts/setup-vllm-peers.sh          build if needed, then print the overlay's path on stdout
#   scripts/setup-vllm-peers.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
CONSTRAINTS=constraints-vllm-peers.txt
RECIPE=1  # bump when the build steps below change
log() { echo "setup-vllm-peers: $*" >&2; }

# --path: never build the vLLM environment (nor re-point its editable kvstore) from here.
VLLM_PY=${VLLM_PYTHON:-$(PYTHON=${PYTHON:-python3} bash scripts/setup-vllm-env.sh --path)/bin/python}
if [ ! -x "$VLLM_PY" ]; then
  log "no vLLM environment at $VLLM_PY: build it first (scripts/setup-vllm-env.sh)"
  exit 1
fi
pyver=$("$VLLM_PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
hash=$( { echo "$RECIPE $pyver"; cat "$CONSTRAINTS"; } | sha256sum | cut -c1-12)
DIR=${VLLM_PEERS_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/vllm-peers-$hash}
if [ "${1:-}" = "--path" ]; then echo "$DIR"; exit 0; fi

mkdir -p "$(dirname "$DIR")"
exec 9>"$DIR.lock"
flock 9  # one build at a time; a second caller waits and then reuses it
if [ ! -f "$DIR/.complete" ]; then
  log "building $DIR (the first time: seconds, a 46 MB wheel)"
  rm -rf "$DIR"
  if [ -z "${VLLM_PEERS_DIR:-}" ]; then  # overlays of older pins
    for old in "$(dirname "$DIR")"/vllm-peers-*; do
      case "$old" in "$DIR"*) continue ;; esac
      [ -d "$old" ] || continue
      log "removing $old (other pins)"; rm -rf "$old" "$old.log" "$old.lock"
    done
  fi
  : >"$DIR.log"
  # Every pinned requirement of the constraints file, no dependencies (see its header).
  reqs=$(grep -v '^\s*#' "$CONSTRAINTS" | grep -v '^\s*$')
  # shellcheck disable=SC2086
  if ! "$VLLM_PY" -m pip install --no-deps --target "$DIR" -c "$CONSTRAINTS" $reqs \
      >>"$DIR.log" 2>&1; then
    log "pip failed; last lines of $DIR.log:"; tail -n 40 "$DIR.log" >&2; exit 1
  fi
  PYTHONPATH="$DIR" "$VLLM_PY" - >&2 <<'PY'
import importlib.metadata as md
import pathlib
import mooncake.store  # noqa: F401  (the native module loads beside the vLLM environment)
import mooncake
v = md.version("mooncake-transfer-engine-non-cuda")
assert v == "0.3.13.post1", v
master = pathlib.Path(mooncake.__file__).parent / "mooncake_master"
assert master.is_file(), f"no {master}"
print(f"setup-vllm-peers: mooncake {v}, master {master}")
PY
  touch "$DIR/.complete"
fi
echo "$DIR"
