"""The server as real evaluation and benchmark clients drive it, against a live `pagellm
serve` (issue #18): lm-evaluation-harness's `local-completions` model on a small local
task suite, compared per sample with lm-eval's own `hf` backend on the same weights, and
a guidellm streaming benchmark. Both packages come with the `test` extra: a missing one
fails this module at collection, it is never skipped."""

from __future__ import annotations

import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

# Everything here is local (model directories, JSONL data): nothing may reach for the Hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import lm_eval
import pytest
from conftest import PROMPTS
from helpers import NAME, Server
from lm_eval.models.openai_completions import LocalCompletionsAPI
from lm_eval.tasks import TaskManager

pytestmark = pytest.mark.slow

# guidellm runs as its CLI, in its own process: importing it here would install uvloop's
# event loop policy in this one, under every later test.
if importlib.util.find_spec("guidellm") is None:
    raise ImportError("guidellm is not installed: pip install -e '.[test]'")

MODEL = "llama"
# fp32 on both sides; what differs is the order of summation, so a sum over a whole text
# (loglikelihood_rolling: hundreds of tokens) may differ by a few fp32 ulps of its size.
LOGPROB_ABS_TOL, LOGPROB_REL_TOL = 1e-4, 1e-6
GREEDY_TOKENS = 3
MAX_GEN_TOKS = 16
UNTIL = ["\n", "####", "True"]  # strings this random-weight model does emit

TASKS = {  # name: output type
    "pagellm_ll": "loglikelihood",
    "pagellm_mc": "multiple_choice",
    "pagellm_ppl": "loglikelihood_rolling",
    "pagellm_gen": "generate_until",
}

MC_ROWS = [
    {"question": "The capital of France is", "choices": [" Paris", " London", " 42"],
     "answer": 0},
    {"question": "def fibonacci(n):\n    if n < 2:\n",
     "choices": ["        return n", "    pass", " import os"], "answer": 0},
    {"question": "Once upon a time,", "choices": [" there lived a king.", " the end."],
     "answer": 1},
    {"question": "a b c d e f", "choices": [" g", " h", " z y x"], "answer": 0},
    {"question": "import numpy as", "choices": [" np", " pd", " torch"], "answer": 0},
    {"question": "日本語のテキスト", "choices": ["と English", " ümlauts", "!"], "answer": 0},
]


def task_yaml(name: str, data: Path, cache: Path) -> str:
    """An lm-eval task config over a local JSONL file (the `datasets` json loader)."""
    head = {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(data)}, "cache_dir": str(cache)},
        "test_split": "test",
        "output_type": TASKS[name],
    }
    body: dict[str, Any] = {
        "pagellm_ll": {"doc_to_text": "{{context}}", "doc_to_target": "{{continuation}}",
                       "target_delimiter": "", "metric_list": [{"metric": "acc"}]},
        "pagellm_mc": {"doc_to_text": "{{question}}", "doc_to_choice": "{{choices}}",
                       "doc_to_target": "{{answer}}", "target_delimiter": "",
                       "metric_list": [{"metric": "acc"}]},
        "pagellm_ppl": {"doc_to_text": "", "doc_to_target": "{{text}}",
                        "metric_list": [{"metric": "word_perplexity"}]},
        "pagellm_gen": {"doc_to_text": "{{prompt}}", "doc_to_target": "{{target}}",
                        "target_delimiter": "",
                        "generation_kwargs": {"until": UNTIL, "max_gen_toks": MAX_GEN_TOKS,
                                              "do_sample": False},
                        "metric_list": [{"metric": "exact_match"}]},
    }[name]
    # JSON is YAML: no YAML writer needed, and no quoting rules to get wrong.
    return json.dumps({**head, **body}, ensure_ascii=False, indent=1)


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory, model_dirs, hf_reference) -> Path:
    """Four tiny tasks, one per lm-eval request type. The loglikelihood task pairs each
    prompt with its greedy continuation under transformers (is_greedy true, where the
    decoded text tokenizes back to the same ids) and with a fixed one (is_greedy false),
    so that both values of the flag are compared."""
    from transformers import AutoTokenizer

    root = tmp_path_factory.mktemp("lm_eval_tasks")
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[MODEL])
    ll_rows = []
    for prompt in PROMPTS:
        ids = tokenizer.encode(prompt)
        greedy = hf_reference(MODEL, ids, GREEDY_TOKENS)
        text = tokenizer.decode(greedy)
        if tokenizer.encode(prompt + text) == ids + greedy:
            ll_rows.append({"context": prompt, "continuation": text})
        ll_rows.append({"context": prompt, "continuation": " and then the end."})
    assert sum(r["continuation"] != " and then the end." for r in ll_rows) >= 4, ll_rows
    rows = {
        "pagellm_ll": ll_rows,
        "pagellm_mc": MC_ROWS,
        "pagellm_ppl": [{"text": p} for p in PROMPTS[1:7]],
        "pagellm_gen": [{"prompt": p, "target": ""} for p in PROMPTS],
    }
    for name, data in rows.items():
        path = root / f"{name}.jsonl"
        path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in data))
        (root / f"{name}.yaml").write_text(task_yaml(name, path, root / "datasets-cache"))
    return root


