"""Compile the Triton kernels for NVIDIA GPUs on a machine without one.

Triton compiles ahead of time for a named target with its bundled ptxas, so a CPU
machine can prove that every specialization the launchers ask for builds for Hopper
(sm_90) and Ampere (sm_80) — the interpreter accepts things real compilation rejects,
such as a `tl.dot` smaller than 16x16 — and read each kernel's register, spill and
shared-memory use from the cubin.

The launchers run for real on meta tensors with their kernels swapped for recorders, so
the constexprs and arguments compiled are exactly the ones a launch would use.

    python tests/support/compile_kernels.py     # JSON lines: one per specialization

Run without TRITON_INTERPRET (the test that calls it starts a clean process).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

from pagellm.kernels import triton_attention as ta
from pagellm.kernels import triton_fused as tf
from pagellm.kernels import triton_lora as tlo
from pagellm.kernels import triton_moe as tm
from pagellm.kernels import triton_quant as tqu
from pagellm.kernels.quant import PackedWeight

_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
          torch.int32: "i32", torch.int64: "i64", torch.float8_e4m3fn: "fp8e4nv"}
TARGETS = (GPUTarget("cuda", 90, 32), GPUTarget("cuda", 80, 32))
LAUNCH_OPTIONS = ("num_warps", "num_stages", "enable_fp_fusion")


class _Recorder:
    """Stands in for a JIT kernel: `kernel[grid](*args, **constexprs)` records the call."""

    def __init__(self, kernel: Any) -> None:
        self.kernel = kernel
        self.calls: list[tuple[tuple[Any, ...], dict[str, Any]]] = []

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.calls.append((args, kwargs))
        return launch


def _source(kernel: Any, args: tuple[Any, ...], constexprs: dict[str, Any]) -> ASTSource:
    """The ASTSource a launch with these arguments compiles: pointer types from the
    tensors' dtypes, 16-divisibility where a real launch would detect it (every
    tensor allocation is 16-byte aligned; integers the kernel does not specialize on,
    `do_not_specialize`, never)."""
    names = kernel.arg_names
    signature: dict[str, str] = {}
    attrs: dict[tuple[int, ...], list[list[Any]]] = {}
    for i, (name, value) in enumerate(zip(names, args, strict=False)):
        if isinstance(value, torch.Tensor):
            signature[name] = "*" + _TYPES[value.dtype]
            attrs[(i,)] = [["tt.divisibility", 16]]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if abs(value) < 2**31 else "i64"
            if value % 16 == 0 and not kernel.params[i].do_not_specialize:
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:
            signature[name] = "fp32"
    for name in constexprs:
        signature[name] = "constexpr"
    return ASTSource(fn=kernel, signature=signature,
                     constexprs={(names.index(k),): v for k, v in constexprs.items()},
                     attrs=attrs)


def _resource_usage(cubin: bytes, tmp: Path) -> dict[str, int]:
    path = tmp / "kernel.cubin"
    path.write_bytes(cubin)
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    text = subprocess.run([str(cuobjdump), "--dump-resource-usage", str(path)],
                          capture_output=True, text=True, check=True).stdout
    usage = dict(re.findall(r"(REG|STACK|SHARED|LOCAL):(\d+)", text))
    return {k.lower(): int(v) for k, v in usage.items()}


def _cases() -> list[tuple[str, dict[str, Any]]]:
    """(launcher, arguments) pairs covering what the engine launches: every head size
    and dtype, both block sizes, GQA groups 1/2/4/7/8, split-KV."""
    cases: list[tuple[str, dict[str, Any]]] = []
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for head_dim in ta.SUPPORTED_HEAD_SIZES:
            cases.append(("attention", dict(dtype=dtype, head_dim=head_dim, group=4,
                                            block_size=16, segments=1)))
            cases.append(("write", dict(dtype=dtype, head_dim=head_dim, block_size=16)))
    for group in (1, 2, 7, 8):
        cases.append(("attention", dict(dtype=torch.bfloat16, head_dim=128, group=group,
                                        block_size=32, segments=1)))
    for dtype in (torch.float32, torch.bfloat16):
        for head_dim in (64, 128):
            cases.append(("attention", dict(dtype=dtype, head_dim=head_dim, group=7,
                                            block_size=16, segments=8)))
    # Sliding windows and Gemma 2's soft-capping (USE_SLIDING_WINDOW / USE_SOFTCAP):
    # Gemma's head of 256, and split-KV with both.
    for window, softcap in ((4096, None), (None, 50.0), (4096, 50.0)):
        cases.append(("attention", dict(dtype=torch.bfloat16, head_dim=256, group=2,
                                        block_size=16, segments=1, sliding_window=window,
                                        softcap=softcap)))
    cases.append(("attention", dict(dtype=torch.float32, head_dim=256, group=2, block_size=16,
                                    segments=1, sliding_window=4096, softcap=50.0)))
    cases.append(("attention", dict(dtype=torch.bfloat16, head_dim=128, group=7,
                                    block_size=16, segments=8, sliding_window=4096,
                                    softcap=50.0)))
    # gpt-oss's attention sinks (USE_SINKS) on its alternating 128-key windows, head 64,
    # 8 query heads per KV head; split-KV merges them too.
    for window, segments in ((128, 1), (None, 1), (None, 8)):
        cases.append(("attention", dict(dtype=torch.bfloat16, head_dim=64, group=8,
                                        block_size=16, segments=segments,
                                        sliding_window=window, sinks=True)))
    # kv_cache_dtype="fp8": an e4m3 cache read by bf16 queries, written from bf16 keys
    # (Ada and Hopper only: sm_80 has no e4m3 conversion; the engine refuses it there).
    for head_dim in (64, 128):
        cases.append(("attention", dict(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                                        head_dim=head_dim, group=4, block_size=16,
                                        segments=1)))
        cases.append(("write", dict(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                                    head_dim=head_dim, block_size=16)))
    cases.append(("attention", dict(dtype=torch.bfloat16, kv_dtype=torch.float8_e4m3fn,
                                    head_dim=128, group=7, block_size=16, segments=8)))
    # The fused decoder kernels: Qwen2.5-1.5B's sizes and the largest hidden size met
    # (8192, Llama 70B), head sizes with and without a power-of-two half.
    for dtype in (torch.float32, torch.float16, torch.bfloat16):
        for hidden in (1536, 8192):
            for residual in (False, True):
                cases.append(("rms_norm", dict(dtype=dtype, hidden=hidden, residual=residual)))
        cases.append(("silu_and_mul", dict(dtype=dtype, width=8960)))
        for head_dim in (64, 80, 128, 256):
            cases.append(("rotary", dict(dtype=dtype, heads=14, head_dim=head_dim)))
    # Fused MoE: Qwen3-30B-A3B (128 experts of I = 768, top-8) and Mixtral 8x7B (8 of
    # I = 14336, top-2) at a decode and a batch of 256 tokens; with them every row-tile
    # size of `moe_tiles` (16 rows for both decodes and Qwen3's 256, 64 for Mixtral's
    # 256; 32 for Qwen3 at 512 tokens, bf16 only), fp32's largest tile (32 rows), and
    # int64 expert ids once (the align kernels' other specialization).
    for dtype in (torch.float16, torch.bfloat16):
        for model in (QWEN3_MOE, MIXTRAL_MOE):
            for tokens in (1, 256):
                cases.append(("moe", dict(model, dtype=dtype, tokens=tokens)))
    cases.append(("moe", dict(QWEN3_MOE, dtype=torch.bfloat16, tokens=512)))
    cases.append(("moe", dict(MIXTRAL_MOE, dtype=torch.float32, tokens=256)))
    cases.append(("moe", dict(QWEN3_MOE, dtype=torch.bfloat16, tokens=7, ids=torch.int64)))
    # Packed experts (int4 / int8 codes dequantized in both GEMMs): Qwen3-30B-A3B in bf16
    # at a decode and 256 tokens, int4 in groups of 128; int8 and fp16 at a decode.
    for tokens in (1, 256):
        cases.append(("moe", dict(QWEN3_MOE, dtype=torch.bfloat16, tokens=tokens, bits=4,
                                  group_size=128)))
    cases.append(("moe", dict(QWEN3_MOE, dtype=torch.bfloat16, tokens=1, bits=8,
                              group_size=128)))
    cases.append(("moe", dict(QWEN3_MOE, dtype=torch.float16, tokens=1, bits=4,
                              group_size=32)))
    # gpt-oss-20b's experts (32 of I = 2880, top-4): biases and the clamped SwiGLU, in
    # bf16 at a decode and 256 tokens, and int4-packed at a decode.
    for tokens in (1, 256):
        cases.append(("moe", dict(GPT_OSS_MOE, dtype=torch.bfloat16, tokens=tokens,
                                  gpt_oss=True)))
    cases.append(("moe", dict(GPT_OSS_MOE, dtype=torch.bfloat16, tokens=1, gpt_oss=True,
                              bits=4, group_size=32)))
    # LoRA shrink/expand at rank 16 on Llama-3-8B's fused qkv (4096 -> 6144, three
    # parts): decode (1 row, K split 4 ways), 64 rows (the last split size, 32-row
    # tiles) and a 512-row prompt chunk (64-row tiles, no split); its down projection
    # (14336 -> 4096) at decode (split 8 ways); fp16 at decode, rank 64 once.
    for dtype in (torch.float32, torch.bfloat16):
        for tokens in (1, 64, 512):
            cases.append(("lora", dict(LLAMA3_QKV, dtype=dtype, tokens=tokens, max_rank=16)))
        cases.append(("lora", dict(LLAMA3_DOWN, dtype=dtype, tokens=1, max_rank=16)))
    cases.append(("lora", dict(LLAMA3_QKV, dtype=torch.float16, tokens=1, max_rank=16)))
    cases.append(("lora", dict(LLAMA3_QKV, dtype=torch.bfloat16, tokens=8, max_rank=64)))
    # Weight-only int4/int8 GEMM on Qwen2.5-1.5B's down projection (8960 -> 1536): a
    # decode row (K split) and a 256-row chunk (64-row tiles), both dtypes, int8 once,
    # fp32 with 64-wide groups once.
    for dtype in (torch.float16, torch.bfloat16):
        for tokens in (1, 256):
            cases.append(("quant", dict(QWEN_DOWN, dtype=dtype, tokens=tokens, bits=4,
                                        group_size=128)))
    cases.append(("quant", dict(QWEN_DOWN, dtype=torch.bfloat16, tokens=1, bits=8,
                                group_size=128)))
    cases.append(("quant", dict(QWEN_DOWN, dtype=torch.float32, tokens=1, bits=4,
                                group_size=64)))
    return cases


QWEN_DOWN = dict(model="qwen2.5-1.5b-down", in_features=8960, out_features=1536)


LLAMA3_QKV = dict(model="llama3-8b-qkv", in_features=4096, out_features=6144, parts=3)
LLAMA3_DOWN = dict(model="llama3-8b-down", in_features=14336, out_features=4096, parts=1)


QWEN3_MOE = dict(model="qwen3-30b-a3b", hidden=2048, inter=768, experts=128, top_k=8)
MIXTRAL_MOE = dict(model="mixtral-8x7b", hidden=4096, inter=14336, experts=8, top_k=2)
GPT_OSS_MOE = dict(model="gpt-oss-20b", hidden=2880, inter=2880, experts=32, top_k=4)


def _packed(p: dict[str, Any], n: int, k: int) -> PackedWeight:
    """An empty packed weight [n, k] on meta: p's bits, group size and dtype."""
    meta, groups = torch.device("meta"), k // p["group_size"]
    return PackedWeight(torch.empty(k // (32 // p["bits"]), n, dtype=torch.int32, device=meta),
                        torch.empty(groups, n, dtype=p["dtype"], device=meta),
                        torch.empty(groups, n, dtype=p["dtype"], device=meta), p["bits"],
                        p["group_size"])


def _launch(kind: str, p: dict[str, Any]) -> None:
    meta = torch.device("meta")
    if kind == "rms_norm":
        x = torch.empty(7, p["hidden"], dtype=p["dtype"], device=meta)
        tf.rms_norm(x, torch.empty(p["hidden"], dtype=p["dtype"], device=meta), 1e-6,
                    torch.empty_like(x) if p["residual"] else None)
        return
    if kind == "silu_and_mul":
        tf.silu_and_mul(torch.empty(7, 2 * p["width"], dtype=p["dtype"], device=meta))
        return
    if kind == "moe":
        x = torch.empty(p["tokens"], p["hidden"], dtype=p["dtype"], device=meta)
        w13: Any = torch.empty(p["experts"], 2 * p["inter"], p["hidden"], dtype=p["dtype"],
                               device=meta)
        w2: Any = torch.empty(p["experts"], p["hidden"], p["inter"], dtype=p["dtype"],
                              device=meta)
        if "bits" in p:  # all experts' rows as one packed weight [E * N, K]
            w13, w2 = (_packed(p, p["experts"] * n, k) for n, k in (
                (2 * p["inter"], p["hidden"]), (p["hidden"], p["inter"])))
        routing = torch.empty(p["tokens"], p["top_k"], device=meta)
        biases: dict[str, Any] = {} if not p.get("gpt_oss") else dict(
            bias13=torch.empty(p["experts"], 2 * p["inter"], dtype=p["dtype"], device=meta),
            bias2=torch.empty(p["experts"], p["hidden"], dtype=p["dtype"], device=meta),
            swiglu=(1.702, 7.0))
        tm.fused_moe(x, w13, w2, routing,
                     torch.empty_like(routing, dtype=p.get("ids", torch.int32)), **biases)
        return
    if kind == "lora":
        slots, width = 4, p["parts"] * p["max_rank"]
        x = torch.empty(p["tokens"], p["in_features"], dtype=p["dtype"], device=meta)
        y = torch.empty(p["tokens"], p["out_features"], dtype=p["dtype"], device=meta)
        tlo.lora_add(x, y, torch.empty(slots, width, p["in_features"], dtype=p["dtype"],
                                       device=meta),
                     torch.empty(slots, p["out_features"], width, dtype=p["dtype"], device=meta),
                     torch.empty(slots, dtype=torch.int32, device=meta),
                     torch.empty(slots, 3, dtype=torch.int32, device=meta))
        return
    if kind == "quant":
        k = p["in_features"]
        tqu.quant_matmul(torch.empty(p["tokens"], k, dtype=p["dtype"], device=meta),
                         _packed(p, p["out_features"], k))
        return
    if kind == "rotary":
        x = torch.empty(7, p["heads"] + 4, p["head_dim"], dtype=p["dtype"], device=meta)
        cos = torch.empty(7, 1, p["head_dim"], dtype=p["dtype"], device=meta)
        tf.rotary(x[:, :p["heads"]], cos, cos)
        return
    kv_heads, num_reqs, num_blocks = 2, 3, 8
    heads = kv_heads * p.get("group", 1)
    kv_cache = torch.empty(2, num_blocks, p["block_size"], kv_heads, p["head_dim"],
                           dtype=p.get("kv_dtype", p["dtype"]), device=meta)
    if kind == "write":
        key = torch.empty(5, kv_heads, p["head_dim"], dtype=p["dtype"], device=meta)
        ta.write_kv_cache(key, key, kv_cache, torch.empty(5, dtype=torch.int64, device=meta))
        return
    tokens = num_reqs if p["segments"] > 1 else 7
    query = torch.empty(tokens, heads, p["head_dim"], dtype=p["dtype"], device=meta)
    ta.paged_attention(query, kv_cache, torch.empty(num_reqs, 4, dtype=torch.int32, device=meta),
                       torch.empty(num_reqs + 1, dtype=torch.int32, device=meta),
                       torch.empty(num_reqs, dtype=torch.int32, device=meta), 0.125,
                       max_query_len=1 if p["segments"] > 1 else 5, num_segments=p["segments"],
                       sliding_window=p.get("sliding_window"), softcap=p.get("softcap"),
                       sinks=torch.empty(heads, dtype=torch.float32, device=meta)
                       if p.get("sinks") else None)


def main() -> None:
    assert os.environ.get("TRITON_INTERPRET") != "1", "compile without the interpreter"
    recorders = {(module, name): _Recorder(getattr(module, name)) for module, name in (
        (ta, "_write_kv_cache_kernel"), (ta, "_paged_attention_kernel"),
        (ta, "_merge_segments_kernel"), (tf, "_rms_norm_kernel"),
        (tf, "_silu_and_mul_kernel"), (tf, "_rotary_kernel"),
        (tm, "_moe_align_count_kernel"), (tm, "_moe_align_place_kernel"),
        (tm, "_moe_gate_up_kernel"), (tm, "_moe_down_kernel"),
        (tlo, "_lora_shrink_kernel"), (tlo, "_lora_expand_kernel"),
        (tqu, "_quant_matmul_kernel"))}
    for (module, name), recorder in recorders.items():
        setattr(module, name, recorder)
    tmp = Path(os.environ.get("TMPDIR", "/tmp")) / f"compile_kernels_{os.getpid()}"
    tmp.mkdir(parents=True, exist_ok=True)
    seen: set[str] = set()
    for kind, params in _cases():
        _launch(kind, params)
        for recorder in recorders.values():
            for args, kwargs in recorder.calls:
                # Launch options (num_warps) go to the compiler, not to the signature.
                options = {k: v for k, v in kwargs.items() if k in LAUNCH_OPTIONS}
                constexprs = {k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS}
                src = _source(recorder.kernel, args, constexprs)
                if src.hash() in seen:
                    continue
                seen.add(src.hash())
                for target in TARGETS:
                    if "kv_dtype" in params and target.arch < 89:
                        continue  # e4m3: Ada and Hopper only
                    compiled = triton.compile(src, target=target, options=options)
                    print(json.dumps({
                        "kernel": recorder.kernel.__name__, "arch": target.arch,
                        "case": {k: str(v) for k, v in params.items()},
                        "constexprs": {k: str(v) for k, v in constexprs.items()},
                        "num_warps": compiled.metadata.num_warps,
                        **_resource_usage(compiled.asm["cubin"], tmp),
                        # What a launch asks for: Triton's tiles are dynamic shared
                        # memory, which the cubin's static SHARED figure leaves out.
                        "shared": compiled.metadata.shared,
                        # Fused multiply-adds: the rotary kernel must have none.
                        "fma": len(re.findall(r"\bfma\.", compiled.asm["ptx"]))}),
                          flush=True)
            recorder.calls.clear()


if __name__ == "__main__":
    main()
