"""The `pagellm` command line, run as a user would (a subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest


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