def evaluate(task_dir: Path, model: Any, **model_args: Any) -> dict[str, list[dict]]:
    """lm-eval's per-sample results for every task, each task's samples by doc_id. The
    global seeds are left alone (lm-eval would reseed this process's RNGs)."""
    results = lm_eval.simple_evaluate(
        model=model, model_args=model_args or None, tasks=list(TASKS), batch_size=1,
        task_manager=TaskManager(include_path=str(task_dir)), log_samples=True,
        random_seed=None, numpy_random_seed=None, torch_random_seed=None)
    assert results is not None
    return {task: sorted(samples, key=lambda s: s["doc_id"])
            for task, samples in results["samples"].items()}


@pytest.fixture(scope="module")
def server(model_dirs):
    s = Server(model_dirs[MODEL], "--dtype", "float32")
    yield s
    assert s.stop() == 0


@pytest.fixture(scope="module")
def hf_results(task_dir, model_dirs) -> dict[str, list[dict]]:
    """The reference: lm-eval's transformers backend on the same weights, fp32 on the CPU,
    one request at a time (no padding)."""
    return evaluate(task_dir, "hf", pretrained=str(model_dirs[MODEL]), dtype="float32",
                    device="cpu")


def compare(reference: dict[str, list[dict]], served: dict[str, list[dict]]) -> dict:
    """Assert per-sample agreement; return what was compared and how closely."""
    stats = {"requests": 0, "loglikelihood_max_abs_diff": 0.0, "rolling_max_abs_diff": 0.0,
             "rolling_max_rel_diff": 0.0, "greedy_true": 0, "greedy_false": 0,
             "generations": 0}

    def close(have: float, want: float, kind: str) -> bool:
        key = "rolling" if kind == "loglikelihood_rolling" else "loglikelihood"
        stats[f"{key}_max_abs_diff"] = max(stats[f"{key}_max_abs_diff"], abs(have - want))
        if key == "rolling":
            stats["rolling_max_rel_diff"] = max(stats["rolling_max_rel_diff"],
                                                abs(have - want) / abs(want))
        return math.isclose(have, want, rel_tol=LOGPROB_REL_TOL, abs_tol=LOGPROB_ABS_TOL)

    assert served.keys() == reference.keys() == TASKS.keys()
    for task, kind in TASKS.items():
        assert [s["doc_id"] for s in served[task]] == [s["doc_id"] for s in reference[task]]
        for ref, got in zip(reference[task], served[task], strict=True):
            assert got["arguments"] == ref["arguments"], (task, ref["doc_id"])
            for ref_resp, got_resp in zip(ref["resps"], got["resps"], strict=True):
                (want,), (have,) = ref_resp, got_resp  # one repeat each
                stats["requests"] += 1
                where = (task, ref["doc_id"], want, have)
                if kind == "generate_until":
                    assert have == want, where
                    stats["generations"] += 1
                elif kind == "loglikelihood_rolling":
                    assert close(float(have), float(want), kind), where
                else:
                    (ll_want, greedy_want), (ll_have, greedy_have) = want, have
                    assert close(float(ll_have), float(ll_want), kind), where
                    assert bool(greedy_have) == bool(greedy_want), where
                    stats["greedy_true" if greedy_want else "greedy_false"] += 1
    return stats


def test_hf_reference_exercises_every_path(hf_results, model_dirs, hf_reference):
    """The reference run is not degenerate: some loglikelihood requests are greedy and
    some are not, and some generations end at a stop string before max_gen_toks."""
    from transformers import AutoTokenizer

    flags = [bool(r[0][1]) for s in hf_results["pagellm_ll"] for r in s["resps"]]
    assert any(flags) and not all(flags), flags
    tokenizer = AutoTokenizer.from_pretrained(model_dirs[MODEL])
    stopped = 0
    for sample in hf_results["pagellm_gen"]:
        (text,), = sample["resps"]
        full = tokenizer.decode(hf_reference(MODEL, tokenizer.encode(sample["doc"]["prompt"]),
                                             MAX_GEN_TOKS), skip_special_tokens=True)
        assert full.startswith(text)
        if any(u in full for u in UNTIL):  # cut at the first stop string
            assert len(text) < len(full)
            stopped += 1
    assert stopped >= 2, stopped


