"""The fused CPU decode step (executor/worker/cpu_decode.py, kernels/csrc/cpu_decode.cpp)
against the decoder's torch path on the same weights and KV cache: the hidden states it
returns and the keys and values it writes, for each kind of model it serves, dense and
integer, fp32 and bf16, native and portable builds."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from pagellm.executor.model import linear as cpu_linear
from pagellm.executor.model.attention import AttentionMetadata, TorchAttention
from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.executor.model.loader import quantize_on_load
from pagellm.executor.model.registry import model_class
from pagellm.executor.model.rope import RopeSpec
from pagellm.executor.model.spec import DecoderSpec, MoeSpec
from pagellm.executor.worker.cpu_decode import DENSE_ROWS, CpuDecodeStep, unsupported
from pagellm.kernels import cpu_ops

pytestmark = pytest.mark.own_code

BLOCK = 4

LLAMA = DecoderSpec(vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                    qkv_bias=False, o_bias=False, qk_norm=None, tie_word_embeddings=True,
                    max_position=256, rope=RopeSpec("default", 10000.0))
SPECS = {
    "llama": LLAMA,
    # qkv bias, one KV head for four queries
    "qwen2": dataclasses.replace(LLAMA, qkv_bias=True, num_kv_heads=1),
    # per-head q/k norms, head_dim apart from hidden_size / num_heads
    "qwen3": dataclasses.replace(LLAMA, qk_norm="head", head_dim=32),
    # half of each head rotated (Phi-3's partial_rotary_factor), an o_proj bias
    "partial_rotary": dataclasses.replace(
        LLAMA, o_bias=True, rope=RopeSpec("default", 10000.0, partial_rotary_factor=0.5)),
    # a 5-token window in the first layer, full attention in the second (Mistral, Qwen2)
    "sliding": dataclasses.replace(LLAMA, layer_windows=(5, None)),
}
# Mixtures of experts (8 experts of 32, top 2): Qwen3-MoE's (head norms; weights rounded
# to the model's dtype; its first layer dense, as mlp_only_layers makes it), Mixtral's
# (weights in fp32, every layer sparse) and Qwen2-MoE's.
MOE = MoeSpec(num_experts=8, top_k=2, intermediate_size=32, renormalize=True,
              sparse_layers=(False, True))
MOE_SPECS = {
    "qwen3_moe": dataclasses.replace(LLAMA, qk_norm="head", moe=MOE),
    "mixtral": dataclasses.replace(LLAMA, moe=dataclasses.replace(
        MOE, sparse_layers=(True, True), weights_in_model_dtype=False)),
    # Qwen2-MoE's: q/k/v biases, top 2 not renormalised, a shared expert of 32 columns
    # gated by sigmoid(shared_expert_gate(x))
    "qwen2_moe": dataclasses.replace(LLAMA, qkv_bias=True, moe=dataclasses.replace(
        MOE, renormalize=False, shared_expert_size=32)),
}
# gpt-oss's: attention sinks, q/k/v/o biases, a 5-token window in the first layer, a
# router with a bias (softmax over its top 2 logits), experts with biases and a SwiGLU
# clamped at 1.5 (the gate projections' values spread past it)
GPT_OSS = dataclasses.replace(
    LLAMA, architecture="GptOssForCausalLM", attn_sinks=True, qkv_bias=True, o_bias=True,
    layer_windows=(5, None), moe=dataclasses.replace(
        MOE, sparse_layers=(True, True), swiglu=(1.702, 1.5), checkpoint_stacked=True))


def _model(spec: DecoderSpec, quantization: str | None, dtype: torch.dtype = torch.float32,
           bf16_weights: bool = False) -> DecoderForCausalLM:
    """Seeded weights (bf16, or `bf16_weights` in fp32: the same ones rounded), the RoPE
    tables in fp32 whatever the dtype, as the loader leaves them."""
    torch.manual_seed(0)
    model = model_class(spec)(spec, max_model_len=128).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0, 0.2 if p.dim() > 1 else 0.1)
        if bf16_weights:
            for p in model.parameters():
                p.copy_(p.bfloat16().float())
    if quantization is not None:
        model.quantized = quantize_on_load(model, quantization, triton=False)
    if dtype != torch.float32:
        model = model.to(dtype)
        model.model.rotary_emb.reset_cache()
    return model


def _meta(block_tables: torch.Tensor, query_lens: list[int], seq_lens: list[int],
          slots: torch.Tensor, backend: TorchAttention, plan: bool = True
          ) -> AttentionMetadata:
    qsl = np.concatenate(([0], np.cumsum(query_lens)))
    meta = AttentionMetadata(
        slot_mapping=slots, block_tables=block_tables,
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc_cpu=qsl, seq_lens_cpu=np.array(seq_lens),
        max_query_len=max(query_lens), backend=backend)
    if plan:  # (the torch path's; the fused step reads the tensors only)
        backend.prepare(meta)
    return meta


def _slots(block_tables: torch.Tensor, request: int, positions: range) -> list[int]:
    return [int(block_tables[request, p // BLOCK]) * BLOCK + p % BLOCK for p in positions]


@torch.inference_mode()
def _decode_both_ways(spec: DecoderSpec, quantization: str | None, prompt_lens: list[int],
                      portable: bool = False, dtype: torch.dtype = torch.float32,
                      fused: bool = True, bf16_weights: bool = False):
    """Prefill `prompt_lens` through the torch path, then one decode step each way on
    copies of the cache: (fused hidden, torch hidden, fused caches, torch caches); with
    `fused` False the first two are None (the torch path's alone)."""
    model = _model(spec, quantization, dtype, bf16_weights)
    if quantization is None and cpu_linear.packs_weights(dtype, torch.device("cpu")):
        cpu_linear.PACKED_WEIGHTS.pack(model.linear_weights())  # as the loader does
    backend = TorchAttention(BLOCK)
    num_blocks = 128
    caches = [torch.zeros(2, num_blocks, BLOCK, spec.num_kv_heads, spec.head_dim, dtype=dtype)
              for _ in range(spec.num_layers)]
    # Each request's blocks scattered over the cache, in no order.
    per_request = max(prompt_lens) // BLOCK + 2
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(1))
    block_tables = order[:len(prompt_lens) * per_request].view(len(prompt_lens), -1)
    block_tables = block_tables.to(torch.int32).contiguous()
    ids = torch.randint(0, spec.vocab_size, (sum(prompt_lens),))
    positions = torch.cat([torch.arange(n) for n in prompt_lens])
    slots = torch.tensor([s for r, n in enumerate(prompt_lens)
                          for s in _slots(block_tables, r, range(n))])
    model(ids, positions, _meta(block_tables, prompt_lens, prompt_lens, slots, backend), caches)

    step_ids = torch.randint(0, spec.vocab_size, (len(prompt_lens),))
    step_positions = torch.tensor(prompt_lens)
    step_slots = torch.tensor([_slots(block_tables, r, range(n, n + 1))[0]
                               for r, n in enumerate(prompt_lens)])
    ones = [1] * len(prompt_lens)
    seq_lens = [n + 1 for n in prompt_lens]
    torch_caches = [c.clone() for c in caches]
    expected = model(step_ids, step_positions,
                     _meta(block_tables, ones, seq_lens, step_slots, backend), torch_caches)
    if not fused:
        return None, expected, caches, torch_caches
    step = CpuDecodeStep(model, cpu_ops.load(portable=portable))
    assert step.takes(1)
    got = step(step_ids, step_positions,
               _meta(block_tables, ones, seq_lens, step_slots, backend), caches)
    return got, expected, caches, torch_caches


