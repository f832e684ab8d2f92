"""The benchmark scripts, in their CPU smoke forms: CI proves that they run, that a
wrong kernel cannot report a speed, and that their JSON has what a GPU session will read,
before a GPU session spends its scarce time on them."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from background import Job
from conftest import runs_triton_kernels

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # benchmarks/ is scripts, not a package

import async_scheduling  # noqa: E402
import bad_words  # noqa: E402
import cpu_quantized  # noqa: E402
import decode_roofline  # noqa: E402
import engine_overhead  # noqa: E402
import gguf_convert  # noqa: E402
import gpu_suite  # noqa: E402
import kernel_bench  # noqa: E402
import moe_layer  # noqa: E402
import parallel  # noqa: E402
import profile_decode  # noqa: E402
import quant_quality  # noqa: E402
import small_gemm  # noqa: E402
import spec_decode  # noqa: E402
import structured_outputs  # noqa: E402

CASE_TIMINGS = ("kernel_us", "kernel_gbps", "kernel_pct_of_copy", "sdpa_us", "sdpa_gbps",
                "sdpa_pct_of_copy", "speedup_vs_sdpa")


def run_json(main: Any, argv: list[str], path: Path) -> dict[str, Any]:
    """Run a benchmark's main with --output-json; the file must hold what it returned."""
    results = main([*argv, "--output-json", str(path)])
    assert json.loads(path.read_text()) == json.loads(json.dumps(results))
    return results


def assert_kernel_results(results: dict[str, Any], num_cases: int) -> None:
    assert results["benchmark"] == "kernel_bench" and results["smoke"] is True
    for key in ("date", "device", "torch", "triton", "copy_bandwidth_gbps", "timing",
                "sdpa_variant", "target_pct_of_copy", "skipped"):
        assert key in results, key
    assert results["copy_bandwidth_gbps"] > 0
    assert len(results["cases"]) == num_cases
    for case in results["cases"]:
        assert case["matches_reference"] is True, case
        assert case["max_rel_err"] <= case["tolerance"] == kernel_bench.TOLERANCE[
            kernel_bench.torch.float32]
        assert all(case[k] > 0 for k in CASE_TIMINGS), case


@runs_triton_kernels
def test_kernel_bench_smoke_matches_sdpa_and_reports_bandwidth(tmp_path):
    results = run_json(kernel_bench.main, ["--smoke"], tmp_path / "kernel.json")
    assert_kernel_results(results, num_cases=4)
    assert {(c["batch"], c["context"]) for c in results["cases"]} == {
        (1, 20), (2, 20), (1, 40), (2, 40)}
    case = results["cases"][0]
    # K and V of every context token (4 bytes each in fp32) + queries read + outputs written
    assert case["bytes_moved"] == (case["batch"] * case["context"] * 2 * 2 * 16 * 4
                                   + 2 * case["batch"] * 4 * 16 * 4)


@runs_triton_kernels
def test_kernel_bench_split_kv_matches_sdpa_and_skips_over_budget(tmp_path):
    results = run_json(kernel_bench.main, ["--smoke", "--num-segments", "2", "--batches",
                                           "3", "--contexts", "40", "100000",
                                           "--max-kv-gib", "0.01"], tmp_path / "k.json")
    assert_kernel_results(results, num_cases=1)
    assert results["cases"][0]["num_segments"] == 2
    assert [(s["batch"], s["context"]) for s in results["skipped"]] == [(3, 100000)]


@runs_triton_kernels
def test_kernel_bench_reports_no_speed_for_a_wrong_kernel(tmp_path, monkeypatch):
    from pagellm.kernels import triton_attention

    real = triton_attention.paged_attention

    def off_by_a_bit(*args: Any, **kwargs: Any) -> Any:
        return real(*args, **kwargs) * 1.01

    monkeypatch.setattr(triton_attention, "paged_attention", off_by_a_bit)
    path = tmp_path / "kernel.json"
    with pytest.raises(AssertionError, match="differs from SDPA"):
        kernel_bench.main(["--smoke", "--batches", "2", "--contexts", "40",
                           "--output-json", str(path)])
    (case,) = json.loads(path.read_text())["cases"]
    assert case["matches_reference"] is False and case["max_rel_err"] > case["tolerance"]
    assert not set(CASE_TIMINGS) & set(case)


