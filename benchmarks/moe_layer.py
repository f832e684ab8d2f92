"""One mixture-of-experts layer on the CPU: time per forward against the expert count at
a fixed top-k, to show that experts no token picks cost nothing (the time follows the
experts chosen, T·k at most, not E).

    python benchmarks/moe_layer.py                  # Qwen3-30B-A3B's layer: H 2048, I 768, top-8
    python benchmarks/moe_layer.py --experts 8 32 128 --tokens 1 4 16 --top-k 8
    python benchmarks/moe_layer.py --experts 128 --quantization fp32 int8 int4

Each row: the experts' weights (fp32, or packed for the CPU's int kernel as
`quantization="int8"` / `"int4"` packs them: moe.quantize_experts), tokens T, experts E,
the distinct experts the random router chose, the median time of --repeats forwards,
and that time per chosen expert. Random weights; the schemes alternate per token count,
so their ratio is one run's.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from pagellm.executor.model.moe import SparseMoeBlock, quantize_experts
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.quantize import QUANTIZATIONS
from pagellm.executor.model.rope import RopeSpec
from pagellm.executor.model.spec import DecoderSpec, MoeSpec


def block(experts: int, top_k: int, hidden: int, inter: int, quantization: str
          ) -> SparseMoeBlock:
    moe = MoeSpec(num_experts=experts, top_k=top_k, intermediate_size=inter,
                  renormalize=True, sparse_layers=(True,))
    spec = DecoderSpec(vocab_size=1024, hidden_size=hidden, intermediate_size=inter,
                       num_layers=1, num_heads=16, num_kv_heads=4, head_dim=128,
                       rms_norm_eps=1e-6, qkv_bias=False, o_bias=False, qk_norm=None,
                       tie_word_embeddings=False, max_position=4096,
                       rope=RopeSpec("default", 10000.0), moe=moe)
    layer = SparseMoeBlock(spec, TensorParallel.layout(spec))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=generator) * 0.02)
    if quantization != "fp32":
        quantize_experts(layer, QUANTIZATIONS[quantization], triton=False)
    return layer.eval()


def main(argv: list[str] | None = None) -> list[dict[str, Any]]:
    """Print the rows (module docstring); return them."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experts", type=int, nargs="+", default=[8, 32, 128])
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--inter", type=int, default=768)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--quantization", nargs="+", default=["fp32"],
                        choices=["fp32", "int8", "int4"])
    args = parser.parse_args(argv)
    rows: list[dict[str, Any]] = []
    print(f"{torch.get_num_threads()} threads, H={args.hidden}, I={args.inter}, "
          f"top-{args.top_k}")
    print(f"{'experts':>7} {'T':>4} {'E':>5} {'chosen':>7} {'ms':>8} {'ms/chosen':>10}")
    for experts in args.experts:
        layers = {q: block(experts, min(args.top_k, experts), args.hidden, args.inter, q)
                  for q in args.quantization}
        for tokens in args.tokens:
            x = torch.randn(tokens, args.hidden, generator=torch.Generator().manual_seed(1))
            for quantization, layer in layers.items():
                with torch.inference_mode():
                    chosen = int(layer.route(x)[1].unique().numel())
                    layer(x)  # warm-up
                    times = []
                    for _ in range(args.repeats):
                        start = time.perf_counter()
                        layer(x)
                        times.append(time.perf_counter() - start)
                ms = 1e3 * statistics.median(times)
                print(f"{quantization:>7} {tokens:>4} {experts:>5} {chosen:>7} {ms:>8.2f} "
                      f"{ms / chosen:>10.3f}")
                rows.append(dict(quantization=quantization, tokens=tokens, experts=experts,
                                 chosen=chosen, ms=ms))
    return rows


if __name__ == "__main__":
    main()