# Contexts of 2, 10 and 41 keys (the softmax's vector exp runs 16 keys at a time, then
# the rest one by one); 7 requests: more than the GEMV's rows (oneDNN's GEMM, at::linear).
BATCHES = {"gemv": [1, 9, 40], "gemm": [1, 9, 40, 3, 17, 5, 22]}


# Above the GEMV's rows: oneDNN (fp32) or at::linear (bf16) on the plain weights, or
# oneDNN on packed copies (linear.py: fp32 off Intel, bf16 on CPUs with AMX or
# AVX512-BF16), the same way in both paths.
WAYS = {"gemv": ("gemv", False), "gemm": ("gemm", False), "gemm-packed": ("gemm", True)}


@pytest.mark.parametrize("batch", WAYS)
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("name", SPECS)
def test_a_dense_decode_step_equals_the_torch_path(name, portable, batch, monkeypatch):
    """fp32 throughout: equal up to the order of the sums (1e-5)."""
    rows, packed = WAYS[batch]
    if packed and cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, packed_fp32=packed))
    got, expected, caches, torch_caches = _decode_both_ways(SPECS[name], None,
                                                            BATCHES[rows], portable)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    for mine, theirs in zip(caches, torch_caches, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("batch", WAYS)
@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("name", SPECS)
def test_a_bf16_decode_step_rounds_where_the_torch_path_does(name, portable, batch,
                                                            monkeypatch):
    """bf16: the torch path rounds to bf16 after each op; the fused step rounds at the
    same points, so its answer is the torch path's, but for roundings that tip where
    the two sum in another order or take another exp (SDPA's own, in the attention's
    bf16 weights). One layer, so that a tip does not spread: on these seeded weights
    every output agrees bit for bit but with Qwen3's head norms (80%); a rounding
    point left out (SiLU's, the attention weights') leaves 33-60% equal and moves the
    answer toward the exact one (the same bf16 weights and prompts in fp32), as far
    from the torch path as 19-64% of the exact one's distance."""
    rows, packed = WAYS[batch]
    if packed and cpu_linear.REORDER_WEIGHT is None:
        pytest.skip("this torch has no oneDNN packed weights")
    monkeypatch.setattr(cpu_linear, "THIS_CPU",
                        dataclasses.replace(cpu_linear.THIS_CPU, packed_bf16=packed))
    spec = dataclasses.replace(SPECS[name], num_layers=1,
                               layer_windows=SPECS[name].layer_windows[:1])
    got, expected, caches, torch_caches = _decode_both_ways(spec, None, BATCHES[rows],
                                                            portable, torch.bfloat16)
    assert got.dtype == torch.bfloat16
    _, exact, _, _ = _decode_both_ways(spec, None, BATCHES[rows], fused=False,
                                       bf16_weights=True)
    assert (got == expected).double().mean() > 0.65
    ours = (got.double() - expected.double()).abs()
    rounding = (exact.double() - expected.double()).abs()  # what bf16 costs the torch path
    assert ours.mean() < 0.25 * rounding.mean(), (ours.mean(), rounding.mean())
    for mine, theirs in zip(caches, torch_caches, strict=True):  # keys/values written
        assert torch.equal(mine, theirs)


@pytest.mark.parametrize("quantization", ["int8", "int4"])
@pytest.mark.parametrize("batch", [2, DENSE_ROWS + 3])
def test_an_integer_decode_step_equals_the_torch_path(quantization, batch):
    """Through the same int kernel both ways, for batches above the dense GEMV's rows
    too. The kernel quantizes its input to int8 per block of 32: where the two paths'
    fp32 inputs differ in the last bit, a rounding could tip by one step of the block's
    scale; on these seeded weights none does, and the outputs agree to ~4e-7 of their
    largest element (bounded at 1e-5)."""
    prompt_lens = [3 + 2 * i for i in range(batch)]
    got, expected, caches, torch_caches = _decode_both_ways(SPECS["qwen2"], quantization,
                                                            prompt_lens)
    scale = expected.abs().max()
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * float(scale))
    for mine, theirs in zip(caches, torch_caches, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * float(theirs.abs().max()))


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("batch", [1, 3, DENSE_ROWS + 3])
@pytest.mark.parametrize("name", MOE_SPECS)
def test_a_mixture_of_experts_decode_step_equals_the_torch_path(name, batch, quantization):
    """The router's top 2 of 8 experts per token, each expert over the tokens that
    chose it (one token: itself; seven: several tokens to most experts), summed in
    expert order: fp32 up to the order of the dense experts' sums, the int kernel's
    experts as the torch path runs them (the bound of the integer test above: on these
    prompts no activation's rounding tips; with prompts one token shorter one of
    Qwen2-MoE's seven tokens tips at int4, 1e-2 apart where the rest are 1e-6)."""
    prompt_lens = [4 + 2 * i for i in range(batch)]
    got, expected, caches, torch_caches = _decode_both_ways(MOE_SPECS[name], quantization,
                                                            prompt_lens)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    for mine, theirs in zip(caches, torch_caches, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * float(theirs.abs().max()))