def test_decode_bytes_per_step_of_qwen25_05b_counts_the_tied_embedding_once():
    traffic = decode_roofline.bytes_per_decode_step(
        str(BENCHMARKS / "configs" / "qwen2.5-0.5b"), element_size=2, context=1000)
    assert traffic["tied_embeddings"] is True
    assert traffic["num_params"] == 494_032_768  # Qwen2.5-0.5B's published 0.49B
    assert traffic["weight_bytes"] == 2 * 494_032_768
    # 24 layers x K,V x 2 KV heads x head_dim 64 x 2 bytes per token
    assert traffic["kv_bytes_per_step"] == 24 * 2 * 2 * 64 * 2 * 1000
    assert traffic["bytes_per_step"] == traffic["weight_bytes"] + traffic["kv_bytes_per_step"]


def test_decode_roofline_smoke_measures_decode_against_the_roofline(tmp_path):
    results = run_json(decode_roofline.main, ["--smoke"], tmp_path / "decode.json")
    assert results["benchmark"] == "decode_roofline" and results["model"] == "demo"
    assert results["engine_args"]["dtype"] == "float32"
    assert results["engine_args"]["device"] == "cpu"
    assert results["long_len"] == results["short_len"] + 8
    assert len(results["short_s"]) == len(results["long_s"]) == results["repeats"]
    # The demo model's input embedding is untied: a step reads one row of it (fp32).
    config = json.loads((Path(results["engine_args"]["model"]) / "config.json").read_text())
    assert results["tied_embeddings"] is False
    assert results["weight_bytes"] == 4 * (results["num_params"] - (config["vocab_size"] - 1)
                                           * config["hidden_size"])
    assert results["roofline_tokens_per_s"] == pytest.approx(
        results["copy_bandwidth_gbps"] * 1e9 / results["bytes_per_step"])
    if results["decode_tokens_per_s"] is not None:  # None only if noise beat 8 tokens
        assert results["pct_of_roofline"] == pytest.approx(
            100 * results["decode_tokens_per_s"] / results["roofline_tokens_per_s"])


@pytest.mark.parametrize("fused", [True, False], ids=["fused", "torch-ops"])
def test_profile_decode_smoke_counts_each_decode_steps_matmuls(tmp_path, monkeypatch, fused):
    """The difference of two profiled generates over the decode steps between them: the
    demo model's steps each run one fused decode step (executor/worker/cpu_decode.py)
    or, through torch's ops, 4 matmuls a layer (fused QKV, output, fused gate-up, down),
    and the lm_head for the one sampled row, so any other count means the prefill did
    not cancel or the steps were miscounted."""
    if not fused:
        monkeypatch.setenv("PAGELLM_CPU_DECODE", "0")  # (the smoke engine is in-process)
    results = run_json(profile_decode.main, ["--smoke"], tmp_path / "profile.json")
    assert results["benchmark"] == "profile_decode" and results["decode_steps"] == 4
    config = json.loads((Path(results["model"]) / "config.json").read_text())
    # The op a one-row GEMM is on this CPU and torch (cpu_linear.choose): W @ x^T, or
    # F.linear, or oneDNN's linear where this torch has it.
    import torch

    from pagellm.executor.model import linear as cpu_linear

    way = cpu_linear.choose(1, config["hidden_size"], torch.float32, cpu_linear.THIS_CPU)
    op = {"W_XT": "aten::mm", "ATEN": "aten::linear",
          "ONEDNN": "mkldnn::_linear_pointwise"}[way.name]
    per_step = {r["kernel"]: r["launches_per_step"] for r in results["kernels"]}
    layers = 0 if fused else config["num_hidden_layers"]
    assert per_step[op] == 4 * layers + 1
    assert per_step.get("pagellm_cpu::decode_layers", 0) == (1 if fused else 0)


def test_gpu_suite_parts_select_by_name_or_kind():
    parser = gpu_suite.argparse.ArgumentParser()
    assert [p.name for p in gpu_suite.select_parts(["kernel", "throughput-qwen2.5-0.5b"],
                                                   parser)] == [
        "kernel", "throughput-qwen2.5-0.5b"]
    decode = gpu_suite.select_parts(["decode"], parser)
    assert len(decode) == 4 and sum(p.enforce_eager for p in decode) == 2
    with pytest.raises(SystemExit):
        gpu_suite.select_parts(["nope"], parser)


