#!/usr/bin/env bash
# Builds (once) the environment NVIDIA's AIPerf runs from in the client tests, and prints
# its path.
#
# A virtualenv of its own, never .venv nor the vLLM one: AIPerf (`aiperf` on PyPI, pinned
# by constraints-aiperf.txt) brings its own pins (transformers, pydantic, zmq, ...) that may
# clash with vLLM's. The client tests (tests/engines/test_vllm_clients_aiperf.py) run in the
# vLLM environment and start `$AIPERF_VENV/bin/aiperf` as a subprocess against
# `conductor serve`; nothing imports AIPerf. kvstore is installed editable without
# dependencies (the common recipe re-points it at this clone). It lives in a cache outside
# the work tree (default ~/.cache/kvstore/venv-aiperf-HASH; AIPERF_VENV=DIR overrides),
# named by a hash of what decides its contents (RECIPE, the constraints, pyproject's
# dependency lists). The pip log is kept as VENV.log.
#
#   scripts/setup-aiperf-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-aiperf-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
NAME=aiperf
CONSTRAINTS=constraints-aiperf.txt
EXTRAS=""
RECIPE=1  # bump the leading 1 when the build steps below change
BUILD_NOTE="aiperf 0.13: about a minute the first time"

build_engine() {
  pip_q install -c constraints-aiperf.txt aiperf
  pip_q install --no-deps -e .
  "$VENV/bin/aiperf" --version >&2 || "$VENV/bin/python" - >&2 <<'PY'
import importlib.metadata as md
print("setup-aiperf-env: aiperf", md.version("aiperf"))
PY
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
