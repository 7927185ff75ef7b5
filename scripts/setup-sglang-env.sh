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
# What `import sglang.srt.mem_cache...` (HiCache storage, host and device pools) needs on
# CPU; found by importing and adding each missing module. Versions: constraints-sglang.txt.
SGLANG_DEPS="orjson psutil pybase64 requests triton packaging pillow starlette msgspec
pydantic pyzmq tqdm ipython aiohttp transformers torchvision dill apache-tvm-ffi
sentencepiece compressed-tensors gguf"
NAME=sglang
CONSTRAINTS=constraints-sglang.txt
EXTRAS="dev sglang"
RECIPE="1$SGLANG_DEPS"  # bump the leading 1 when the build steps below change
BUILD_NOTE="the first time: a few minutes and ~3.5 GB, most of it triton"

build_engine() {
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
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
