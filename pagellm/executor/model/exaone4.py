"""EXAONE 4.0 (LG AI Research's `Exaone4ForCausalLM`: 32B, 1.2B): OLMo 2's layer order
with Llama's norms, per-head q/k norms, and hybrid attention.

What differs from the shared decoder (decoder.py), as transformers computes it:

- norms after the attention and MLP blocks and none before (olmo2.py's
  `PostNormDecoderLayer`), Llama's RMSNorm (rounded, then scaled) for them all;
- q and k normalised per head (the spec's qk_norm "head", Qwen3's) before RoPE;
- with a sliding window, three local layers (sliding_window keys, RoPE) to one global
  layer that attends to everything without RoPE (layer_types; the spec's rope_layers:
  the shared attention turns nothing there, as in SmolLM3's NoPE layers);
  without one, every layer is global and rotates.

The spec carries the data (registry.py `_exaone4`); names, loading and tensor
parallelism are the shared decoder's.
"""

from __future__ import annotations

from pagellm.executor.model.decoder import DecoderAttention, DecoderForCausalLM, DecoderModel
from pagellm.executor.model.layers import RMSNorm
from pagellm.executor.model.olmo2 import PostNormDecoderLayer


class Exaone4DecoderLayer(PostNormDecoderLayer):
    """The post-norm layer with Llama's norms and the shared attention (which attends
    without RoPE in a global layer of a hybrid model: the spec's rope_layers)."""

    norm_cls = RMSNorm
    attention_cls = DecoderAttention


class Exaone4Model(DecoderModel):
    layer_cls = Exaone4DecoderLayer


class Exaone4ForCausalLM(DecoderForCausalLM):
    """EXAONE 4.0: the shared causal LM around `Exaone4Model`."""

    model_cls = Exaone4Model
