"""pagellm's C++ CPU ops (csrc/), compiled once per machine on first use with torch's own
extension builder and loaded as `torch.ops.pagellm_cpu`:

- `int_gemm`: the weight-only int4 / int8 GEMM (cpu_int_gemm.py, csrc/cpu_int_gemm.cpp);
- `decode_layers`: a decode step's decoder layers in one call (executor/worker/cpu_decode.py,
  csrc/cpu_decode.cpp), which runs its integer projections through `int_gemm`;
- `bf16_linear`: a bf16 GEMV for up to 4 rows (executor/model/linear.py, csrc/cpu_bf16.cpp);
- `paged_decode_attention`: one-token queries over their paged keys and values, in place
  (executor/model/attention.py, csrc/cpu_attention.cpp); `decode_layers` runs it too;
- `prefill_attention`: a prompt's (or a later chunk's) queries over its keys, causally
  (the same files);
- `add_rms_norm`, `silu_and_mul`, `rotary`: the decoder's elementwise steps in one pass
  each, for the torch path's steps (cpu_fused.py, csrc/cpu_elementwise.cpp);
- `argmax_rows`: the sampler's argmax over fp32 logits (executor/worker/sampler.py,
  csrc/cpu_sampling.cpp).

Why compiled here and not shipped built: they are compiled with -march=native, for the
instructions of the CPU they run on (AVX-512 VNNI's int8 dot products above all). The
build takes about 15 s and is cached under ~/.cache/pagellm/torch_extensions, keyed by
the sources and this CPU's instruction set, so a home directory shared between machines
never loads a build for another CPU.
"""

from __future__ import annotations

import hashlib
import os
import shutil
from functools import cache
from pathlib import Path
from typing import Any

import torch

CSRC = Path(__file__).with_name("csrc")
SOURCES = (CSRC / "cpu_int_gemm.cpp", CSRC / "cpu_decode.cpp", CSRC / "cpu_bf16.cpp",
           CSRC / "cpu_attention.cpp", CSRC / "cpu_elementwise.cpp", CSRC / "cpu_sampling.cpp")
HEADERS = (CSRC / "cpu_ops.h",)


def build_root() -> Path:
    """Where the builds live: $TORCH_EXTENSIONS_DIR as torch's builder honours it, else
    ~/.cache/pagellm/torch_extensions."""
    root = os.environ.get("TORCH_EXTENSIONS_DIR")
    return Path(root) if root else Path.home() / ".cache" / "pagellm" / "torch_extensions"


def _extension_name(portable: bool) -> str:
    """The compiled module's name: the sources' and this CPU's flags' hash."""
    digest = hashlib.sha256()
    for path in SOURCES + HEADERS:
        digest.update(path.read_bytes())
    digest.update(_cpu_flags().encode())
    return f"pagellm_cpu_ops{'_portable' if portable else ''}_{digest.hexdigest()[:12]}"


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        return ""


def _ninja_on_path() -> None:
    """torch's builder runs `ninja` from PATH: where none is there (a venv used without
    activating it), the `ninja` package's own binary (a dependency) is put there."""
    if shutil.which("ninja") is not None:
        return
    try:
        import ninja
    except ImportError:
        return  # the builder's own error names what is missing
    os.environ["PATH"] = ninja.BIN_DIR + os.pathsep + os.environ.get("PATH", "")


@cache
def available() -> bool:
    """Whether the ops build here (else callers keep torch's ops; the attention backend's
    warning already says why)."""
    try:
        load()
    except RuntimeError:
        return False
    return True


def load(portable: bool = False) -> Any:
    """Compile (first use on this machine) and load the ops; returns their namespace,
    torch.ops.pagellm_cpu. `portable`: the plain-loop build (no AVX-512 intrinsics), as
    torch.ops.pagellm_cpu_portable, for tests. Raises RuntimeError naming what is missing
    (a C++ compiler, ninja). Once per process and build: a second library registering
    the same namespace would abort the process."""
    return _load(bool(portable))  # (one cache entry per build, however it is called)


@cache
def _load(portable: bool) -> Any:
    namespace = "pagellm_cpu_portable" if portable else "pagellm_cpu"
    name = _extension_name(portable)
    directory = build_root() / name
    built = directory / f"{name}.so"
    # The name is the sources' hash, so a library there is a build of these very
    # sources: loaded directly (torch's builder imports setuptools and runs ninja, ~0.3 s
    # at every engine start), unless another process holds the builder's lock (it may be
    # writing the file: the builder waits for it).
    if built.exists() and not (directory / "lock").exists():
        torch.ops.load_library(str(built))
        return getattr(torch.ops, namespace)
    from torch.utils.cpp_extension import load as build

    _ninja_on_path()
    directory.mkdir(parents=True, exist_ok=True)
    # -fopenmp: at::parallel_for is an inline `#pragma omp parallel`, serial without it;
    # the module then shares the libgomp torch has loaded (the same soname).
    flags = ["-O3", "-march=native", "-fopenmp"]
    if portable:
        flags += ["-DPAGELLM_PORTABLE", f"-DPAGELLM_NS={namespace}"]
    try:
        build(name=name, sources=[str(p) for p in SOURCES], build_directory=str(directory),
              is_python_module=False, extra_cflags=flags, extra_ldflags=["-fopenmp"],
              extra_include_paths=[str(CSRC)], verbose=False)
    except (RuntimeError, OSError) as e:
        raise RuntimeError(
            "pagellm's C++ CPU ops (int4 weights, the fused decode step) are compiled on "
            f"first use with torch's extension builder (a C++ compiler and ninja): {e}"
        ) from e
    return getattr(torch.ops, namespace)
