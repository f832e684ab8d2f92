"""Converting a GGUF file (pagellm/weights/gguf.py): its time and peak memory, against the
fp32 bytes of the model it holds. The conversion runs once per file, the first time a
`.gguf` model is named, and used to load the whole model through transformers in fp32:
28 GB of host memory for a 7B file, more than most machines that run 7B files on a CPU
have. It now reads, converts and writes a tensor at a time (shards of SHARD_BYTES).

The file is written here with random weights at a larger shape than the tests' (the body
of Llama-3.2-1B by default: 16 layers of hidden 2048 and MLP 8192, 973M parameters; the
demo tokenizer's 1,024 tokens, so its embedding is small), its projections in each of
--types (tests/support/gguf_files.py's writer, as llama.cpp's convert_hf_to_gguf.py
lays a file out). Each conversion runs in a fresh process into a fresh cache; its peak
RSS is its VmHWM (Linux; imports included: getrusage's maxrss would carry over the
parent's from before the exec). Each row names the pagellm it ran (another commit: an
editable install of its checkout).

    pip install gguf
    python benchmarks/gguf_convert.py                    # Q8_0 and Q4_0, the 1B body
    python benchmarks/gguf_convert.py --layers 4 --types Q4_1 --work /tmp/gguf-bench
    python benchmarks/gguf_convert.py --layers 2 --hidden 256 --intermediate 512 \
        --heads 4 --kv-heads 2 --out c.json                  # seconds, as the tests run it
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
CHILD = """
import json, sys, time
from pathlib import Path
import pagellm
from pagellm.weights.gguf import gguf_model_dir
start = time.perf_counter()
directory = gguf_model_dir(Path(sys.argv[1]))
seconds = time.perf_counter() - start
hwm = next(line for line in open("/proc/self/status") if line.startswith("VmHWM"))
print(json.dumps({"seconds": seconds, "peak_rss_gb": int(hwm.split()[1]) / 2**20,
    "pagellm": pagellm.__file__,
    "output_gb": sum(f.stat().st_size for f in directory.iterdir()) / 2**30}))
"""


def write_file(work: Path, args: argparse.Namespace, qtype: str) -> tuple[Path, int]:
    """The model (built once into `work`) as a GGUF of projection type `qtype`, and its
    parameter count."""
    sys.path.insert(0, str(ROOT / "tests" / "support"))
    from gguf_files import write_gguf

    from pagellm.demo.model import ModelSpec, make_model

    model = work / "model"
    if not (model / "config.json").is_file():
        make_model(model, ModelSpec(
            arch="llama", hidden_size=args.hidden, num_layers=args.layers,
            num_heads=args.heads, num_kv_heads=args.kv_heads,
            intermediate_size=args.intermediate, vocab_size=1024, init_std=0.02))
    config = json.loads((model / "config.json").read_text())
    hidden, layers, inter = config["hidden_size"], config["num_hidden_layers"], \
        config["intermediate_size"]
    kv = hidden // config["num_attention_heads"] * config["num_key_value_heads"]
    params = layers * (hidden * (2 * hidden + 2 * kv) + 3 * hidden * inter) \
        + 2 * 1024 * hidden
    path = work / f"model-{qtype}.gguf"
    if not path.is_file():
        write_gguf(model, path, qtype)
    return path, params


def convert(path: Path, cache: Path) -> dict[str, Any]:
    """`path` converted by a fresh process into the empty cache `cache`."""
    shutil.rmtree(cache, ignore_errors=True)
    env = {**os.environ, "PAGELLM_CACHE": str(cache)}
    try:
        done = subprocess.run([sys.executable, "-c", CHILD, str(path)], env=env,
                              capture_output=True, text=True, check=True, timeout=3600)
    except subprocess.CalledProcessError as e:
        raise SystemExit(f"the conversion of {path} failed:\n{e.stderr[-3000:]}") from e
    finally:
        shutil.rmtree(cache, ignore_errors=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=8192)
    parser.add_argument("--heads", type=int, default=32)
    parser.add_argument("--kv-heads", type=int, default=8)
    parser.add_argument("--types", nargs="+", default=["Q8_0", "Q4_0"])
    parser.add_argument("--work", type=Path, default=None,
                        help="where the model and its files are written (kept, and "
                             "reused by the next run); default a temporary directory")
    parser.add_argument("--out", type=Path, default=None, help="the rows as JSON")
    args = parser.parse_args(argv)
    work = args.work or Path(tempfile.mkdtemp(prefix="gguf-convert-"))
    work.mkdir(parents=True, exist_ok=True)
    rows = {}
    try:
        for qtype in args.types:
            path, params = write_file(work, args, qtype)
            result = convert(path, work / "cache")
            result.update(params=params, fp32_gb=params * 4 / 2**30,
                          file_gb=path.stat().st_size / 2**30)
            rows[qtype] = result
            print(f"{qtype}: {params / 1e6:.0f}M parameters ({result['fp32_gb']:.2f} GB in "
                  f"fp32), file {result['file_gb']:.2f} GB: converted in "
                  f"{result['seconds']:.1f} s, peak RSS {result['peak_rss_gb']:.2f} GB, "
                  f"directory {result['output_gb']:.2f} GB ({result['pagellm']})",
                  flush=True)
    finally:
        if args.work is None:
            shutil.rmtree(work, ignore_errors=True)
    if args.out is not None:
        args.out.write_text(json.dumps(rows, indent=2))
    return rows


if __name__ == "__main__":
    main()
