"""MiniMax-M2 / M2.1 (`MiniMaxM2ForCausalLM`): GLM-4.5's computation (glm4_moe.py: the
shared decoder's attention, DeepSeek-V3's routed experts) with other data and names.

What differs, as transformers computes it:

- the q and k norms span all heads (the spec's qk_norm "full", as OLMoE's), applied to
  the projections before they split into heads;
- RoPE turns the first `rotary_dim` of each head (64 of 128), halves as Llama's;
- every layer routes each token to the top-k of 256 experts by sigmoid score plus a
  float32 choice bias, weighted by the unbiased scores renormalised: V3's rule with one
  group, no scaling and no shared expert (registry.py `_minimax_m2`);
- the checkpoint spells the block Mixtral's way: `block_sparse_moe.gate.weight`,
  `block_sparse_moe.experts.{e}.w1/w3/w2`, and the bias
  `block_sparse_moe.e_score_correction_bias` (transformers' in-memory name is
  `mlp.e_score_correction_bias`): weight_map.py reads both into the router's bias;
- layers past num_hidden_layers (multi-token-prediction modules, where a checkpoint has
  them) are not loaded, as DeepSeek-V3's (`DeepseekForCausalLM`).
"""

from __future__ import annotations

from pagellm.executor.model.glm4_moe import Glm4MoeForCausalLM


class MiniMaxM2ForCausalLM(Glm4MoeForCausalLM):
    """GLM-4.5's model class with MiniMax-M2's spec (module docstring)."""
