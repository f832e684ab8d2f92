"""The `pagellm` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pagellm", *args], capture_output=True,
                          text=True, timeout=300, env={**os.environ, **(env or {})})


def test_generate_prints_completions_and_throughput(model_dirs, hf_reference):
    from transformers import AutoTokenizer

    result = run_cli("generate", "--model", str(model_dirs["qwen3"]), "--max-tokens", "12",
                     "--kv-cache-memory-bytes", "4MiB", "--max-model-len", "256",
                     "hello world", "second prompt", env={"PAGELLM_LOG_LEVEL": "INFO"})
    assert result.returncode == 0, result.stderr
    assert "KV cache:" in result.stderr and "blocks" in result.stderr
    tokenizer = AutoTokenizer.from_pretrained(model_dirs["qwen3"])
    for prompt in ("hello world", "second prompt"):
        ids = hf_reference("qwen3", tokenizer.encode(prompt), 12)
        assert repr(tokenizer.decode(ids, skip_special_tokens=True)) in result.stdout
    assert "output tokens/s" in result.stdout


def test_generate_names_bad_flags_and_values(model_dirs):
    result = run_cli("generate", "--model", str(model_dirs["llama"]), "--max-modl-len", "8",
                     "x")
    assert result.returncode == 2 and "--max-modl-len" in result.stderr
    result = run_cli("generate", "--model", str(model_dirs["llama"]), "--max-model-len",
                     "99999", "x")
    assert result.returncode == 2 and "max_model_len" in result.stderr


@pytest.mark.slow
def test_make_model_then_demo(tmp_path: Path):
    out = tmp_path / "m"
    result = run_cli("make-model", "--arch", "qwen2", "--hidden-size", "32", "--layers", "1",
                     "--vocab-size", "512", str(out))
    assert result.returncode == 0, result.stderr
    assert (out / "config.json").is_file() and (out / "tokenizer.json").is_file()
    result = run_cli("generate", "--model", "demo", "--max-tokens", "4", "hi",
                     env={"PAGELLM_CACHE_DIR": str(tmp_path / "cache")})
    assert result.returncode == 0, result.stderr
    assert "RANDOM weights" in result.stderr and "completion (4 tokens" in result.stdout
    assert (tmp_path / "cache").is_dir()


def run_main(capsys: pytest.CaptureFixture[str], *args: str) -> subprocess.CompletedProcess:
    """The CLI's main in this process (no interpreter start-up, no torch import again):
    for errors raised before any engine starts."""
    from pagellm.frontend.cli import main

    try:
        code = main(list(args))
    except SystemExit as e:
        code = e.code
    return subprocess.CompletedProcess(args, code, "", capsys.readouterr().err)


def _one_line_error(result: subprocess.CompletedProcess, *names: str) -> None:
    """Exit code 2, no traceback, and the last line of stderr an error naming `names`."""
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr or "engine core failed" in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert "error:" in last, result.stderr
    for name in names:
        assert name in last, result.stderr


@pytest.mark.parametrize(("flag", "value", "names"), [
    ("--kv-cache-memory-bytes", "9" * 400, ["--kv-cache-memory-bytes", "too large"]),
    ("--kv-cache-memory-bytes", "999999999999999999GiB",
     ["--kv-cache-memory-bytes", "too large"]),
    ("--weight-transfer-config", "[" * 50000 + "]" * 50000,
     ["--weight-transfer-config", "nested too deeply"]),
    ("--max-num-seqs", "99999999999", ["--max-num-seqs", "1048576"]),
    ("--max-num-batched-tokens", "9999999999999", ["--max-num-batched-tokens", "2147483647"]),
], ids=["bytes-400-digits", "bytes-huge-GiB", "json-deep", "max-num-seqs", "batched-tokens"])
def test_out_of_range_flags_give_a_one_line_error_naming_the_flag(
        model_dirs, capsys, flag: str, value: str, names: list[str]) -> None:
    result = run_main(capsys, "generate", "--model", str(model_dirs["llama"]), flag, value,
                      "x")
    _one_line_error(result, *names)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


@pytest.mark.parametrize(("flag", "value", "names"), [
    ("--port", "70000", ["--port", "65535"]),  # uvicorn would listen on 70000 - 65536
    ("--shutdown-timeout", "1e400", ["--shutdown-timeout", "finite"]),
    ("--shutdown-timeout", "nan", ["--shutdown-timeout", "finite"]),
    ("--shutdown-timeout", "-1", ["--shutdown-timeout", ">= 0"]),
    ("--max-body-size", "0", ["--max-body-size", ">= 1024"]),
    ("--max-connections", "0", ["--max-connections", ">= 1"]),
    ("--max-connections-per-client", "0", ["--max-connections-per-client", ">= 1"]),
    ("--max-response-entries", "0", ["--max-response-entries", ">= 1"]),
    ("--engine-stall-timeout", "0", ["--engine-stall-timeout", "> 0"]),
    ("--engine-stall-timeout", "inf", ["--engine-stall-timeout", "finite"]),
    ("--api-key", "", ["--api-key", "empty"]),
], ids=["port", "timeout-inf", "timeout-nan", "timeout-negative", "body-0", "connections-0",
        "per-client-0", "entries-0", "stall-0", "stall-inf", "empty-key"])
def test_server_flags_out_of_range_are_named_before_anything_starts(
        model_dirs, capsys, flag: str, value: str, names: list[str]) -> None:
    """Each was a server that started wrong: 70000 listened on 4464, an empty key
    admitted "Bearer ", 1e400 crashed it once the engine was up, 0 bytes refused all."""
    result = run_main(capsys, "serve", str(model_dirs["llama"]), f"{flag}={value}")
    _one_line_error(result, *names)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_serving_from_an_engine_address_where_nothing_listens_is_one_line(
        model_dirs, capsys) -> None:
    """It was a traceback (the attach's ConnectionRefusedError went unhandled)."""
    from helpers import free_port

    address = f"tcp://127.0.0.1:{free_port()}"
    result = run_main(capsys, "serve", str(model_dirs["llama"]), "--engine-address", address)
    _one_line_error(result, "nothing accepts connections at", address)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr


def test_the_engine_core_refuses_an_infinite_shutdown_timeout(capsys) -> None:
    from pagellm.enginecore.__main__ import main

    with pytest.raises(SystemExit) as exit_info:
        main(["--address", "ipc:///nowhere", "--model", "demo", "--shutdown-timeout", "inf"])
    assert exit_info.value.code == 2
    assert "--shutdown-timeout must be a finite number" in capsys.readouterr().err


@pytest.mark.parametrize("cls", ["builtins.int", "threading.Thread"])
def test_worker_extension_that_is_no_mixin_is_named(cls: str) -> None:
    from pagellm.executor.worker.extension import worker_class

    with pytest.raises(ValueError, match=rf"worker_extension_cls '{cls}' .*mixin"):
        worker_class(cls)


@pytest.mark.parametrize(("update", "field"), [
    ({"rope_parameters": {"rope_type": "linear", "factor": "abc"}}, "rope_parameters.factor"),
    ({"rope_parameters": {"rope_type": "yarn", "factor": 4.0,
                          "original_max_position_embeddings": -5}},
     "rope_parameters.original_max_position_embeddings"),
    # transformers' own check, in every release from the floor up (5.0 takes an
    # attention_dropout of "abc"; 5.24 refuses it)
    ({"model_type": "not-a-model"}, "not-a-model"),
])
def test_config_garbage_gives_a_one_line_error_naming_the_field(
        model_dirs, tmp_path: Path, capsys, update: dict, field: str) -> None:
    import json
    import shutil

    model_dir = Path(shutil.copytree(model_dirs["llama"], tmp_path / "m"))
    config = json.loads((model_dir / "config.json").read_text())
    (model_dir / "config.json").write_text(json.dumps({**config, **update}))
    result = run_main(capsys, "generate", "--model", str(model_dir), "x")
    _one_line_error(result, field)
    assert len(result.stderr.strip().splitlines()) == 1, result.stderr