def test_gpu_suite_merges_split_runs(tmp_path):
    for i, names in enumerate((["kernel"], ["decode-qwen2.5-0.5b", "kernel"])):
        (tmp_path / f"{i}.json").write_text(json.dumps(
            {"benchmark": "gpu_suite", "command": f"run {i}", "date": "d",
             "parts": {n: {"status": "ok", "run": i} for n in names}}))
    merged = gpu_suite.main(["--merge", str(tmp_path / "0.json"), str(tmp_path / "1.json"),
                             "--output-json", str(tmp_path / "all.json")])
    assert merged["parts"] == {"kernel": {"status": "ok", "run": 1},
                               "decode-qwen2.5-0.5b": {"status": "ok", "run": 1}}
    assert [m["command"] for m in merged["merged_from"]] == ["run 0", "run 1"]
    assert json.loads((tmp_path / "all.json").read_text()) == merged


def test_gpu_suite_kills_a_part_past_its_timeout():
    entry = gpu_suite.run_in_subprocess(gpu_suite.PARTS[0], smoke=True, timeout_s=0.2)
    assert entry["status"] == "timeout" and entry["returncode"] != 0
    assert entry["result"] is None and "output_tail" in entry


def test_gpu_suite_deadline_cuts_a_part_and_skips_the_rest(tmp_path, monkeypatch):
    """A device command must end inside its limit: the first part is killed when the
    deadline passes, the later ones are not started, and the JSON says so."""
    monkeypatch.setattr(gpu_suite, "MIN_PART_S", 0.1)
    out = tmp_path / "suite.json"
    results = gpu_suite.main(["--smoke", "--parts", "kernel", "decode-qwen2.5-0.5b",
                              "--deadline", "0.5", "--output-json", str(out)])
    kernel, decode = results["parts"]["kernel"], results["parts"]["decode-qwen2.5-0.5b"]
    assert kernel["status"] == "timeout" and kernel["seconds"] < 5
    assert decode["status"] == "skipped" and decode["seconds_left"] < 0.1
    assert json.loads(out.read_text())["parts"] == results["parts"]


def background_json(script: str, *argv: str) -> Callable[[Path], list[str]]:
    """A benchmark script's command line for a background job (tests/support/background.py)
    writing its JSON into the job's directory."""
    return lambda job_dir: [sys.executable, str(BENCHMARKS / script), *argv,
                            "--output-json", str(job_dir / "out.json")]


def job_json(job: Job) -> dict[str, Any]:
    result = job.result()
    assert result is not None and result.returncode == 0, result and result.stderr[-4000:]
    return json.loads((job.dir / "out.json").read_text())


GPU_SUITE_PARTS = ["tests", "kernel", "fused", "decode-qwen2.5-0.5b",
                   "decode-qwen2.5-0.5b-eager", "throughput-qwen2.5-0.5b"]
# tests/e2e/test_gpu.py's cases, counted by hand: 3 models x (graphs, eager), speculative
# decoding's 2 methods, async scheduling, graphs against eager, bf16 logprobs of 2
# models, host syncs, profiled KV-cache size, structured outputs, LoRA, DeepSeek-V3/V2
# and the newer families.
NUM_TEST_GPU_CASES = 3 * 2 + 2 + 1 + 1 + 2 + 1 + 1 + 1 + 1 + 12
# 30 s of work: started when collection ends, niced (tests/support/background.py).
GPU_SUITE = Job("test_gpu_suite_smoke_runs_each_kind_of_part_in_a_subprocess",
                background_json("gpu_suite.py", "--smoke", "--parts", *GPU_SUITE_PARTS))


@pytest.mark.skipif(kernel_bench.torch.cuda.is_available(), reason="--smoke runs on the GPU there")
def test_kernel_bench_smoke_says_why_the_interpreter_cannot_run(monkeypatch):
    from pagellm.kernels import triton_attention

    monkeypatch.setattr(triton_attention, "interpreter_fault", lambda: "the probe failed")
    with pytest.raises(SystemExit, match="interpreter on the CPU, which cannot run here: "
                                         "the probe failed"):
        kernel_bench.select_device(smoke=True)


