"""pagellm installs one import name, and a plain (non-editable) install runs everything:
the multi-process engine, the server and the standalone engine core, from a directory
where the checkout is not importable."""

from __future__ import annotations

import os
import site
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest
import transformers
from helpers import ROOT, free_port

from pagellm.kernels import cpu_ops

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("wheel")
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(out), str(ROOT)], check=True, timeout=300)
    (path,) = out.glob("pagellm-*.whl")
    return path


def test_the_wheel_installs_only_the_pagellm_namespace(wheel):
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
    top_level = {name.split("/")[0] for name in names if ".dist-info/" not in name}
    assert top_level == {"pagellm"}, top_level
    for part in ("protocol", "enginecore", "executor", "kernels", "frontend"):
        assert f"pagellm/{part}/__init__.py" in names
    assert "pagellm/frontend/server/template_sandbox.py" in names
    for source in cpu_ops.SOURCES + cpu_ops.HEADERS:  # compiled on first use
        assert f"pagellm/kernels/csrc/{source.name}" in names


def test_a_plain_install_runs_the_engine_the_server_and_the_standalone_core(wheel, tmp_path):
    env_dir = tmp_path / "venv"
    venv.create(env_dir, with_pip=True)
    # The dependencies from this interpreter's site-packages, named in a .pth file (read
    # as plain paths: no .pth in them runs, so an editable pagellm there stays out).
    # system_site_packages would give the base interpreter's, which under a venv (CI's
    # second leg) is not the environment under test.
    (site_packages,) = env_dir.glob("lib/python*/site-packages")
    (site_packages / "deps_under_test.pth").write_text("\n".join(site.getsitepackages()))
    python = env_dir / "bin" / "python"
    # Without PYTHONPATH throughout: a checkout on it would make pip take pagellm as
    # installed already (and install nothing), and the imports below find the checkout.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env |= {"PAGELLM_CACHE_DIR": str(tmp_path / "cache"), "PAGELLM_LOG_LEVEL": "WARNING"}
    subprocess.run([python, "-m", "pip", "install", "-q", "--no-deps", str(wheel)],
                   env=env, check=True, timeout=300)
    work = tmp_path / "elsewhere"  # not the checkout: only the installed package counts
    work.mkdir()
    where = subprocess.run([python, "-c", "import pagellm; print(pagellm.__file__)"],
                           cwd=work, env=env, capture_output=True, text=True, check=True)
    assert str(env_dir) in where.stdout, where.stdout  # the installed copy, not ours

    # Hugging Face's `kernels` package beside it: both import, neither overwrote the other
    # (when pagellm installed a top-level `kernels`, this is what broke).
    # kernels 0.14 and later break importing transformers' models in transformers 5.0
    # (it builds a LayerRepository without the version they require; 5.17 passes them,
    # the releases between are untested): an older kernels for those.
    version = tuple(int(part) for part in transformers.__version__.split(".")[:2])
    kernels = "kernels" if version >= (5, 17) else "kernels<0.14"
    subprocess.run([python, "-m", "pip", "install", "-q", kernels], check=True, timeout=300)
    both = subprocess.run([python, "-c", (
        "import kernels, pagellm.kernels.triton_attention as ours\n"
        "assert hasattr(kernels, 'get_kernel'), kernels.__file__\n"
        "print(ours.SUPPORTED_BLOCK_SIZES)")], cwd=work, env=env, capture_output=True,
        text=True, timeout=300)
    assert both.returncode == 0, both.stderr

    # The README's first command (the multi-process engine on the demo model).
    generate = subprocess.run(
        [env_dir / "bin" / "pagellm", "generate", "--model", "demo", "--kv-cache-memory-bytes",
         "32MiB", "--max-tokens", "4", "The capital of France is"],
        cwd=work, env=env, capture_output=True, text=True, timeout=300)
    assert generate.returncode == 0, generate.stderr
    assert "1 requests, 4 tokens" in generate.stdout

    # A standalone engine core, and a frontend attached to it.
    address = f"ipc://{tmp_path}/engine"
    engine = subprocess.Popen([python, "-m", "pagellm.enginecore", "--model", "demo",
                               "--kv-cache-memory-bytes", "32MiB", "--address", address],
                              cwd=work, env=env)
    try:
        attach = subprocess.run([python, "-c", (
            "from pagellm import LLM, SamplingParams\n"
            f"with LLM('demo', engine_address={address!r}) as llm:\n"
            "    out = llm.generate('hi', SamplingParams(max_tokens=3), use_tqdm=False)\n"
            "    print(len(out[0].outputs[0].token_ids))\n")],
            cwd=work, env=env, capture_output=True, text=True, timeout=300)
        assert attach.returncode == 0 and attach.stdout.split()[-1] == "3", attach.stderr
    finally:
        engine.terminate()
        assert engine.wait(30) == 0

    # The server.
    port = free_port()
    server = subprocess.Popen([env_dir / "bin" / "pagellm", "serve", "demo", "--port",
                               str(port), "--kv-cache-memory-bytes", "32MiB"],
                              cwd=work, env=env)
    try:
        import urllib.request

        deadline = time.monotonic() + 120
        while True:
            assert server.poll() is None and time.monotonic() < deadline
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                    if r.status == 200:
                        break
            except OSError:
                time.sleep(0.3)
    finally:
        server.terminate()
        assert server.wait(60) == 0