@pytest.mark.parametrize("batch", [1, DENSE_ROWS + 3])
@pytest.mark.parametrize("name", MOE_SPECS)
def test_a_bf16_mixture_of_experts_rounds_where_the_torch_path_does(name, batch):
    """bf16 experts: rounded as the torch path's bf16 tensors round (the logits, each
    expert's output times its weight, each partial sum). One sparse layer: a rounding
    tipped in a first layer can change a token's experts in the second (Mixtral's, 7
    tokens: one token 0.45 apart, the rest 0.006 at most). 93-100% of the outputs agree
    bit for bit; Mixtral's fp32 weights rounded to bf16 (Qwen3-MoE's rule) leave 77-78%."""
    spec = dataclasses.replace(MOE_SPECS[name], num_layers=1, moe=dataclasses.replace(
        MOE_SPECS[name].moe, sparse_layers=(True,)))
    got, expected, _, _ = _decode_both_ways(spec, None, BATCHES["gemm"][:batch],
                                            dtype=torch.bfloat16)
    _, exact, _, _ = _decode_both_ways(spec, None, BATCHES["gemm"][:batch], fused=False,
                                       bf16_weights=True)
    assert (got == expected).double().mean() > 0.85
    ours = (got.double() - expected.double()).abs()
    rounding = (exact.double() - expected.double()).abs()
    assert ours.mean() < 0.25 * rounding.mean(), (ours.mean(), rounding.mean())


