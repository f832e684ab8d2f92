"""The small random-weight models of each family beyond Llama/Qwen that the tests build
with transformers' own classes (tests/e2e/test_model_families.py against transformers
on the CPU, tests/e2e/test_gpu.py on CUDA): each spec's comment says what it exercises."""

from __future__ import annotations

from pagellm.demo.model import ModelSpec

_SMALL = dict(hidden_size=64, num_layers=2, num_heads=4, vocab_size=1024,
              tie_word_embeddings=False)
# DeepSeek's latent attention, small: a latent of 32 (the cache's head_dim with the
# rotary 16), queries and keys of 16 + 16 per head, values of 24
DEEPSEEK_MLA = dict(kv_lora_rank=32, qk_rope_head_dim=16, qk_nope_head_dim=16, v_head_dim=24)
FAMILY_SPECS: dict[str, ModelSpec] = {
    # top-2 of 8, renormalised; layer 1 dense (mlp_only_layers); one KV head replicated
    # under tensor parallelism; head_dim apart from hidden_size / heads
    "qwen3_moe": ModelSpec(arch="qwen3_moe", **_SMALL, num_kv_heads=1, head_dim=32,
                           intermediate_size=96, init_std=0.3, seed=11, config_extra=dict(
                               num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, norm_topk_prob=True,
                               mlp_only_layers=[1])),
    # top-1 of 16, not renormalised: most experts see no token of a short batch
    "qwen3_moe_top1": ModelSpec(arch="qwen3_moe", **_SMALL, num_kv_heads=2,
                                intermediate_size=64, init_std=0.3, seed=12,
                                config_extra=dict(num_experts=16, num_experts_per_tok=1,
                                                  moe_intermediate_size=16,
                                                  norm_topk_prob=False)),
    # Qwen2-MoE: q/k/v biases, top-2 of 8 not renormalised, and a shared expert of its
    # own width (48) gated by sigmoid(shared_expert_gate(x)); layer 0 dense
    "qwen2_moe": ModelSpec(arch="qwen2_moe", **_SMALL, num_kv_heads=2, intermediate_size=80,
                           init_std=0.3, seed=19, config_extra=dict(
                               num_experts=8, num_experts_per_tok=2,
                               moe_intermediate_size=32, shared_expert_intermediate_size=48,
                               norm_topk_prob=False, mlp_only_layers=[0])),
    "mixtral": ModelSpec(arch="mixtral", **_SMALL, num_kv_heads=2, intermediate_size=48,
                         init_std=0.2, seed=13,
                         config_extra=dict(num_local_experts=4, num_experts_per_tok=2)),
    # top-8 of 8: every expert for every token
    "mixtral_top8": ModelSpec(arch="mixtral", **_SMALL, num_kv_heads=4,
                              intermediate_size=32, init_std=0.2, seed=14,
                              config_extra=dict(num_local_experts=8, num_experts_per_tok=8)),
    # q/k norms over all heads, q/k/v clipped, top-8 of 16 not renormalised
    "olmoe": ModelSpec(arch="olmoe", **_SMALL, num_kv_heads=4, intermediate_size=32,
                       init_std=0.3, seed=15,
                       config_extra=dict(num_experts=16, num_experts_per_tok=8,
                                         norm_topk_prob=False, clip_qkv=3.0)),
    # sliding window on every layer, shorter than most prompts and crossing blocks of
    # 16 (the KV cache manager frees the blocks behind it as the requests run)
    "mistral": ModelSpec(arch="mistral", **_SMALL, num_kv_heads=2, intermediate_size=128,
                         init_std=0.2, seed=17, config_extra=dict(sliding_window=20)),
    # Qwen2's layers from max_window_layers on slide: layer 0 full, layer 1 a window
    "qwen2_window": ModelSpec(arch="qwen2", **_SMALL, num_kv_heads=2, intermediate_size=96,
                              init_std=0.2, seed=18,
                              config_extra=dict(use_sliding_window=True, sliding_window=12,
                                                max_window_layers=1)),
    # gpt-oss: top-2 of 8 biased experts, their SwiGLU clamped at 1.5 (so the clamps
    # bite at init_std 0.3), sinks, layer 0 a 20-key window (the prompts are longer),
    # layer 1 full, YaRN RoPE, 8 query heads per KV head
    "gpt_oss": ModelSpec(arch="gpt_oss", **{**_SMALL, "num_heads": 8}, num_kv_heads=1,
                         head_dim=16, intermediate_size=32, init_std=0.3, seed=21,
                         rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                           beta_slow=1.0, truncate=False,
                                           original_max_position_embeddings=512),
                         config_extra=dict(num_local_experts=8, num_experts_per_tok=2,
                                           sliding_window=20, swiglu_limit=1.5)),
    # DeepSeek-V3: latent attention (q through its own latent, rotary pairs interleaved,
    # YaRN with mscale_all_dim in the scores' scale), layer 0 dense, then top-2 of 8
    # sigmoid-scored experts chosen within the best 2 of 4 groups with a choice bias,
    # renormalised and scaled by 2.5, plus a shared expert
    "deepseek_v3": ModelSpec(arch="deepseek_v3", **_SMALL, num_kv_heads=4,
                             intermediate_size=96, init_std=0.3, seed=23,
                             rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                               beta_slow=1.0, mscale=0.9, mscale_all_dim=0.8,
                                               original_max_position_embeddings=512),
                             config_extra=dict(DEEPSEEK_MLA, q_lora_rank=64,
                                               n_routed_experts=8, num_experts_per_tok=2,
                                               moe_intermediate_size=32, n_shared_experts=1,
                                               n_group=4, topk_group=2,
                                               routed_scaling_factor=2.5,
                                               norm_topk_prob=True, first_k_dense_replace=1)),
    # DeepSeek-V2: queries straight from q_proj, softmax-scored top-3 of 8 experts within
    # the best 2 of 4 groups (each scored by its best expert), not renormalised, scaled
    # by 1.5; two shared experts (one MLP twice as wide)
    "deepseek_v2": ModelSpec(arch="deepseek_v2", **_SMALL, num_kv_heads=4,
                             intermediate_size=96, init_std=0.3, seed=24,
                             config_extra=dict(DEEPSEEK_MLA, q_lora_rank=None,
                                               n_routed_experts=8, num_experts_per_tok=3,
                                               moe_intermediate_size=32, n_shared_experts=2,
                                               n_group=4, topk_group=2,
                                               topk_method="group_limited_greedy",
                                               routed_scaling_factor=1.5,
                                               norm_topk_prob=False, first_k_dense_replace=1)),
    # GLM-4.5: 2 KV heads, q/k/v biases, per-head q/k norms, RoPE on half of each head,
    # DeepSeek-V3's experts and routing
    "glm4_moe": ModelSpec(arch="glm4_moe", **_SMALL, num_kv_heads=2, head_dim=32,
                          intermediate_size=96, init_std=0.3, seed=25,
                          rope_scaling=dict(rope_type="default", partial_rotary_factor=0.5),
                          config_extra=dict(attention_bias=True, use_qk_norm=True,
                                            n_routed_experts=8, num_experts_per_tok=2,
                                            moe_intermediate_size=32, n_shared_experts=1,
                                            n_group=4, topk_group=2,
                                            routed_scaling_factor=2.5, norm_topk_prob=True,
                                            first_k_dense_replace=1)),
    # GLM-4.7-Flash: DeepSeek-V3's architecture, its dense layers by mlp_layer_types
    "glm4_moe_lite": ModelSpec(arch="glm4_moe_lite", **_SMALL, num_kv_heads=4,
                               intermediate_size=96, init_std=0.3, seed=26,
                               config_extra=dict(DEEPSEEK_MLA, q_lora_rank=64,
                                                 n_routed_experts=8, num_experts_per_tok=2,
                                                 moe_intermediate_size=32,
                                                 n_shared_experts=1, n_group=1,
                                                 topk_group=1, routed_scaling_factor=1.8,
                                                 norm_topk_prob=True,
                                                 mlp_layer_types=["sparse", "dense"])),
    "olmoe_top2": ModelSpec(arch="olmoe", **_SMALL, num_kv_heads=2, intermediate_size=32,
                            init_std=0.3, seed=16,
                            config_extra=dict(num_experts=4, num_experts_per_tok=2,
                                              norm_topk_prob=True)),
    # OLMo 2: norms after the blocks, none before; q/k norms over all heads (2 KV heads,
    # so sharded under tensor parallelism)
    "olmo2": ModelSpec(arch="olmo2", **_SMALL, num_kv_heads=2, intermediate_size=96,
                       init_std=0.3, seed=27),
    # OLMo 3: three sliding layers (a 12-key window, crossing blocks of 16) and a full
    # one, the full one with YaRN and the sliding ones with plain RoPE
    "olmo3": ModelSpec(arch="olmo3", **{**_SMALL, "num_layers": 4}, num_kv_heads=2,
                       intermediate_size=96, init_std=0.3, seed=28,
                       rope_scaling=dict(rope_type="yarn", factor=4.0, beta_fast=32.0,
                                         beta_slow=1.0, original_max_position_embeddings=512),
                       config_extra=dict(sliding_window=12)),
    # SmolLM3: layers 1 and 3 of 4 attend without RoPE (no_rope_layers), GQA
    "smollm3": ModelSpec(arch="smollm3", **{**_SMALL, "num_layers": 4}, num_kv_heads=2,
                         intermediate_size=96, init_std=0.2, seed=29,
                         config_extra=dict(no_rope_layers=[1, 0, 1, 0])),
    # Granite 3: embedding x 12, block outputs x 0.22 before the residual add, scores
    # scaled by 0.0078125 (not head_dim ** -0.5), logits / 8
    "granite": ModelSpec(arch="granite", **_SMALL, num_kv_heads=2, intermediate_size=96,
                         init_std=0.3, seed=30,
                         config_extra=dict(embedding_multiplier=12.0,
                                           residual_multiplier=0.22,
                                           attention_multiplier=0.0078125,
                                           logits_scaling=8.0)),
    # MiniMax-M2: q/k norms over all heads (2 KV heads: sharded under tensor
    # parallelism), RoPE on 16 of each head's 32 dimensions (rotary_dim, and the
    # partial_rotary_factor transformers 5.0 reads), top-2 of 8 experts by sigmoid score
    # plus a choice bias, renormalised, in every layer, no shared expert
    "minimax_m2": ModelSpec(arch="minimax_m2", **_SMALL, num_kv_heads=2, head_dim=32,
                            intermediate_size=32, init_std=0.3, seed=32,
                            rope_scaling=dict(rope_type="default", partial_rotary_factor=0.5),
                            config_extra=dict(num_local_experts=8, num_experts_per_tok=2,
                                              rotary_dim=16)),
    # GLM-4: q/k/v biases, RoPE on half of each head with its pairs interleaved, gate
    # and up fused in the checkpoint, GQA; GLM-4-0414 adds norms after both blocks
    "glm": ModelSpec(arch="glm", **_SMALL, num_kv_heads=2, head_dim=32, intermediate_size=96,
                     init_std=0.3, seed=33, config_extra=dict(partial_rotary_factor=0.5)),
    "glm4": ModelSpec(arch="glm4", **_SMALL, num_kv_heads=2, head_dim=32,
                      intermediate_size=96, init_std=0.3, seed=34,
                      config_extra=dict(partial_rotary_factor=0.5)),
    # ERNIE 4.5 (dense): Llama's layers with GLM's interleaved RoPE pairs over whole
    # heads, tied embedding
    "ernie4_5": ModelSpec(arch="ernie4_5", **{**_SMALL, "tie_word_embeddings": True},
                          num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=39),
    # ERNIE 4.5 MoE: layer 0 dense (moe_layer_start_index 1), then top-2 of 8 experts by
    # softmax plus a choice bias, renormalised, and two ungated shared experts
    "ernie4_5_moe": ModelSpec(arch="ernie4_5_moe", **{**_SMALL, "num_layers": 3,
                                                      "tie_word_embeddings": True},
                              num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=40,
                              config_extra=dict(moe_num_experts=8, moe_k=2,
                                                moe_intermediate_size=32,
                                                moe_num_shared_experts=2,
                                                moe_layer_start_index=1)),
    # Command R (Cohere): attention and MLP side by side after one bias-free LayerNorm,
    # interleaved RoPE pairs, tied embedding, logits times 0.3 (a scale no power of two)
    "cohere": ModelSpec(arch="cohere", **{**_SMALL, "tie_word_embeddings": True},
                        num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=35,
                        config_extra=dict(logit_scale=0.3)),
    # Command R7B / A (Cohere2): three sliding layers (12 keys, crossing blocks of 16)
    # with RoPE, the fourth full and without
    "cohere2": ModelSpec(arch="cohere2", **{**_SMALL, "num_layers": 4,
                                            "tie_word_embeddings": True},
                         num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=36,
                         config_extra=dict(logit_scale=0.3, sliding_window=12,
                                           layer_types=["sliding_attention"] * 3
                                           + ["full_attention"])),
    # EXAONE 4.0: norms after the blocks (Llama's), per-head q/k norms, three sliding
    # layers (12 keys) with RoPE to one global layer without, llama3 RoPE scaling
    "exaone4": ModelSpec(arch="exaone4", **{**_SMALL, "num_layers": 4}, num_kv_heads=2,
                         intermediate_size=96, init_std=0.3, seed=37,
                         rope_scaling={"rope_type": "llama3", "factor": 4.0,
                                       "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                       "original_max_position_embeddings": 256},
                         config_extra=dict(sliding_window=12, sliding_window_pattern=4)),
    # EXAONE 4.0 1.2B's kind: no sliding window, every layer global and rotating
    "exaone4_global": ModelSpec(arch="exaone4", **_SMALL, num_kv_heads=2,
                                intermediate_size=96, init_std=0.3, seed=38,
                                config_extra=dict(sliding_window=None,
                                                  layer_types=["full_attention"] * 2)),
    # Seed-OSS: q/k/v biases, no o_proj bias (its own switch), GQA
    "seed_oss": ModelSpec(arch="seed_oss", **_SMALL, num_kv_heads=2, intermediate_size=96,
                          init_std=0.3, seed=31,
                          config_extra=dict(attention_bias=True, attention_out_bias=False)),
    # LFM2: short convolutions (3 taps, biases) in layers 0, 1 and 3 around one
    # attention layer with per-head q/k norms; the MLP's width derived (96 -> 64)
    "lfm2": ModelSpec(arch="lfm2", **{**_SMALL, "num_layers": 4,
                                      "tie_word_embeddings": True},
                      num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=39,
                      config_extra=dict(layer_types=["conv", "conv", "full_attention",
                                                     "conv"],
                                        conv_L_cache=3, conv_bias=True, norm_eps=1e-5,
                                        block_multiple_of=16)),
    # LFM2-MoE: layer 0 dense (96 wide as given), then top-2 of 8 experts by sigmoid
    # score plus a choice bias, renormalised, scaled by 1.5; two convolutions, two
    # attention layers
    "lfm2_moe": ModelSpec(arch="lfm2_moe", **{**_SMALL, "num_layers": 4},
                          num_kv_heads=2, intermediate_size=96, init_std=0.3, seed=40,
                          config_extra=dict(layer_types=["conv", "full_attention", "conv",
                                                         "full_attention"],
                                            conv_L_cache=3, norm_eps=1e-5,
                                            num_dense_layers=1, num_experts=8,
                                            num_experts_per_tok=2, moe_intermediate_size=32,
                                            routed_scaling_factor=1.5)),
    # Qwen3.5 (text): three linear-attention layers (2 key heads of 16, 4 value heads
    # of 16, a 4-tap convolution) around one gated full-attention layer (head_dim 32,
    # RoPE on a quarter of it), (1 + w) norms
    "qwen3_5": ModelSpec(arch="qwen3_5_text", **{**_SMALL, "num_layers": 4},
                         num_kv_heads=2, head_dim=32, intermediate_size=96, init_std=0.3,
                         seed=41, rope_scaling={"rope_type": "default",
                                                "partial_rotary_factor": 0.25},
                         config_extra=dict(layer_types=["linear_attention"] * 3
                                           + ["full_attention"],
                                           linear_num_key_heads=2, linear_num_value_heads=4,
                                           linear_key_head_dim=16, linear_value_head_dim=16,
                                           linear_conv_kernel_dim=4)),
    # Qwen3.5-MoE (text): the same layers with top-2 of 8 experts in every layer,
    # renormalised, and a shared expert (48 wide) gated by sigmoid
    "qwen3_5_moe": ModelSpec(arch="qwen3_5_moe_text", **{**_SMALL, "num_layers": 4},
                             num_kv_heads=2, head_dim=32, intermediate_size=96,
                             init_std=0.3, seed=42,
                             rope_scaling={"rope_type": "default",
                                           "partial_rotary_factor": 0.25},
                             config_extra=dict(layer_types=["linear_attention", "full_attention"]
                                               * 2,
                                               linear_num_key_heads=2, linear_num_value_heads=2,
                                               linear_key_head_dim=16, linear_value_head_dim=32,
                                               linear_conv_kernel_dim=4, num_experts=8,
                                               num_experts_per_tok=2, moe_intermediate_size=32,
                                               shared_expert_intermediate_size=48)),
    # Qwen3-Next: the same computation from projections fused per key head (2 key heads
    # of 16, 4 value heads of 16: two value heads per key head), top-2 of 8 experts
    # unnormalised, layer 2 dense (mlp_only_layers)
    "qwen3_next": ModelSpec(arch="qwen3_next", **{**_SMALL, "num_layers": 4},
                            num_kv_heads=2, head_dim=32, intermediate_size=96,
                            init_std=0.3, seed=43,
                            rope_scaling={"rope_type": "default",
                                          "partial_rotary_factor": 0.25},
                            config_extra=dict(layer_types=["linear_attention"] * 3
                                              + ["full_attention"],
                                              linear_num_key_heads=2, linear_num_value_heads=4,
                                              linear_key_head_dim=16, linear_value_head_dim=16,
                                              linear_conv_kernel_dim=4, num_experts=8,
                                              num_experts_per_tok=2, moe_intermediate_size=32,
                                              shared_expert_intermediate_size=48,
                                              norm_topk_prob=False, mlp_only_layers=[2])),
    # Granite 4.0-H: Mamba-2 layers (8 heads of 16 reading one group's 16-wide B and C,
    # as the releases; a 4-tap convolution with biases) around one attention layer
    # without RoPE; Granite's scalars; top-2 of 4 experts beside a shared MLP (48 wide)
    "granitemoehybrid": ModelSpec(arch="granitemoehybrid", **{**_SMALL, "num_layers": 4},
                                  num_kv_heads=2, intermediate_size=32, init_std=0.3, seed=44,
                                  config_extra=dict(
                                      layer_types=["mamba", "mamba", "attention", "mamba"],
                                      mamba_n_heads=8, mamba_n_groups=1, mamba_d_state=16,
                                      mamba_d_head=16, mamba_d_conv=4, mamba_expand=2,
                                      num_local_experts=4, num_experts_per_tok=2,
                                      shared_intermediate_size=48,
                                      position_embedding_type="nope",
                                      embedding_multiplier=2.0, residual_multiplier=0.5,
                                      attention_multiplier=0.2, logits_scaling=1.5)),
    # Granite-4.0-Micro's kind: every layer attends, with RoPE; no experts, the shared
    # MLP alone
    "granitemoehybrid_dense": ModelSpec(
        arch="granitemoehybrid", **_SMALL, num_kv_heads=2, intermediate_size=32,
        init_std=0.3, seed=45, config_extra=dict(
            layer_types=["attention"] * 2, num_local_experts=0, shared_intermediate_size=96,
            position_embedding_type="rope", embedding_multiplier=2.0,
            residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=1.5)),
}
