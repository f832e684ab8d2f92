"""Offline throughput: pagellm against transformers' `generate` and CTranslate2 on the
same work and the same weights, in one run.

N requests with prompt and output lengths drawn uniformly from the given ranges, random
prompt token ids, greedy decoding, EOS ignored so that every request produces exactly
the tokens it asked for. transformers and CTranslate2 run the same requests the way a
user would: batches of --hf-batch-size in input order (left padding for transformers),
each batch running to its longest request; only the tokens each request asked for are
counted, for every engine.

With --load-format dummy and a config-only directory (benchmarks/configs/), the random
weights are written once as a real checkpoint (cached under ~/.cache/pagellm/bench), so
all three engines read the same tensors and their greedy tokens can be compared.

The same run measures the machine: fp32 GEMM FLOP/s (torch.mm, 2048^3) and memory read
bandwidth (a 1 GiB sum), with torch's thread count, and reports each engine's share of
them: model FLOP/s for offline runs, weight bytes read per second for batch 1.

    python benchmarks/throughput.py --model benchmarks/configs/smollm2-135m \
        --load-format dummy --dtype float32 --num-prompts 48 --input-len 16 256 \
        --output-len 32 160 --peers transformers ctranslate2
    python benchmarks/throughput.py --model benchmarks/configs/smollm2-135m \
        --load-format dummy --dtype float32 --num-prompts 1 --input-len 32 32 \
        --output-len 128 128 --peers transformers ctranslate2

CTranslate2 is the optional `bench` extra (pip install -e ".[bench]").
Prints a table and, with --output-json, writes the numbers.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout

import torch

from pagellm import LLM, SamplingParams
from pagellm.demo.model import resolve_model
from pagellm.protocol.engine_args import EngineArgs

PEERS = ("transformers", "ctranslate2")
CACHE = Path(os.environ.get("PAGELLM_BENCH_CACHE", Path.home() / ".cache/pagellm/bench"))


@dataclass
class Result:
    engine: str
    seconds: float
    requests_per_s: float
    output_tokens_per_s: float
    total_tokens_per_s: float
    tokens: list[list[int]] = field(default_factory=list, repr=False)

    def summary(self) -> dict[str, Any]:
        """The numbers, without the tokens."""
        return {k: v for k, v in asdict(self).items() if k != "tokens"}


def make_workload(num: int, input_range: tuple[int, int], output_range: tuple[int, int],
                  vocab: int, seed: int) -> list[tuple[list[int], int]]:
    rng = random.Random(seed)
    # Skip the lowest ids: test tokenizers put their special tokens there.
    return [([rng.randrange(16, vocab) for _ in range(rng.randint(*input_range))],
             rng.randint(*output_range)) for _ in range(num)]


def result(engine: str, seconds: float, work: list[tuple[list[int], int]],
           tokens: list[list[int]] | None = None) -> Result:
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    return Result(engine, seconds, len(work) / seconds, output_tokens / seconds,
                  (prompt_tokens + output_tokens) / seconds, tokens or [])


# --------------------------------------------------------------------------- weights


def materialize(config_dir: str, dtype: torch.dtype, seed: int) -> Path:
    """A real checkpoint with random weights for a config-only directory, written once
    (cached by config, dtype and seed), with a word-level tokenizer of the model's
    vocabulary ("t0", "t1", ...) for converters that read one (CTranslate2's)."""
    from tokenizers import Tokenizer, models
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    config_text = (Path(config_dir) / "config.json").read_text()
    key = hashlib.sha256(f"{config_text}{dtype}{seed}".encode()).hexdigest()[:12]
    out = CACHE / f"{Path(config_dir).name}-{str(dtype).removeprefix('torch.')}-{key}"
    if (out / "model.safetensors").exists():
        return out
    config = AutoConfig.from_pretrained(config_dir)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    tmp = out.with_name(out.name + ".tmp")
    model.save_pretrained(tmp)
    vocab = {f"t{i}": i for i in range(config.vocab_size)}
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
        unk_token="t0", pad_token="t0", bos_token=f"t{config.bos_token_id or 0}",
        eos_token=f"t{_first(config.eos_token_id)}")  # every special token in the vocab
    tokenizer.save_pretrained(tmp)
    tmp.rename(out)
    return out


