# shellcheck shell=bash
# The common part of scripts/setup-<engine>-env.sh, sourced by each of them.
#
# An engine's tests run in a virtualenv of their own, never .venv, cached outside the work
# tree: ~/.cache/kvstore/venv-NAME-HASH (or $NAME_VENV, upper-cased, to override). HASH
# covers what decides the contents: RECIPE (the build steps' version and package lists),
# the CONSTRAINTS file, and pyproject's dependencies and EXTRAS, so every clone on the
# machine reuses one environment and a change of pins builds a new one (older ones are
# removed then). One build at a time (flock); the pip log is kept as VENV.log and shown
# only when pip fails. kvstore is installed editable; a run from another clone re-points
# it there (seconds).
#
# The sourcing script sets NAME, CONSTRAINTS, EXTRAS, RECIPE and BUILD_NOTE, defines
# build_engine (the pip steps, using pip_q and $VENV, ending with an import check), then
# calls: engine_env "$@"   (with --path: print the path only, build nothing).

log() { echo "setup-$NAME-env: $*" >&2; }

pip_q() {  # quiet pip; its output goes to VENV.log and is shown only on failure
  if ! "$VENV/bin/python" -m pip "$@" >>"$VENV.log" 2>&1; then
    log "pip $* failed; last lines of $VENV.log:"
    tail -n 40 "$VENV.log" >&2
    exit 1
  fi
}

engine_env() {
  PYTHON=${PYTHON:-python3}
  local hash override_var override here there t0 old
  hash=$(RECIPE="$RECIPE" CONSTRAINTS="$CONSTRAINTS" EXTRAS="$EXTRAS" "$PYTHON" - <<'PY'
import hashlib, os, tomllib
p = tomllib.load(open("pyproject.toml", "rb"))["project"]
h = hashlib.sha256(os.environ["RECIPE"].encode())
h.update(open(os.environ["CONSTRAINTS"], "rb").read())
h.update(repr(p["dependencies"]).encode())
for extra in os.environ["EXTRAS"].split():
    h.update(repr(p["optional-dependencies"].get(extra)).encode())
print(h.hexdigest()[:12])
PY
)
  override_var="$(echo "$NAME" | tr '[:lower:]' '[:upper:]')_VENV"
  override=${!override_var:-}
  VENV=${override:-${XDG_CACHE_HOME:-$HOME/.cache}/kvstore/venv-$NAME-$hash}
  if [ "${1:-}" = "--path" ]; then echo "$VENV"; return 0; fi

  mkdir -p "$(dirname "$VENV")"
  exec 9>"$VENV.lock"
  flock 9  # one build at a time; a second caller waits and then reuses it
  if [ ! -f "$VENV/.complete" ]; then
    log "building $VENV ($BUILD_NOTE)"
    t0=$(date +%s)
    rm -rf "$VENV"
    if [ -z "$override" ]; then  # environments of older pins
      for old in "$(dirname "$VENV")"/venv-"$NAME"-*; do
        case "$old" in "$VENV"*) continue ;; esac
        [ -d "$old" ] || continue
        log "removing $old (other pins)"; rm -rf "$old" "$old.log" "$old.lock"
      done
    fi
    : >"$VENV.log"
    "$PYTHON" -m venv "$VENV"
    pip_q install --upgrade pip
    build_engine
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
}