@pytest.mark.parametrize("tokenizer_backend", ["huggingface", "remote"])
def test_lm_eval_local_completions_equals_hf_backend(server, hf_results, task_dir,
                                                      model_dirs, tokenizer_backend):
    """lm-eval's `local-completions` against the server gives lm-eval's `hf` results per
    sample: loglikelihoods (echoed prompt logprobs) within fp32 tolerance, the same is_greedy
    flags (top-1 prompt logprobs), the same generations (stop strings applied by the
    server). With the remote tokenizer lm-eval tokenizes through /tokenizer_info,
    /tokenize and /detokenize, and it batches 4 prompts a request, 2 requests at once."""
    url = f"{server.url}/v1/completions"
    if tokenizer_backend == "huggingface":
        lm = LocalCompletionsAPI(model=NAME, base_url=url, tokenizer_backend="huggingface",
                                 tokenizer=str(model_dirs[MODEL]), max_retries=1)
    else:  # lm-eval's default, "auto", must find the server's tokenizer endpoints
        lm = LocalCompletionsAPI(model=NAME, base_url=url, max_retries=1, batch_size=4,
                                 num_concurrent=2)
        assert lm.tokenizer_backend == "remote"
    stats = compare(hf_results, evaluate(task_dir, lm))
    print(f"\nlm-eval {tokenizer_backend}: {stats}")
    assert stats["generations"] == len(PROMPTS) and stats["requests"] >= 50
    assert stats["greedy_true"] >= 4 and stats["greedy_false"] >= 4


GUIDELLM_REQUESTS = 6
PROMPT_TOKENS, OUTPUT_TOKENS = 32, 16


@pytest.mark.parametrize("request_format", ["/v1/chat/completions", "/v1/completions"])
def test_guidellm_streaming_benchmark(server, model_dirs, tmp_path, request_format):
    """A short guidellm run (streaming, continuous usage stats, two concurrent streams,
    synthetic prompts from the local tokenizer): every request succeeds with exactly the
    tokens asked for, the usage the server streams counts the prompt as the model's
    tokenizer does, and the throughput table is non-zero."""
    from transformers import AutoTokenizer

    report = tmp_path / "benchmarks.json"
    cmd = [sys.executable, "-m", "guidellm", "run",
           "--backend", f"kind=openai_http,target={server.url},model={NAME},"
                        f"request_format={request_format}",
           "--profile", "kind=concurrent,streams=2",
           "--constraint", f"kind=max_requests,count={GUIDELLM_REQUESTS}",
           "--data", f"kind=synthetic_text,prompt_tokens={PROMPT_TOKENS},"
                     f"output_tokens={OUTPUT_TOKENS}",
           "--tokenizer", f"kind=huggingface_auto,model={model_dirs[MODEL]}",
           "--output", f"kind=json,path={report}",
           "--disable-console-interactive"]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "COLUMNS": "250"}
    run = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]

    (benchmark,) = json.loads(report.read_text())["benchmarks"]
    metrics = benchmark["metrics"]
    assert metrics["request_totals"] == {"successful": GUIDELLM_REQUESTS, "errored": 0,
                                         "incomplete": 0, "total": GUIDELLM_REQUESTS}
    throughput = metrics["output_tokens_per_second"]["successful"]["mean"]
    assert throughput > 0

    tokenizer = AutoTokenizer.from_pretrained(model_dirs[MODEL])
    for request in benchmark["requests"]["successful"]:
        body = json.loads(request["request_args"])["body"]
        assert body["stream"] is True
        assert body["stream_options"] == {"include_usage": True,
                                          "continuous_usage_stats": True}
        if request_format == "/v1/chat/completions":
            messages = [{"role": m["role"], "content": "".join(
                part["text"] for part in m["content"])} for m in body["messages"]]
            prompt_ids = tokenizer.apply_chat_template(
                messages, add_generation_prompt=True, tokenize=True, return_dict=False)
        else:
            prompt_ids = tokenizer.encode(body["prompt"])
        assert request["input_metrics"]["text_tokens"] == len(prompt_ids)
        assert request["output_metrics"]["text_tokens"] == OUTPUT_TOKENS
    # It streamed. Not every request in pieces: a stream whose reader falls behind gets
    # what is ready as one chunk (vLLM's coalescing too), and 16 tokens take ~15 ms here.
    iterations = [r["info"]["timings"]["token_iterations"]
                  for r in benchmark["requests"]["successful"]]
    assert max(iterations) > 1, iterations

    # The console's throughput table, as a user reads it: every rate is non-zero.
    table = run.stdout.split("Server Throughput Statistics", 1)[1]
    row = next(line for line in table.splitlines() if line.startswith("| concurrent"))
    rates = [float(cell) for cell in re.findall(r"\|\s*([0-9.]+)\s*(?=\|)", row)]
    assert len(rates) == 6 and all(rate > 0 for rate in rates), row
    print(f"\nguidellm {request_format}: {throughput:.1f} output tokens/s; {row}")