@runs_triton_kernels
@pytest.mark.slow
def test_gpu_suite_smoke_runs_each_kind_of_part_in_a_subprocess():
    """One part of each kind, both decode modes: the smoke forms of one kind's parts are
    the same run (the CPU has no model-sized work to do), so the other three would add
    40 s to the suite and no coverage; kernel_bench's and decode_roofline's own smoke
    tests check their numbers."""
    parts = GPU_SUITE_PARTS
    results = job_json(GPU_SUITE)
    for key in ("date", "device", "torch", "triton", "transformers", "command"):
        assert key in results, key
    assert "--smoke" in results["command"]
    assert list(results["parts"]) == parts
    for name, entry in results["parts"].items():
        assert entry["status"] == "ok", entry.get("output_tail")
        r = entry["result"]
        if name == "tests":  # on the CPU, test_gpu.py's cases all skip
            assert r["benchmark"] == "tests" and r["files"] == ["tests/e2e/test_gpu.py"]
            assert (r["passed"], r["failed"], r["errors"], r["failures"]) == (0, 0, 0, [])
            assert r["skipped"] == NUM_TEST_GPU_CASES and r["returncode"] == 0
        elif name == "kernel":
            assert_kernel_results(r, num_cases=4)
        elif name == "fused":  # 3 ops x 2 row counts, each checked against torch
            assert r["benchmark"] == "fused_bench" and len(r["cases"]) == 6
            assert all(c["max_abs_diff"] < 1e-5 and c["fused_us"] > 0 for c in r["cases"])
        elif name.startswith("decode-"):
            assert r["benchmark"] == "decode_roofline"
            assert r["enforce_eager"] is name.endswith("-eager")
        else:
            assert r["benchmark"] == "throughput"
            pagellm, hf = r["results"]
            assert (pagellm["engine"], hf["engine"]) == ("pagellm", "transformers")
            assert r["workload"]["num_prompts"] == 4 and r["output_tokens"] > 0
            for engine in (pagellm, hf):
                assert engine["output_tokens_per_s"] == pytest.approx(
                    r["output_tokens"] / engine["seconds"])


@pytest.mark.slow
def test_parallel_smoke_runs_each_layout_to_the_same_tokens(tmp_path):
    """One device and two tensor-parallel ranks: the same greedy tokens (a layout that
    computed something else would be no benchmark; two cores of two ranks each are
    tests/frontend/test_data_parallel.py's). Not a background job: its all-reduce floor,
    measured between two niced processes, came out above a step's collectives while
    other tests ran."""
    results = run_json(parallel.main, ["--smoke", "--layouts", "tp1", "tp2"],
                       tmp_path / "parallel.json")
    assert [r["layout"] for r in results["results"]] == ["tp1dp1", "tp2dp1"]
    for r in results["results"]:
        assert r["same_tokens_as_first"] is True
        assert r["output_tokens"] == 4 * 8 and r["output_tokens_per_s"] > 0
    one, two = (r["step_ms"] for r in results["results"][:2])
    assert one["collective_s"] == one["dispatch_s"] == 0  # one rank: nothing to exchange
    assert two["collective_s"] > 0 and two["dispatch_s"] > 0
    # The bare all-reduce it is compared with: measured, and under a step's collectives
    # (a decode step of the smoke model makes 2 per layer, 2 layers, plus the embedding's).
    assert 0 < results["allreduce_floor_us"] < 1000 * two["collective_s"]


@pytest.mark.parametrize("logprobs", [None, 2])
def test_engine_overhead_frontend_alone_delivers_every_token_and_times_each_step(
        tmp_path, logprobs):
    """Every consumer must receive one token per step (asserted inside the run), else
    the takes it times are not the ones a stream needs."""
    from pagellm.demo.model import make_model

    model = make_model(tmp_path / "tiny", engine_overhead.TINY)
    processing, taking = engine_overhead.run_frontend_only(model, 8, 4, 5, logprobs)
    assert len(processing) == len(taking) == 5
    assert all(t > 0 for t in processing + taking)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_small_gemm_smoke_checks_every_way_agrees_and_reports_every_shape(capsys, dtype):
    small_gemm.main(["--out", "8", "24", "--in", "16", "--rows", "1", "3", "--repeats", "1",
                     "--dtype", dtype, "--max-copies", "4"])
    lines = capsys.readouterr().out.splitlines()
    rows = [line for line in lines if line.strip()[:1].isdigit()]
    assert [r.split()[:3] for r in rows] == [["8", "x", "16"], ["24", "x", "16"]]
    # Every way that computes this dtype here (the header names those that do not: no
    # packed weights without them in torch, no bf16 oneDNN on plain weights before
    # AVX-512, the GEMV for bf16 only).
    ways = len(small_gemm.Way) - lines[0].count(": not for ")
    for r in rows:  # two cells (1 and 3 rows) of every way, each with one best and
        assert len(r.split("/")) == 2 * ways - 1  # one chosen way marked
        assert r.count("*") == r.count("^") == 2


