"""OLMo's RMSNorms round as transformers' Olmo2RMSNorm does (scale in fp32, then round),
the post-block norms and the all-heads q/k norm alike: bitwise in bf16, where Llama's
order (round, then scale) differs. The reference is transformers' own module."""

from __future__ import annotations

import torch

from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.olmo2 import OlmoRMSNorm, OlmoShardedRMSNorm
from pagellm.executor.model.parallel import TensorParallel


def test_olmo_norms_round_as_transformers():
    from transformers.models.olmo2.modeling_olmo2 import Olmo2RMSNorm

    generator = torch.Generator().manual_seed(0)
    size = 96
    weight = 1.0 + 0.3 * torch.randn(size, generator=generator)
    x = (3.0 * torch.randn(64, size, generator=generator)).to(torch.bfloat16)
    reference = Olmo2RMSNorm(size, eps=1e-6).to(torch.bfloat16)
    ours = OlmoRMSNorm(size, 1e-6).to(torch.bfloat16)
    one_rank = TensorParallel(0, 1, 1, 1, 0, size, 0, 0, 1024)
    sharded = OlmoShardedRMSNorm(size, size, 1e-6, one_rank, 1).to(torch.bfloat16)
    llama = RMSNorm(size, 1e-6).to(torch.bfloat16)
    with torch.no_grad():
        for norm in (reference, ours, sharded, llama):
            norm.weight.copy_(weight)
        expected = reference(x)
        assert torch.equal(ours(x)[0], expected)
        assert torch.equal(ours.reference(x)[0], expected)
        assert torch.equal(sharded(x), expected)
        assert not torch.equal(llama.reference(x)[0], expected)  # the order matters here


def test_every_norm_of_an_olmo_model_is_olmos():
    """The model's q/k norms (all heads), post-block norms and final norm are the
    modules checked above."""
    from transformers import AutoConfig

    from pagellm.executor.model.olmo2 import Olmo2ForCausalLM
    from pagellm.executor.model.registry import model_class, read_spec

    config = AutoConfig.for_model("olmo2", hidden_size=64, num_hidden_layers=2,
                                  num_attention_heads=4, num_key_value_heads=2,
                                  intermediate_size=96, vocab_size=1024)
    spec = read_spec(config)
    assert model_class(spec) is Olmo2ForCausalLM and spec.qk_norm == "full"
    model = Olmo2ForCausalLM(spec)
    norms = {name: type(module) for name, module in model.named_modules()
             if name.endswith(("norm", "layernorm"))}
    assert len(norms) == 2 * 4 + 1 and norms["model.norm"] is OlmoRMSNorm
    for name, kind in norms.items():
        expected = OlmoShardedRMSNorm if name.endswith(("q_norm", "k_norm")) else OlmoRMSNorm
        assert kind is expected, name
