"""On a CUDA machine (`pytest -m gpu`): the Triton path on the GPU against
transformers. Skipped cleanly without a GPU."""

from __future__ import annotations

import pytest
import torch
from conftest import PROMPTS

from frontend import SamplingParams

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_fp32_greedy_on_the_gpu_matches_transformers(name, model_dirs, hf_reference,
                                                     make_llm):
    llm = make_llm(model_dirs[name], device="cuda", dtype="float32",
                   attention_backend="triton", kv_cache_memory_bytes=64 * 2**20)
    outputs = llm.generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=32),
                           use_tqdm=False)
    for prompt, output in zip(PROMPTS, outputs, strict=True):
        expected = hf_reference(name, llm.tokenizer.encode(prompt), 32)
        assert output.outputs[0].token_ids == expected, prompt