@pytest.mark.parametrize("quantization", [None, "int8", "int4"])
@pytest.mark.parametrize("batch", [1, DENSE_ROWS + 3])
def test_a_gpt_oss_decode_step_equals_the_torch_path(batch, quantization):
    """gpt-oss (fp32): the sinks in the attention's sum, the router's bias and softmax
    over its top k, each expert's biases and clamped SwiGLU, as gpt_oss.py computes
    them; and none of them a no-op (each left out moves the answer)."""
    prompt_lens = [4 + 2 * i for i in range(batch)]
    got, expected, caches, torch_caches = _decode_both_ways(GPT_OSS, quantization,
                                                            prompt_lens)
    scale = float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-5 * scale)
    for mine, theirs in zip(caches, torch_caches, strict=True):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-5 * float(theirs.abs().max()))
    if quantization is not None or batch != 1:
        return
    for change in (dict(attn_sinks=False), dict(moe=dataclasses.replace(
            GPT_OSS.moe, swiglu=(1.702, 100.0)))):
        other, _, _, _ = _decode_both_ways(dataclasses.replace(GPT_OSS, **change), None,
                                           prompt_lens)
        assert not torch.allclose(other, got, rtol=1e-3, atol=1e-3), change


def test_a_window_hides_the_keys_before_it():
    """Mutation check of the window: with it removed the fused step's answer moves
    (the torch path's reference would not catch a window ignored both ways)."""
    spec = SPECS["sliding"]
    got, expected, _, _ = _decode_both_ways(spec, None, [12])
    unwindowed, _, _, _ = _decode_both_ways(dataclasses.replace(spec, layer_windows=()),
                                            None, [12])
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(got, unwindowed, rtol=1e-3, atol=1e-3)


def test_it_takes_every_decode_only_step():
    for quantization in (None, "int4"):
        fused = CpuDecodeStep(_model(LLAMA, quantization), cpu_ops.load())
        assert fused.takes(1)  # any batch: the step's size is not asked
        assert not fused.takes(2)  # a prefill chunk in the step


def test_what_it_does_not_compute_takes_the_torch_path(monkeypatch):
    model = _model(LLAMA, None)
    fp32 = torch.float32
    assert unsupported(model, fp32, fp32, "torch", lora=False) is None
    bf16 = torch.bfloat16
    assert unsupported(model, bf16, fp32, "torch", lora=False) is not None  # cache apart
    assert unsupported(_model(LLAMA, None, bf16), bf16, bf16, "torch", lora=False) is None
    assert unsupported(model, bf16, bf16, "torch", lora=False) is not None  # fp32 weights
    assert unsupported(model, fp32, torch.float8_e4m3fn, "torch", lora=False) is not None
    assert unsupported(model, fp32, fp32, "triton", lora=False) is not None
    assert unsupported(model, fp32, fp32, "torch", lora=True) is not None
    softcapped = _model(dataclasses.replace(LLAMA, attn_softcap=30.0), None)
    assert unsupported(softcapped, fp32, fp32, "torch", lora=False) is not None
    olmoe = dataclasses.replace(MOE_SPECS["mixtral"], qk_norm="full")  # over all heads
    assert unsupported(_model(olmoe, None), fp32, fp32, "torch", lora=False) is not None
    for spec in [*MOE_SPECS.values(), GPT_OSS]:
        assert unsupported(_model(spec, "int4"), fp32, fp32, "torch", lora=False) is None
    gpt_oss = _model(GPT_OSS, None, bf16)  # its norms round its own way in bf16
    assert unsupported(gpt_oss, bf16, bf16, "torch", lora=False) == "gpt-oss in fp32 only"
    monkeypatch.setenv("PAGELLM_CPU_DECODE", "0")
    assert unsupported(model, fp32, fp32, "torch", lora=False) == "PAGELLM_CPU_DECODE=0"


