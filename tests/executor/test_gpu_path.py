"""The GPU path's logic, proved on the CPU: staging buffers, the CUDA-graph batch
ladder and padding, the profiling run and the KV-cache budget.

CUDA graphs themselves need a GPU (tests/e2e/test_gpu.py); here a stand-in replays the
decode forward pass eagerly on the same persistent buffers, padded to the same sizes,
so everything a graph reads and everything the step does around it is exercised."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from conftest import PROMPTS, runs_triton_kernels
from eager_replay import EagerReplay

from pagellm import SamplingParams
from pagellm.executor.executor import cuda_kv_cache_budget
from pagellm.executor.model.attention import num_kv_segments
from pagellm.executor.worker.cuda_graphs import capture_sizes
from pagellm.executor.worker.step_buffers import StepBuffers
from pagellm.kernels import reference
from pagellm.kernels import triton_attention as tk

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def test_step_buffers_stage_pad_and_keep_their_storage():
    buffers = StepBuffers(torch.device("cpu"), {
        "ids": ((8,), torch.int64), "table": ((4, 6), torch.int32)})
    buffers.begin_step()
    ids = buffers.put("ids", np.array([5, 6, 7]), fill=-1, size=5)
    assert ids.tolist() == [5, 6, 7, -1, -1]
    table = buffers.put("table", np.array([[1, 2], [3, 4]]), fill=0, size=3)
    assert table.shape == (3, 6) and table.stride() == (6, 1)  # full rows: fixed strides
    assert table[:2, :2].tolist() == [[1, 2], [3, 4]] and table[2].tolist() == [0] * 6
    buffers.end_step()
    again = buffers.put("ids", [9])  # the same storage, refilled
    assert again.data_ptr() == ids.data_ptr() and again.tolist() == [9]
    padding = buffers.put("table", np.zeros(0, np.int64), fill=7, size=2)  # no rows at all
    assert padding.tolist() == [[7] * 6] * 2


def test_capture_sizes_ladder():
    assert capture_sizes(1) == [1]
    assert capture_sizes(20) == [1, 2, 4, 8, 16, 20]
    sizes = capture_sizes(256)
    assert sizes[:4] == [1, 2, 4, 8] and sizes[-1] == 256
    assert all(b - a <= 8 for a, b in itertools.pairwise(sizes))


def test_kv_cache_budget_by_hand():
    gib = 2**30
    # 80 GiB card at 0.9: 72 GiB share - 1 GiB held before us - 3 GiB weights
    # - 2 GiB activations - 0.5 GiB outside torch = 65.5 GiB.
    assert cuda_kv_cache_budget(80 * gib, 0.9, gib, 3 * gib, 2 * gib, gib // 2) \
        == int(65.5 * gib)
    assert cuda_kv_cache_budget(10 * gib, 0.5, 4 * gib, 2 * gib, 0, 0) < 0


@runs_triton_kernels
@pytest.mark.parametrize("segments", [1, 4])
def test_padding_rows_attend_to_nothing_and_stay_finite(segments):
    """CUDA-graph padding rows (seq_len 0, slot -1) neither write the cache nor read
    it, and produce zeros, not NaN, with or without split-KV; real rows are unchanged."""
    heads, kv_heads, dim, bs = 4, 2, 16, 16
    gen = torch.Generator().manual_seed(0)
    cache = torch.randn(2, 6, bs, kv_heads, dim, generator=gen).to(DEVICE)
    before = cache.clone()
    q = torch.randn(3, heads, dim, generator=gen).to(DEVICE)
    key = torch.randn(3, kv_heads, dim, generator=gen).to(DEVICE)
    slots = torch.tensor([40, -1, -1], device=DEVICE)
    tk.write_kv_cache(key, key, cache, slots)
    assert torch.equal(cache.view(2, -1, kv_heads, dim)[:, 40], torch.stack([key[0]] * 2))
    cache.view(2, -1, kv_heads, dim)[:, 40] = before.view(2, -1, kv_heads, dim)[:, 40]
    assert torch.equal(cache, before)  # only slot 40 was written
    tables = torch.tensor([[1, 2, 3], [0, 0, 0], [0, 0, 0]], dtype=torch.int32, device=DEVICE)
    qsl = torch.arange(4, dtype=torch.int32, device=DEVICE)
    seq_lens = torch.tensor([41, 0, 0], dtype=torch.int32, device=DEVICE)
    out = tk.paged_attention(q, cache, tables, qsl, seq_lens, dim ** -0.5, max_query_len=1,
                             num_segments=segments)
    expected = reference.paged_attention(q[:1], cache, tables[:1], [0, 1], [41], dim ** -0.5)
    torch.testing.assert_close(out[:1], expected, rtol=1e-5, atol=1e-5)
    assert torch.equal(out[1:], torch.zeros_like(out[1:]))


@runs_triton_kernels
@pytest.mark.slow
def test_padded_decode_steps_match_transformers(model_dirs, hf_reference, make_llm):
    """Decode steps run the graph path padded up the ladder (3 requests run at size 4,
    with split-KV forced on) and still give transformers' greedy tokens; prompts and
    mixed steps run eagerly in between."""
    llm = make_llm(model_dirs["llama"], attention_backend="triton", max_model_len=1024,
                   max_num_seqs=8)
    runner = llm.engine_core.core.executor.runner
    runner.num_sms = 64  # pretend to be a GPU: the graphs' forward uses 4 KV segments
    assert num_kv_segments(4, 2, 1, 1024, runner.num_sms) == 4
    runner.stage_padding(8)  # what the graphs are captured on: 8 padding requests
    assert runner.buffers.host["slot_mapping"][:8].tolist() == [-1] * 8
    caches = [c.clone() for c in runner.kv_caches]
    with torch.inference_mode():
        logits = runner.model.compute_logits(runner._decode_forward(8))  # as captured
    # Bit patterns: the cache is never zeroed, and a NaN left in reused memory would
    # not equal itself.
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8))
               for a, b in zip(caches, runner.kv_caches, strict=True))
    assert torch.isfinite(logits).all()
    graphs = EagerReplay([1, 2, 4, 8], runner._decode_forward)
    runner.graphs = graphs
    prompts = [llm.tokenizer.encode(p) for p in PROMPTS[:3]]
    expected = [hf_reference("llama", p, 6) for p in prompts]
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                           SamplingParams(temperature=0.0, max_tokens=6), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert 4 in graphs.replayed  # three requests decoding together, one padding row
    assert len(graphs.replayed) >= 5


def test_profile_run_leaves_no_trace(model_dirs, hf_reference, make_llm):
    """The profiling step (the largest step the scheduler can make) runs through the
    real step path and leaves the batch, the KV cache and later outputs untouched."""
    llm = make_llm(model_dirs["qwen2"], max_num_batched_tokens=96, max_num_seqs=4)
    runner = llm.engine_core.core.executor.runner
    caches = runner.kv_caches
    peak = runner.profile_run()  # memory is only measured on CUDA
    assert peak > 0 if runner.device.type == "cuda" else peak == 0
    assert runner.kv_caches is caches and not runner.batch.rows
    prompt = llm.tokenizer.encode(PROMPTS[2])
    output = llm.generate({"prompt_token_ids": prompt},
                          SamplingParams(temperature=0.0, max_tokens=8), use_tqdm=False)
    assert output[0].outputs[0].token_ids == hf_reference("qwen2", prompt, 8)


def test_enforce_eager_is_an_engine_option(make_llm, model_dirs):
    from pagellm.protocol.engine_args import EngineArgs

    assert EngineArgs(model="demo", enforce_eager=True).enforce_eager
    assert "--enforce-eager" in EngineArgs(model="demo", enforce_eager=True).to_cli_args()
    with pytest.raises(TypeError, match="enforce_eager must be a bool"):
        EngineArgs(model="demo", enforce_eager="yes")