def _first(token_id: int | list[int] | None) -> int:
    return (token_id[0] if isinstance(token_id, list) else token_id) or 0


# --------------------------------------------------------------------------- engines


def run_pagellm(args: EngineArgs, work: list[tuple[list[int], int]],
                warmup: list[tuple[list[int], int]] | None = None) -> Result:
    """Time `work` on a warmed-up engine. `warmup` (other prompts of the same shape: no
    prefix-cache hits) makes Triton compile for long prefills and every split-KV slice
    count before the clock starts; by default one short request warms up."""

    def submit(llm: LLM, batch: list[tuple[list[int], int]]) -> list[Any]:
        prompts = [{"prompt_token_ids": p} for p, _ in batch]
        params = [SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
                  for _, n in batch]
        return llm.generate(prompts, params, use_tqdm=False)

    with LLM(**asdict(args)) as llm:
        submit(llm, warmup or [(work[0][0][:8], 4)])
        start = time.perf_counter()
        outputs = submit(llm, work)
        seconds = time.perf_counter() - start
    tokens = [list(o.outputs[0].token_ids) for o in outputs]
    assert [len(t) for t in tokens] == [n for _, n in work]
    return result("pagellm", seconds, work, tokens)


def load_hf_model(args: EngineArgs, dtype: torch.dtype) -> Any:
    from transformers import AutoConfig, AutoModelForCausalLM

    if args.load_format == "dummy":
        config = AutoConfig.from_pretrained(args.model)
        torch.manual_seed(args.seed)
        return AutoModelForCausalLM.from_config(config, dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(args.model, dtype=dtype)


def run_transformers(args: EngineArgs, work: list[tuple[list[int], int]], batch_size: int,
                     dtype: torch.dtype, device: str = "cpu") -> Result:
    """transformers' generate as a user batches it: input order, left padding, each
    batch running to its longest request; one untimed short generate warms up."""
    model = load_hf_model(args, dtype).to(device).eval()
    pad = 0
    tokens: list[list[int]] = []

    def generate(batch: list[tuple[list[int], int]]) -> None:
        longest_prompt = max(len(p) for p, _ in batch)
        longest_output = max(n for _, n in batch)
        ids = torch.tensor([[pad] * (longest_prompt - len(p)) + p for p, _ in batch],
                           device=device)
        mask = torch.tensor([[0] * (longest_prompt - len(p)) + [1] * len(p)
                             for p, _ in batch], device=device)
        out = model.generate(ids, attention_mask=mask, do_sample=False, pad_token_id=pad,
                             max_new_tokens=longest_output, min_new_tokens=longest_output)
        tokens.extend(row[longest_prompt:longest_prompt + n].tolist()
                      for row, (_, n) in zip(out, batch, strict=True))

    def sync() -> None:
        if torch.device(device).type == "cuda":
            torch.cuda.synchronize(device)

    with torch.inference_mode():
        generate([(p[:16], 4) for p, _ in work[:2]])
        tokens.clear()
        sync()
        start = time.perf_counter()
        for i in range(0, len(work), batch_size):
            generate(work[i:i + batch_size])
        sync()
        seconds = time.perf_counter() - start
    return result("transformers", seconds, work, tokens)


def run_ctranslate2(model_dir: Path, work: list[tuple[list[int], int]], batch_size: int,
                    dtype: torch.dtype, threads: int) -> Result:
    """CTranslate2's Generator on the same checkpoint (converted once, cached beside
    it), batched as transformers is; min_length = max_length forces every token."""
    import ctranslate2
    from ctranslate2.converters import TransformersConverter

    quantization = {torch.float32: "float32", torch.bfloat16: "bfloat16",
                    torch.float16: "float16"}[dtype]
    converted = model_dir.with_name(model_dir.name + f"-ct2-{quantization}")
    if not (converted / "model.bin").exists():
        TransformersConverter(str(model_dir)).convert(str(converted), quantization=quantization)
    generator = ctranslate2.Generator(str(converted), device="cpu", compute_type=quantization,
                                      intra_threads=threads)
    tokens: list[list[int]] = []

    def generate(batch: list[tuple[list[int], int]]) -> None:
        longest_output = max(n for _, n in batch)
        results = generator.generate_batch(
            [[f"t{i}" for i in p] for p, _ in batch], max_length=longest_output,
            min_length=longest_output, sampling_topk=1, include_prompt_in_result=False,
            max_batch_size=batch_size)
        tokens.extend(r.sequences_ids[0][:n] for r, (_, n) in zip(results, batch, strict=True))

    generate([(p[:16], 4) for p, _ in work[:2]])
    tokens.clear()
    start = time.perf_counter()
    for i in range(0, len(work), batch_size):
        generate(work[i:i + batch_size])
    seconds = time.perf_counter() - start
    return result("ctranslate2", seconds, work, tokens)


# --------------------------------------------------------------------------- the machine


def machine_peaks(threads: int) -> dict[str, float]:
    """fp32 GEMM FLOP/s and memory read bandwidth, with `threads` torch threads: the best
    of a few 2048^3 GEMMs through aten (MKL) and through oneDNN, whichever is faster
    here (the engine uses both), and of a few sums over 1 GiB."""
    from pagellm.executor.model.linear import ONEDNN_LINEAR

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        n = 2048
        a, b = torch.randn(n, n), torch.randn(n, n)
        mkl = min(_timed(lambda: torch.mm(a, b)) for _ in range(5))
        onednn = min(_timed(lambda: ONEDNN_LINEAR(a, b, None, "none", [], ""))
                     for _ in range(5)) if ONEDNN_LINEAR is not None else mkl
        big = torch.ones(2**28)  # 1 GiB of fp32
        read = min(_timed(big.sum) for _ in range(5))
    finally:
        torch.set_num_threads(saved)
    return {"gemm_flops": 2 * n**3 / min(mkl, onednn), "mkl_gemm_flops": 2 * n**3 / mkl,
            "onednn_gemm_flops": 2 * n**3 / onednn, "read_bytes_per_s": big.numel() * 4 / read}


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def model_costs(model_dir: str, element_size: int) -> dict[str, int]:
    """Multiply-adds per token of the linear layers (the LM head separately: it runs only
    for positions that sample) and the weight bytes a batch-1 decode step reads."""
    from decode_roofline import bytes_per_decode_step
    from transformers import AutoConfig

    text = AutoConfig.from_pretrained(model_dir).get_text_config()
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // text.num_attention_heads
    h, layers = text.hidden_size, text.num_hidden_layers
    qkv = h * head_dim * (text.num_attention_heads + 2 * text.num_key_value_heads)
    per_layer = qkv + text.num_attention_heads * head_dim * h + 3 * h * text.intermediate_size
    return {"body_macs_per_token": layers * per_layer, "head_macs": h * text.vocab_size,
            "weight_bytes": bytes_per_decode_step(model_dir, element_size, 0)["weight_bytes"]}


def utilisation(r: Result, work: list[tuple[list[int], int]], costs: dict[str, int],
                peaks: dict[str, float]) -> dict[str, float]:
    """The useful model FLOP/s (every prompt and output token through the body, the head
    once per output token) as a fraction of the GEMM peak; for one request, also the
    weight bytes read per second as a fraction of the read bandwidth."""
    prompt_tokens = sum(len(p) for p, _ in work)
    output_tokens = sum(n for _, n in work)
    flops = 2 * (costs["body_macs_per_token"] * (prompt_tokens + output_tokens)
                 + costs["head_macs"] * output_tokens) / r.seconds
    shares = {"model_gflops": flops / 1e9, "gemm_peak_fraction": flops / peaks["gemm_flops"]}
    if len(work) == 1:
        read = costs["weight_bytes"] * r.output_tokens_per_s
        shares |= {"weight_gbps": read / 1e9,
                   "read_bandwidth_fraction": read / peaks["read_bytes_per_s"]}
    return shares


def agreement(a: list[list[int]], b: list[list[int]]) -> float:
    """Fraction of output positions where two engines' greedy tokens agree, up to the
    first difference of each request (after it, the contexts differ)."""
    same = total = 0
    for x, y in zip(a, b, strict=True):
        total += len(x)
        for s, t in zip(x, y, strict=False):
            if s != t:
                break
            same += 1
    return same / max(total, 1)


# --------------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    EngineArgs.add_cli_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64)
    parser.add_argument("--input-len", type=int, nargs=2, default=(32, 256),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--output-len", type=int, nargs=2, default=(16, 128),
                        metavar=("MIN", "MAX"))
    parser.add_argument("--workload-seed", type=int, default=0)
    parser.add_argument("--hf-batch-size", type=int, default=16,
                        help="requests per batch for transformers and CTranslate2")
    parser.add_argument("--peers", nargs="*", choices=PEERS, default=["transformers"],
                        help="engines to compare with (none: pagellm alone)")
    parser.add_argument("--no-hf", action="store_true", help="same as --peers with none")
    parser.add_argument("--output-json", type=Path, default=None)
    ns = parser.parse_args(argv)
    args = resolve_model(EngineArgs.from_cli_args(ns))
    peers = [] if ns.no_hf else ns.peers

    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(args.model)
    dtype = (config.dtype or torch.float32) if args.dtype == "auto" \
        else getattr(torch, args.dtype)
    if args.load_format == "dummy" and args.device in ("auto", "cpu"):
        # One checkpoint for every engine (and comparable tokens): see the docstring.
        args = args.replace(model=str(materialize(args.model, dtype, args.seed)),
                            load_format="auto")
    work = make_workload(ns.num_prompts, tuple(ns.input_len), tuple(ns.output_len),
                         config.vocab_size, ns.workload_seed)
    threads = torch.get_num_threads()
    peaks = machine_peaks(threads)
    results = [run_pagellm(args, work)]
    if "transformers" in peers:
        results.append(run_transformers(args, work, ns.hf_batch_size, dtype))
    if "ctranslate2" in peers:
        results.append(run_ctranslate2(Path(args.model), work, ns.hf_batch_size, dtype,
                                       threads))
    costs = model_costs(args.model, torch.empty((), dtype=dtype).element_size())

    print(f"{len(work)} requests, prompt {ns.input_len[0]}-{ns.input_len[1]} tokens, "
          f"output {ns.output_len[0]}-{ns.output_len[1]} tokens, model {args.model}")
    print(f"machine ({threads} threads): GEMM {peaks['gemm_flops'] / 1e9:.0f} GFLOP/s "
          f"(MKL {peaks['mkl_gemm_flops'] / 1e9:.0f}, oneDNN "
          f"{peaks['onednn_gemm_flops'] / 1e9:.0f}), read "
          f"{peaks['read_bytes_per_s'] / 1e9:.1f} GB/s")
    print(f"{'engine':<14}{'seconds':>9}{'out tok/s':>11}{'GFLOP/s':>9}{'of peak':>9}"
          f"{'GB/s read':>11}{'of peak':>9}{'pagellm is':>12}{'same tokens':>13}")
    pagellm = results[0]
    rows = []
    for r in results:
        u = utilisation(r, work, costs, peaks)
        ratio = pagellm.output_tokens_per_s / r.output_tokens_per_s
        same = agreement(pagellm.tokens, r.tokens)
        rows.append({**r.summary(), **u, "pagellm_ratio": ratio, "token_agreement": same})
        read = (f"{u['weight_gbps']:>11.1f}{u['read_bandwidth_fraction']:>9.0%}"
                if "weight_gbps" in u else f"{'':>20}")
        print(f"{r.engine:<14}{r.seconds:>9.2f}{r.output_tokens_per_s:>11.1f}"
              f"{u['model_gflops']:>9.1f}{u['gemm_peak_fraction']:>9.0%}{read}"
              f"{ratio:>11.2f}x{same:>13.1%}")
    if ns.output_json:
        ns.output_json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d"), "machine": platform.platform(),
            "cpu_threads": threads, "torch": torch.__version__, "peaks": peaks,
            "costs": costs, "engine_args": asdict(args), "num_prompts": ns.num_prompts,
            "input_len": ns.input_len, "output_len": ns.output_len,
            "hf_batch_size": ns.hf_batch_size, "results": rows}, indent=2))


if __name__ == "__main__":
    main()