def test_bad_words_smoke_runs_both_ways_and_reports_a_per_step_cost(tmp_path):
    results = run_json(bad_words.main, ["--num-requests", "2", "--num-words", "8",
                                        "--output-len", "4", "--repeats", "1"],
                       tmp_path / "bad_words.json")
    assert results["benchmark"] == "bad_words"
    assert len(results["runs_s"]["plain"]) == len(results["runs_s"]["bad_words"]) == 1
    assert isinstance(results["extra_ms_per_step"], float)


def test_structured_outputs_smoke_times_both_arms_and_the_grammars_share(tmp_path,
                                                                         model_dirs):
    """Tiny sizes on the llama test model: both arms run to the same length (the script
    checks it), and the summary holds the ratios and the grammar's share of a step."""
    results = run_json(structured_outputs.main, [
        "--model", str(model_dirs["llama"]), "--batch1-tokens", "4", "--batch1-repeats", "1",
        "--concurrent", "4", "--concurrent-tokens", "4", "--rounds", "1", "--walk-steps", "5",
        "--no-direct"], tmp_path / "structured_outputs.json")
    assert results["benchmark"] == "structured_outputs"
    summary = results["summary"]["records"]
    assert summary["tpot_ratio"] > 0 and summary["throughput_ratio"] > 0
    assert 0 < summary["grammar_share_b1_c"] < 1 and 0 < summary["grammar_share_cc_c"] < 1


def test_quant_quality_smoke_scores_the_text_as_transformers_does(tmp_path):
    """The fp32 perplexity is transformers' on the same windows (the engine's prompt
    logprobs are the scoring); the quantized variants score near it."""
    import math

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from pagellm.demo.model import demo_model_dir

    results = quant_quality.main(["--smoke", "--out", str(tmp_path / "q.json")])
    assert json.loads((tmp_path / "q.json").read_text()) == results
    directory = demo_model_dir()
    tokenizer = AutoTokenizer.from_pretrained(directory)
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    ids = [i for t in quant_quality.TEXTS
           for i in tokenizer(Path(t).read_text(), add_special_tokens=False)["input_ids"]]
    total, count = 0.0, 0
    for i in range(0, 4 * 64, 64):
        window = torch.tensor([ids[i:i + 64]])
        with torch.no_grad():
            logprobs = model(window).logits[0, :-1].log_softmax(-1)
        total += logprobs.gather(1, window[0, 1:, None]).sum().item()
        count += 63
    assert results["tokens"] == count
    assert results["perplexity"]["fp32"] == pytest.approx(math.exp(-total / count), rel=1e-4)
    assert results["vs_fp32"]["int8"] == pytest.approx(1.0, abs=0.02)
    assert results["vs_fp32"]["int4"] != results["vs_fp32"]["int8"]


