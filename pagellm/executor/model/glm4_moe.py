"""GLM-4.5 / GLM-4.5-Air / GLM-4.6 (Zhipu's Glm4MoeForCausalLM): the shared decoder's
grouped-query attention (q/k/v biases, per-head q/k norms where use_qk_norm, RoPE on
the first half of each head: the spec's partial rotary) with DeepSeek-V3's experts
(deepseek.py's `DeepseekMoeBlock`: sigmoid scores, a float32 choice bias, groups,
routed_scaling_factor, ungated shared experts) from layer first_k_dense_replace on.
Its checkpoints name everything as transformers does, and carry a
multi-token-prediction layer (layer num_hidden_layers) that is not loaded, as
DeepSeek-V3's: `DeepseekForCausalLM` does both.
"""

from __future__ import annotations

from pagellm.executor.model.decoder import DecoderLayer, DecoderModel
from pagellm.executor.model.deepseek import DeepseekForCausalLM, DeepseekMoeBlock


class Glm4MoeDecoderLayer(DecoderLayer):
    moe_cls = DeepseekMoeBlock


class Glm4MoeModel(DecoderModel):
    layer_cls = Glm4MoeDecoderLayer


class Glm4MoeForCausalLM(DeepseekForCausalLM):
    model_cls = Glm4MoeModel
