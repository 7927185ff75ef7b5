"""``conductor serve`` in vLLM mode: argument errors and unreachable instances end in one
line on stderr and exit 1 (the engine tests run it against real vLLM servers)."""

from __future__ import annotations

import pytest

from conductor.cli import main
from conductor.front.vllm_procs import free_port


def run(capsys: pytest.CaptureFixture[str], *args: str) -> tuple[int, str]:
    code = main(["serve", *args])
    err = capsys.readouterr().err
    return code, err


BASE = ("--kv-namespace", "ns", "--block-tokens", "32")


@pytest.mark.parametrize(("args", "message"), [
    (("--store", "127.0.0.1:1", "--vllm-prefill", "http://127.0.0.1:1", *BASE),
     "disaggregated serving needs both --vllm-prefill and --vllm-decode"),
    (("--store", "127.0.0.1:1", "--vllm", "u", "--vllm-decode", "v", *BASE),
     "--vllm (colocated) cannot be combined with --vllm-prefill/--vllm-decode"),
    (("--vllm", "u", *BASE), "give exactly one of --store HOST:PORT and --etcd HOST:PORT"),
    (("--store", "a:1", "--etcd", "b:2", "--vllm", "u", *BASE),
     "give exactly one of --store HOST:PORT and --etcd HOST:PORT"),
    (("--store", "a:1", "--vllm", "u", "--prefill", "w:1", *BASE),
     "--prefill/--decode (toy workers) cannot be combined with --vllm*"),
    (("--store", "a:1", "--vllm", "u", "--listen", "nowhere", *BASE),
     "--listen must be HOST:PORT, got 'nowhere'"),
    (("--store", "a:1"), "need --vllm-prefill and --vllm-decode, --vllm, or (toy workers) "
     "--prefill and --decode"),
])
def test_usage_errors_are_one_line(capsys: pytest.CaptureFixture[str], args: tuple[str, ...],
                                   message: str) -> None:
    code, err = run(capsys, *args)
    assert code == 1
    assert err == f"conductor serve: error: {message}\n" or err.startswith(
        f"conductor serve: error: {message}")
    assert "Traceback" not in err


@pytest.mark.parametrize("flags", [BASE, ()])  # the namespace and block size are optional
def test_an_unreachable_instance_is_named(capsys: pytest.CaptureFixture[str],
                                          flags: tuple[str, ...]) -> None:
    port = free_port()
    code, err = run(capsys, "--store", "127.0.0.1:1", "--vllm", f"127.0.0.1:{port}", *flags,
                    "--listen", "127.0.0.1:0")
    assert code == 1
    assert err.startswith(f"conductor serve: error: colocated instance "
                          f"http://127.0.0.1:{port}: GET /v1/models failed: ConnectError")
    assert err.count("\n") == 1


def test_a_tokenizer_directory_without_tokenizer_json(capsys: pytest.CaptureFixture[str],
                                                      tmp_path) -> None:
    import importlib.util

    code, err = run(capsys, "--store", "a:1", "--vllm", "u", *BASE, "--tokenizer",
                    str(tmp_path))
    assert code == 1
    if importlib.util.find_spec("tokenizers") is None:  # without the 'text' extra
        assert err == ("conductor serve: error: --tokenizer needs the 'tokenizers' package "
                       "(the 'text' extra)\n")
    else:
        assert err == (f"conductor serve: error: {tmp_path}: no tokenizer.json (a Hugging "
                       f"Face fast tokenizer)\n")