def test_a_bad_slot_or_block_is_refused_by_name():
    """The op checks what it indexes with (a C++ loop would otherwise write anywhere)."""
    model = _model(LLAMA, None)
    fused = CpuDecodeStep(model, cpu_ops.load())
    backend = TorchAttention(BLOCK)
    caches = [torch.zeros(2, 8, BLOCK, 2, 16) for _ in range(2)]
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    ids, positions = torch.tensor([5]), torch.tensor([0])
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        fused(ids, positions, _meta(tables, [1], [1], torch.tensor([8 * BLOCK]), backend),
              caches)
    with pytest.raises(RuntimeError, match="outside the KV cache"):
        fused(ids, positions, _meta(torch.tensor([[9, 1]], dtype=torch.int32), [1], [1],
                                    torch.tensor([0]), backend), caches)
    with pytest.raises(RuntimeError, match="more blocks than"):
        fused(ids, positions, _meta(tables, [1], [3 * BLOCK], torch.tensor([0]), backend,
                                    plan=False), caches)


@torch.inference_mode()
def test_the_tensors_are_kept_until_forget():
    """A parameter replaced outright (an extension's collective_rpc may) is seen after
    `forget`, which the worker calls after every such call (ModelRunner.weights_changed);
    before it the kept lists still hold the old one."""
    model = _model(LLAMA, None)
    fused = CpuDecodeStep(model, cpu_ops.load())
    backend = TorchAttention(BLOCK)
    tables = torch.tensor([[0, 1]], dtype=torch.int32)
    ids, positions = torch.tensor([5]), torch.tensor([0])
    meta = _meta(tables, [1], [1], torch.tensor([0]), backend)

    def run() -> torch.Tensor:
        return fused(ids, positions, meta, [torch.zeros(2, 8, BLOCK, 2, 16) for _ in range(2)])

    before = run()
    down = model.model.layers[1].mlp.down_proj
    down.weight = torch.nn.Parameter(torch.zeros_like(down.weight), requires_grad=False)
    torch.testing.assert_close(run(), before, rtol=0, atol=0)
    fused.forget()
    expected = model(ids, positions, meta, [torch.zeros(2, 8, BLOCK, 2, 16) for _ in range(2)])
    torch.testing.assert_close(run(), expected, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(expected, before, atol=1e-3)


@torch.inference_mode()
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_an_in_place_write_to_a_norm_or_bias_is_seen_at_once(dtype):
    """A trainer's in-process `load_weights` writes parameters in place and nobody calls
    `forget`: the step reads norms and biases where the model keeps them (in bf16 too,
    not fp32 copies of them that would go stale)."""
    model = _model(SPECS["qwen2"], None, dtype)
    fused = CpuDecodeStep(model, cpu_ops.load())
    backend = TorchAttention(BLOCK)
    meta = _meta(torch.tensor([[0, 1]], dtype=torch.int32), [1], [1], torch.tensor([0]),
                 backend)
    ids, positions = torch.tensor([5]), torch.tensor([0])

    def caches() -> list[torch.Tensor]:
        return [torch.zeros(2, 8, BLOCK, 1, 16, dtype=dtype) for _ in range(2)]

    before = fused(ids, positions, meta, caches())
    layer = model.model.layers[1]
    layer.post_attention_layernorm.weight.mul_(-1.5)
    layer.self_attn.qkv_proj.bias.add_(0.5)
    model.model.norm.weight.mul_(0.5)
    got = fused(ids, positions, meta, caches())
    expected = model(ids, positions, meta, caches())
    assert not torch.allclose(got.float(), before.float(), atol=0.1)
    tolerance = 1e-5 if dtype == torch.float32 else 2**-7 * float(expected.abs().max())
    torch.testing.assert_close(got, expected, rtol=0, atol=tolerance)


@pytest.mark.parametrize("portable", [False, True], ids=["native", "portable"])
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 6])
@pytest.mark.parametrize("shape", [(576, 64 * 9), (37, 50), (5, 16), (130, 200)])
def test_the_dense_gemv_equals_a_matmul(shape, rows, portable):
    """The dense projections' GEMV against x @ w^T: the one-row path (widths that are
    multiples of 64), the four-rows-of-w path with its column tail (50, 200) and row
    tail (37, 5, 130 output features), and at::linear above 4 rows."""
    out_features, in_features = shape
    x, w = torch.randn(rows, in_features), torch.randn(out_features, in_features)
    got = cpu_ops.load(portable=portable).dense_linear(x, w)
    torch.testing.assert_close(got, (x.double() @ w.double().t()).float(), rtol=1e-5,
                               atol=1e-5 * in_features ** 0.5)
