"""A llama.cpp GGUF file written from a test model, as llama.cpp's convert_hf_to_gguf.py
writes one (its metadata keys, tensor names, llama's q and k rows permuted for its RoPE
layout, the tokenizer as "gpt2" tokens and merges), with the gguf package's own writer
and quantizers. transformers reads such a file itself (`gguf_file=`): the tests'
reference."""

from __future__ import annotations

import json
import re
import zlib
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file


def _permute(weight: np.ndarray, heads: int) -> np.ndarray:
    """convert_hf_to_gguf.py's LlamaModel.permute: each head's rows from rotate-half
    order to interleaved pairs."""
    return (weight.reshape(heads, 2, weight.shape[0] // heads // 2, *weight.shape[1:])
            .swapaxes(1, 2).reshape(weight.shape))


# The types gguf's writer cannot quantize (llama.cpp's K-quants): bytes per super-block
# of 256 weights, where its fp16 step d (and for Q4_K / Q5_K its dmin) sits with the
# values written there, and for those two the mid-code each sub-block's minimum sits at.
# The codes (and Q6_K's int8 sub-block scales) are random: any bytes are valid blocks,
# which transformers dequantizes as llama.cpp does.
RANDOM_BLOCKS = {"Q4_K": (144, {0: 2e-4, 2: 16e-4}, 7.5),
                 "Q5_K": (176, {0: 1e-4, 2: 16e-4}, 15.5), "Q6_K": (210, {208: 5e-5}, None)}


def random_blocks(name: str, shape: tuple[int, ...], qtype: str) -> np.ndarray:
    """Random `qtype` blocks for a [N, K] tensor (K a multiple of 256), seeded by
    `name`: [N, K / 256 * block bytes] uint8. Q4_K's and Q5_K's sub-blocks take random
    6-bit scales and the minimum that centres their codes on 0, as llama.cpp's quantizer
    finds for weights around 0 (random minimums shift whole sub-blocks far off 0)."""
    size, halves, middle = RANDOM_BLOCKS[qtype]
    n, k = shape
    rng = np.random.default_rng(zlib.crc32(name.encode()))
    blocks = rng.integers(0, 256, (n, k // 256, size), dtype=np.uint8)
    for at, value in halves.items():
        blocks[..., at:at + 2] = np.array([value], dtype=np.float16).view(np.uint8)
    if middle is not None:  # w = d * sc * q - dmin * m: m = middle * sc * d / dmin
        sc = rng.integers(1, 64, (n, k // 256, 8))
        m = np.minimum(np.rint(middle * sc * halves[0] / halves[2]), 63).astype(np.int64)
        blocks[..., 4:16] = _k_scale_bytes(sc, m)
    return blocks.reshape(n, -1)


def _k_scale_bytes(sc: np.ndarray, m: np.ndarray) -> np.ndarray:
    """8 six-bit scales and mins [..., 8] -> the 12 bytes ggml packs them in (the inverse
    of its get_scale_min_k4): sub-blocks 0-3 in the low 6 bits of bytes 0-3 / 4-7,
    4-7's low 4 bits in bytes 8-11 and their high 2 bits in the top of bytes 0-7."""
    out = np.zeros((*sc.shape[:-1], 12), dtype=np.int64)
    out[..., 0:4] = sc[..., 0:4] | ((sc[..., 4:8] >> 4) << 6)
    out[..., 4:8] = m[..., 0:4] | ((m[..., 4:8] >> 4) << 6)
    out[..., 8:12] = (sc[..., 4:8] & 0xF) | ((m[..., 4:8] & 0xF) << 4)
    return out.astype(np.uint8)


def write_gguf(model_dir: Path, path: Path, projection_type: str = "F32",
               types: dict[str, str] | None = None, omit: tuple[str, ...] = (),
               state: dict[str, np.ndarray] | None = None) -> Path:
    """`model_dir`'s model (llama, mixtral, qwen2, qwen3, qwen3_moe, qwen2_moe, phi3, gemma2,
    gemma3) as a
    GGUF file, as convert_hf_to_gguf.py writes each (Gemma's norms as 1 + w, a layer's
    experts stacked), its tensors named by the gguf package's own table for the
    architecture; its projections stored as
    `projection_type` (F32, Q8_0, Q4_0, ...) but those `types` names otherwise
    (llama.cpp's mixes), the rest as F32, and the tensors `omit` names left out (a broken
    file). K-quant projections hold random blocks (RANDOM_BLOCKS), not the model's
    weights. `state`: the weights, if not model_dir's model.safetensors; a vocabulary
    larger than the tokenizer's is padded with unused tokens. Experts come per expert, as
    checkpoints name them, or stacked, as transformers holds them in memory."""
    import gguf

    config = json.loads((model_dir / "config.json").read_text())
    tokenizer = json.loads((model_dir / "tokenizer.json").read_text())
    if state is None:
        state = load_file(str(model_dir / "model.safetensors"))
    heads, kv_heads = config["num_attention_heads"], config["num_key_value_heads"]
    arch = {"gemma3_text": "gemma3", "qwen3_moe": "qwen3moe", "qwen2_moe": "qwen2moe",
            "mixtral": "llama"}.get(config["model_type"], config["model_type"])
    # (Mixtral: a llama with experts)
    names = gguf.get_tensor_name_map(
        next(a for a, n in gguf.MODEL_ARCH_NAMES.items() if n == arch),
        config["num_hidden_layers"])

    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"test {arch}")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(heads)
    writer.add_head_count_kv(kv_heads)
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    writer.add_key_length(head_dim)
    writer.add_value_length(head_dim)
    if config.get("sliding_window"):
        writer.add_sliding_window(config["sliding_window"])
    rope = config.get("rope_parameters") or {}
    writer.add_rope_freq_base(float(rope.get("rope_theta") or config.get("rope_theta")
                                    or 10000.0))
    writer.add_layer_norm_rms_eps(float(config["rms_norm_eps"]))
    writer.add_rope_dimension_count(head_dim)
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer["model"]["vocab"]
    tokens = sorted(vocab, key=vocab.get)
    tokens += [f"<unused{i}>" for i in range(len(tokens), config["vocab_size"])]
    special = {t["content"] for t in tokenizer.get("added_tokens", [])}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL
                            for t in tokens])
    writer.add_token_merges(merges)
    if config.get("bos_token_id") is not None:
        writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(config["eos_token_id"])
    if config.get("pad_token_id") is not None:
        writer.add_pad_token_id(config["pad_token_id"])

    if experts := config.get("num_experts") or config.get("num_local_experts"):
        writer.add_expert_count(experts)
        writer.add_expert_used_count(config["num_experts_per_tok"])
        if "moe_intermediate_size" in config:
            writer.add_expert_feed_forward_length(config["moe_intermediate_size"])
        if config.get("shared_expert_intermediate_size"):
            writer.add_expert_shared_feed_forward_length(
                config["shared_expert_intermediate_size"])
    stacks: dict[tuple[str, str], dict[int, np.ndarray]] = {}
    for name, tensor in state.items():
        tensor = tensor.astype(np.float32)
        if stacked := re.fullmatch(r"model\.layers\.(\d+)\.mlp\.experts\.(gate_up|down)_proj",
                                   name):  # transformers' in-memory [E, N, K] (gate, up)
            halves = np.split(tensor, 2, axis=1) if stacked[2] == "gate_up" else [tensor]
            for proj, part in zip(("gate", "up") if len(halves) == 2 else ("down",), halves,
                                  strict=True):
                stacks[(stacked[1], proj)] = dict(enumerate(part))
            continue
        if expert := re.fullmatch(r"model\.layers\.(\d+)\.(?:mlp|block_sparse_moe)\.experts"
                                  r"\.(\d+)\.(\w+)\.weight", name):
            # llama.cpp stacks a layer's experts: [E, N, K] (Mixtral's w1/w3/w2 too)
            proj = {"w1": "gate", "w3": "up", "w2": "down"}.get(expert[3],
                                                                 expert[3].removesuffix("_proj"))
            stacks.setdefault((expert[1], proj), {})[int(expert[2])] = tensor
            continue
        base, _, kind = name.rpartition(".")
        gguf_name = f"{names.get_name(base)}.{kind}"
        if gguf_name in omit:
            continue
        if name.endswith("shared_expert_gate.weight"):
            tensor = tensor[0]  # [1, hidden] -> [hidden], as convert_hf_to_gguf.py stores it
        if arch.startswith("gemma") and name.endswith("norm.weight"):
            tensor = tensor + 1  # convert_hf_to_gguf.py's Gemma: llama.cpp's norms scale by w
        if arch == "llama" and name.endswith("q_proj.weight"):
            tensor = _permute(tensor, heads)
        elif arch == "llama" and name.endswith("k_proj.weight"):
            tensor = _permute(tensor, kv_heads)
        qtype = gguf.GGMLQuantizationType[(types or {}).get(gguf_name, projection_type)]
        if name.endswith("_proj.weight") and qtype.name in RANDOM_BLOCKS:
            writer.add_tensor(gguf_name, random_blocks(gguf_name, tensor.shape, qtype.name),
                              raw_dtype=qtype)
        elif name.endswith("_proj.weight") and qtype != gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, gguf.quantize(tensor, qtype), raw_dtype=qtype)
        else:
            writer.add_tensor(gguf_name, tensor)
    for (layer, proj), by_expert in stacks.items():
        stacked = np.stack([by_expert[e] for e in sorted(by_expert)])
        gguf_name = f"blk.{layer}.ffn_{proj}_exps.weight"
        qtype = gguf.GGMLQuantizationType[(types or {}).get(gguf_name, projection_type)]
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(gguf_name, stacked)
        else:
            writer.add_tensor(gguf_name, gguf.quantize(stacked, qtype), raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
