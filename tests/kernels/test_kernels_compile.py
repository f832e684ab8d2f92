"""Every Triton kernel specialization the launchers use compiles for Hopper (sm_90) and
Ampere (sm_80) with Triton's bundled ptxas, without spilling registers.

The interpreter tests prove the kernels' arithmetic; this proves real compilation,
which the interpreter never does (it accepts a `tl.dot` under 16x16, for one), on a
machine with no GPU. See tests/support/compile_kernels.py."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import pytest
import triton
from background import Job
from helpers import SUPPORT

from pagellm.kernels.triton_attention import SUPPORTED_HEAD_SIZES

SCRIPT = SUPPORT / "compile_kernels.py"
PTXAS = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas"


def _env(tmp: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env.update(TMPDIR=str(tmp), TRITON_CACHE_DIR=str(tmp / "cache"))
    return env


# Started when collection ends, niced (tests/support/background.py): 30 s of one core.
COMPILE = Job("test_kernels_compile_for_hopper_and_ampere_without_spills",
              lambda _: [sys.executable, str(SCRIPT)] if PTXAS.exists() else None, env=_env)


@pytest.mark.slow
@pytest.mark.skipif(not PTXAS.exists(), reason="this Triton build has no NVIDIA backend")
def test_kernels_compile_for_hopper_and_ampere_without_spills():
    proc = COMPILE.result()
    assert proc is not None and proc.returncode == 0, proc and proc.stderr[-4000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines()]
    compiled = {(r["kernel"], r["arch"], r["constexprs"].get("HEAD_DIM"),
                 r["case"]["dtype"]) for r in rows}
    for arch in (90, 80):
        for dtype in ("torch.float32", "torch.float16", "torch.bfloat16"):
            for head_dim in map(str, SUPPORTED_HEAD_SIZES):
                for kernel in ("_paged_attention_kernel", "_write_kv_cache_kernel"):
                    assert (kernel, arch, head_dim, dtype) in compiled
        assert ("_merge_segments_kernel", arch, "128", "torch.bfloat16") in compiled
        flags = {(r["constexprs"].get("USE_SLIDING_WINDOW"), r["constexprs"].get("USE_SOFTCAP"))
                 for r in rows if r["kernel"] == "_paged_attention_kernel" and r["arch"] == arch}
        assert {("True", "False"), ("False", "True"), ("True", "True")} <= flags, flags
        kernels = {(r["kernel"], r["arch"], r["case"]["dtype"]) for r in rows}
        for kernel in ("_rms_norm_kernel", "_silu_and_mul_kernel", "_rotary_kernel"):
            for dtype in ("torch.float32", "torch.bfloat16"):
                assert (kernel, arch, dtype) in kernels
    # An e4m3 KV cache (kv_cache_dtype="fp8"), on Hopper: both kernels, split-KV too.
    fp8 = {(r["kernel"], r["constexprs"].get("HEAD_DIM"), r["constexprs"].get("NUM_SEGMENTS"))
           for r in rows if r["case"].get("kv_dtype") == "torch.float8_e4m3fn"
           and r["arch"] == 90}
    assert {("_paged_attention_kernel", "128", "1"), ("_paged_attention_kernel", "128", "8"),
            ("_write_kv_cache_kernel", "64", None)} <= fp8, fp8
    # Fused MoE (Qwen3-30B-A3B's and Mixtral's shapes): both GEMMs at every row-tile
    # size `moe_tiles` picks, in both 16-bit dtypes (32 rows: bf16) and fp32 at its
    # largest; the align kernels for both id dtypes. Identical specializations compile
    # once (the align kernels do not depend on x's dtype), so some cases add no rows.
    moe_rows = [r for r in rows if r["kernel"].startswith("_moe")]
    moe = {(r["kernel"], r["arch"], r["case"]["dtype"], r["constexprs"].get("BLOCK_M"))
           for r in moe_rows}
    moe_models = {(r["kernel"], r["arch"], r["case"]["model"]) for r in moe_rows}
    for arch in (90, 80):
        for kernel in ("_moe_gate_up_kernel", "_moe_down_kernel"):
            for dtype in ("torch.float16", "torch.bfloat16"):
                for block_m in ("16", "64"):
                    assert (kernel, arch, dtype, block_m) in moe
            assert (kernel, arch, "torch.bfloat16", "32") in moe
            assert (kernel, arch, "torch.float32", "32") in moe
        for model in ("qwen3-30b-a3b", "mixtral-8x7b"):
            assert ("_moe_gate_up_kernel", arch, model) in moe_models
            assert ("_moe_align_count_kernel", arch, model) in moe_models
        ids = {r["case"].get("ids") for r in rows
               if r["kernel"] == "_moe_align_count_kernel" and r["arch"] == arch}
        assert ids == {None, "torch.int64"}, ids  # None: int32, the default
    # Packed experts: both GEMMs with int4 and int8 codes, bf16 at both row tiles of
    # Qwen3-30B-A3B's decode and 256 tokens (16), fp16 once.
    packed = {(r["kernel"], r["arch"], r["case"]["dtype"], r["constexprs"].get("BITS"))
              for r in moe_rows}
    for arch in (90, 80):
        for kernel in ("_moe_gate_up_kernel", "_moe_down_kernel"):
            for dtype, bits in (("torch.bfloat16", "4"), ("torch.bfloat16", "8"),
                                ("torch.float16", "4"), ("torch.bfloat16", "0")):
                assert (kernel, arch, dtype, bits) in packed, (kernel, arch, dtype, bits)
    # Spilled registers go to the stack frame (ptxas -v: "8 bytes stack frame, 8 bytes
    # spill stores"), which the LOCAL figure below leaves out: the MoE kernels have none.
    assert not [r for r in moe_rows if r["stack"] > 0], [r for r in moe_rows if r["stack"]]
    # The rotary embedding rounds each product before the sum, as torch does; a fused
    # multiply-add skips that rounding (kernels/triton_fused.py). Ampere has no bf16
    # multiply or add: there each is an fma with -0 or 1 (exact), so it is left out.
    rotary = [r for r in rows if r["kernel"] == "_rotary_kernel"
              and (r["arch"] == 90 or r["case"]["dtype"] != "torch.bfloat16")]
    assert len(rotary) == 20 and all(r["fma"] == 0 for r in rotary), rotary
    # LoRA shrink/expand (Llama-3-8B's qkv and down): fp32 and bf16 at every row tile
    # (16, 32, 64), fp16 at decode, expand summing every split (1, 4 and 8 ways).
    lora = {(r["kernel"], r["arch"], r["case"]["dtype"], r["constexprs"]["BLOCK_M"])
            for r in rows if r["kernel"].startswith("_lora")}
    splits = {(r["arch"], r["constexprs"]["SPLIT_K"]) for r in rows
              if r["kernel"] == "_lora_expand_kernel"}
    for arch in (90, 80):
        for kernel in ("_lora_shrink_kernel", "_lora_expand_kernel"):
            for dtype in ("torch.float32", "torch.bfloat16"):
                for block_m in ("16", "32", "64"):
                    assert (kernel, arch, dtype, block_m) in lora
            assert (kernel, arch, "torch.float16", "16") in lora
        assert {(arch, "1"), (arch, "4"), (arch, "8")} <= splits, splits
    # Weight-only int4 (both 16-bit dtypes, a decode row and a 256-row chunk) and int8.
    quant_rows = {(r["arch"], r["case"]["dtype"], r["constexprs"]["BITS"],
                   r["constexprs"]["BLOCK_M"])
                  for r in rows if r["kernel"] == "_quant_matmul_kernel"}
    for arch in (90, 80):
        for dtype in ("torch.float16", "torch.bfloat16"):
            for block_m in ("16", "64"):
                assert (arch, dtype, "4", block_m) in quant_rows
        assert (arch, "torch.bfloat16", "8", "16") in quant_rows
    spilled = [r for r in rows if r["local"] > 0]
    assert not spilled, spilled
    # Dynamic shared memory per program: an A100 gives a block up to 163 KiB, an H100
    # 227, Ampere's and Ada's smaller parts (sm_86, sm_89) 99. The largest tile is the
    # split-KV one (128 keys of a 16-bit head of 128: 73 KiB), measured faster there.
    assert max(r["shared"] for r in rows) < 99 * 1024
