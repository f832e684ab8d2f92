"""LoRA serving cost: the same work with and without adapters, in one run.

Offline: N requests (prompt and output lengths drawn as benchmarks/throughput.py draws
them, greedy, EOS ignored) on the base model, then the same requests spread round-robin
over --adapters rank --rank adapters of every projection (q, k, v, o, gate, up, down),
alternating base and LoRA runs --repeats times (the machine is shared and noisy: the
ratio of medians is the claim). Batch 1: one request's time per output token, base
against one adapter. Swap: replacing an adapter's weights under its id from tensors in
memory (`add_lora(TensorLoRARequest(...))`: through shared memory, placed, written into
its slot; RL's adapter sync), and from a directory (`load_inplace=True`), medians.

Adapters are random (PEFT's file layout, written here: the engine reads only the
tensors' names and shapes), on `--load-format dummy` base weights of a real config.

    python benchmarks/lora.py --model benchmarks/configs/smollm2-135m
    python benchmarks/lora.py --device cuda --dtype bfloat16 --model benchmarks/configs/qwen2.5-1.5b
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch
from safetensors.torch import load_file, save_file

from pagellm import LLM, LoRARequest, SamplingParams
from pagellm.protocol.lora import TensorLoRARequest

PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_adapter(directory: Path, config: dict, rank: int, seed: int) -> Path:
    """A PEFT-layout adapter of every projection of every layer."""
    hidden, inter = config["hidden_size"], config["intermediate_size"]
    heads, kv = config["num_attention_heads"], config["num_key_value_heads"]
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
              "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (inter, hidden), "up_proj": (inter, hidden),
              "down_proj": (hidden, inter)}
    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config["num_hidden_layers"]):
        for proj in PROJECTIONS:
            block = "self_attn" if proj in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            out_f, in_f = shapes[proj]
            name = f"base_model.model.model.layers.{layer}.{block}.{proj}"
            tensors[f"{name}.lora_A.weight"] = 0.02 * torch.randn(rank, in_f,
                                                                   generator=generator)
            tensors[f"{name}.lora_B.weight"] = 0.02 * torch.randn(out_f, rank,
                                                                   generator=generator)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "adapter_model.safetensors"))
    (directory / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank, "bias": "none",
        "target_modules": list(PROJECTIONS), "use_rslora": False}))
    return directory


def timed(llm: LLM, prompts: list[dict], params: list[SamplingParams],
          loras: list[LoRARequest | None] | None) -> float:
    t0 = time.perf_counter()
    llm.generate(prompts, params, use_tqdm=False, lora_request=loras)
    return time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="benchmarks/configs/smollm2-135m")
    parser.add_argument("--adapters", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--num-prompts", type=int, default=48)
    parser.add_argument("--input-len", type=int, nargs=2, default=[16, 256])
    parser.add_argument("--output-len", type=int, nargs=2, default=[32, 160])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"],
                        help="cuda: the Triton LoRA kernels, in the decode CUDA graphs")
    ns = parser.parse_args()
    config = json.loads((Path(ns.model) / "config.json").read_text())
    rng = random.Random(0)
    vocab = config["vocab_size"]
    prompts = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(
        rng.randint(*ns.input_len))]} for _ in range(ns.num_prompts)]
    params = [SamplingParams(temperature=0.0, ignore_eos=True,
                             max_tokens=rng.randint(*ns.output_len)) for _ in prompts]
    tokens = sum(p.max_tokens or 0 for p in params)
    with tempfile.TemporaryDirectory() as tmp:
        adapters = [LoRARequest(f"a{i}", i + 1, str(write_adapter(
            Path(tmp) / f"a{i}", config, ns.rank, i))) for i in range(ns.adapters)]
        loras: list[LoRARequest | None] = [adapters[i % len(adapters)]
                                           for i in range(len(prompts))]
        llm = LLM(ns.model, load_format="dummy", dtype=ns.dtype, enable_lora=True,
                  max_loras=ns.adapters, max_lora_rank=ns.rank, max_model_len=1024,
                  multiprocess=False, skip_tokenizer_init=True, device=ns.device)
        for lora in adapters:
            llm.add_lora(lora)
        timed(llm, prompts[:4], params[:4], loras[:4])  # warm-up
        base_s, lora_s = [], []
        for _ in range(ns.repeats):
            base_s.append(timed(llm, prompts, params, None))
            lora_s.append(timed(llm, prompts, params, loras))
        one = SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=128)
        single = [{"prompt_token_ids": [rng.randrange(vocab) for _ in range(32)]}]
        base1, lora1 = [], []
        for _ in range(ns.repeats):
            base1.append(timed(llm, single, [one], None) / 128)
            lora1.append(timed(llm, single, [one], [adapters[0]]) / 128)
        swaps, file_swaps = [], []
        for i in range(ns.repeats + 2):
            source = Path(adapters[(i + 1) % len(adapters)].lora_path)
            tensors = load_file(str(source / "adapter_model.safetensors"))
            peft_config = json.loads((source / "adapter_config.json").read_text())
            t0 = time.perf_counter()
            llm.add_lora(TensorLoRARequest("policy", 100, peft_config=peft_config,
                                           lora_tensors=tensors))
            swaps.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            llm.add_lora(LoRARequest("a0", 1, str(source), load_inplace=True))
            file_swaps.append(time.perf_counter() - t0)
        llm.shutdown()
    base, lora = statistics.median(base_s), statistics.median(lora_s)
    b1, l1 = statistics.median(base1), statistics.median(lora1)
    print(f"model {ns.model} ({ns.dtype}, {ns.device}), {ns.adapters} adapters of rank "
          f"{ns.rank} on every projection, torch threads {torch.get_num_threads()}")
    print(f"offline {ns.num_prompts} requests, {tokens} output tokens: base {base:.2f} s "
          f"({tokens / base:.1f} tok/s), LoRA {lora:.2f} s ({tokens / lora:.1f} tok/s): "
          f"LoRA/base throughput {base / lora:.3f}   (runs: base {base_s}, lora {lora_s})")
    print(f"batch 1, 128 tokens: base {1000 * b1:.2f} ms/token, LoRA {1000 * l1:.2f} "
          f"ms/token: LoRA/base time {l1 / b1:.3f}")
    print(f"in-place swap of a rank-{ns.rank} adapter from tensors in memory: median "
          f"{1000 * statistics.median(swaps):.1f} ms (runs {[round(1000 * s) for s in swaps]}); "
          f"from its directory: median {1000 * statistics.median(file_swaps):.1f} ms")


if __name__ == "__main__":
    main()