def test_cpu_quantized_smoke_times_every_variant_side_by_side(tmp_path):
    results = cpu_quantized.main(["--smoke", "--unfused", "--out", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text()) == results
    assert set(results["best"]) == {"fp32", "bf16", "int8", "int4", "fp32 unfused",
                                    "int8 unfused", "int4 unfused"}
    assert "PAGELLM_CPU_DECODE" not in os.environ  # set for those engines only
    for best in results["best"].values():
        assert best["batch1_tokens_per_s"] > 0 and best["offline_output_tokens_per_s"] > 0
    assert results["vs_fp32"]["fp32"] == {"batch1_tokens_per_s": 1.0,
                                          "offline_output_tokens_per_s": 1.0}


def test_moe_layer_times_each_scheme_on_the_same_routing():
    rows = moe_layer.main(["--experts", "8", "--tokens", "1", "5", "--top-k", "2",
                           "--hidden", "64", "--inter", "32", "--repeats", "1",
                           "--quantization", "fp32", "int8", "int4"])
    assert [(r["quantization"], r["tokens"]) for r in rows] == [
        (q, t) for t in (1, 5) for q in ("fp32", "int8", "int4")]
    assert all(r["ms"] > 0 for r in rows)
    for t in (1, 5):  # the router stays full precision: the same experts chosen
        assert len({r["chosen"] for r in rows if r["tokens"] == t}) == 1


def test_async_scheduling_smoke_times_both_arms_on_every_workload(tmp_path):
    results = async_scheduling.main(["--smoke", "--out", str(tmp_path / "a.json")])
    assert json.loads((tmp_path / "a.json").read_text()) == results
    keys = {"edit_batch1_tokens_per_s", "chat_batch1_tokens_per_s",
            "offline4_output_tokens_per_s", "many8_output_tokens_per_s"}
    for arm in ("sync", "async"):
        assert set(results["best"][arm]) == keys and min(results["best"][arm].values()) > 0
    assert set(results["async_vs_sync"]) == keys


def test_spec_decode_smoke_times_every_arm_on_both_workloads(tmp_path):
    results = spec_decode.main(["--smoke", "--draft-layers", "1",
                                "--out", str(tmp_path / "s.json")])
    assert json.loads((tmp_path / "s.json").read_text()) == results
    for arm in ("plain", "ngram", "draft_model"):
        assert {k for k in results["best"][arm] if k.endswith("per_s")} == {
            "edit_batch1_tokens_per_s", "chat_batch1_tokens_per_s",
            "offline4_output_tokens_per_s"}
    assert not any("accepted" in k for k in results["best"]["plain"])
    assert set(results["draft_model_vs_plain"]) == set(results["best"]["plain"])
    draft = Path(results["speculative_configs"]["draft_model"]["model"])
    assert json.loads((draft / "config.json").read_text())["num_hidden_layers"] == 1
    # The edit prompts quote real text and code (the licences, textwrap's source).
    edits = spec_decode.edit_prompts(4)
    assert len(edits) == 4 and all(len(m[0]["content"]) > 300 for m in edits)


def test_gguf_convert_smoke_converts_each_type_in_its_own_process(tmp_path):
    """The row is a fresh process converting this checkout's way, its peak memory read
    there, and the parameter count the fp32 size is judged by is the model's own."""
    pytest.importorskip("gguf")
    from safetensors.torch import load_file

    import pagellm

    results = gguf_convert.main(["--layers", "2", "--hidden", "256", "--intermediate", "512",
                                 "--heads", "4", "--kv-heads", "2", "--types", "Q4_1",
                                 "--work", str(tmp_path), "--out", str(tmp_path / "g.json")])
    assert json.loads((tmp_path / "g.json").read_text()) == results
    params = sum(t.numel() for k, t in load_file(str(tmp_path / "model" / "model.safetensors"))
                 .items() if not k.endswith("norm.weight"))
    for qtype, row in results.items():
        assert (tmp_path / f"model-{qtype}.gguf").is_file()
        assert row["params"] == params and row["fp32_gb"] == params * 4 / 2**30
        assert row["seconds"] > 0 and 0.1 < row["peak_rss_gb"] < 4 and row["output_gb"] > 0
        assert Path(row["pagellm"]) == Path(pagellm.__file__)
    assert list(results) == ["Q4_1"] and 0 < results["Q4_1"]["file_gb"] < params * 4 / 2**30
    assert not (tmp_path / "cache").exists()


def test_cpu_quantized_gguf_shape_writes_a_file_of_the_configs_shape(tmp_path):
    """--gguf-shape's file: the config's shape and vocabulary (the demo tokenizer padded
    with unused tokens), projections Q8_0, readable by transformers as a Qwen2 model
    whose weights are the file's."""
    pytest.importorskip("gguf")
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM, AutoTokenizer

    shape = tmp_path / "shape"
    shape.mkdir()
    config = json.loads((BENCHMARKS / "configs" / "qwen2.5-0.5b" / "config.json").read_text())
    config.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, vocab_size=3000,
                  bos_token_id=2, eos_token_id=2)
    (shape / "config.json").write_text(json.dumps(config))
    path = cpu_quantized.shaped_gguf(shape, tmp_path / "out")
    types = {t.name: t.tensor_type.name for t in GGUFReader(str(path)).tensors}
    assert types["blk.1.ffn_down.weight"] == "Q8_0" and types["token_embd.weight"] == "F32"
    assert "output.weight" not in types  # tied, as Qwen2.5-0.5B
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name)
    assert model.config.model_type == "qwen2"
    assert model.get_input_embeddings().weight.shape == (3000, 64)
    assert model.model.layers[1].mlp.gate_proj.weight.shape == (96, 64)
    assert len(AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)) == 3000
