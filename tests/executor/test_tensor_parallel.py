"""Tensor parallelism on the CPU (gloo): two worker processes hold half a model each.

References: transformers' greedy tokens on the same weights, the one-rank engine's
logprobs, and the checkpoint itself (the ranks' slices put back together)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time

import psutil
import pytest
import torch
from conftest import PROMPTS, assert_no_leaks
from helpers import ROOT, SUPPORT, Server, free_port, stop

from pagellm import LLM, EngineDeadError, SamplingParams, StructuredOutputsParams
from pagellm.executor.model.config import resolve_model_config
from pagellm.executor.model.loader import load_model
from pagellm.executor.model.parallel import TensorParallel, check_divisible
from pagellm.protocol.engine_args import EngineArgs

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code

MAX_TOKENS = 24
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)
KV = 8 * 2**20


def _tokens(outputs):
    return [o.outputs[0].token_ids for o in outputs]


def _workers(pid: int) -> list[psutil.Process]:
    return [p for p in psutil.Process(pid).children(recursive=True)
            if "pagellm.executor.worker_proc" in " ".join(p.cmdline())]


@pytest.mark.parametrize("size", [2, 4])
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_the_ranks_slices_put_together_are_the_checkpoint(name, size, model_dirs):
    """Each rank's parameters are exactly its slice of the full model: query heads and
    MLP columns split, KV heads split or (fewer than ranks) replicated to the ranks whose
    query heads read them, vocabulary rows split, norms whole."""
    config = resolve_model_config(EngineArgs(model=str(model_dirs[name])))
    spec = config.spec
    if spec.num_kv_heads < size and size % spec.num_kv_heads:
        pytest.skip("not splittable")
    full = dict(load_model(config, torch.device("cpu")).named_parameters())
    shards = [dict(load_model(config, torch.device("cpu"),
                              TensorParallel.layout(spec, rank, size)).named_parameters())
              for rank in range(size)]
    d, q_heads = spec.head_dim, spec.num_heads // size
    for param_name, whole in full.items():
        parts = [s[param_name] for s in shards]
        if param_name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat(parts, dim=1), whole), param_name
        elif param_name.endswith(("embed_tokens.weight", "lm_head.weight")):
            assert torch.equal(torch.cat(parts)[:spec.vocab_size], whole), param_name
        elif "gate_up_proj" in param_name:
            inter = spec.intermediate_size
            gate = torch.cat([p[:inter // size] for p in parts])
            up = torch.cat([p[inter // size:] for p in parts])
            assert torch.equal(torch.cat([gate, up]), whole), param_name
        elif "qkv_proj" in param_name:
            q = torch.cat([p[:q_heads * d] for p in parts])
            assert torch.equal(q, whole[:spec.num_heads * d]), param_name
            kv_full = whole[spec.num_heads * d:]
            for rank, p in enumerate(parts):
                layout = TensorParallel.layout(spec, rank, size)
                k_local = p[q_heads * d:(q_heads + layout.num_kv_heads) * d]
                # Query head h reads KV head h // (num_heads / num_kv_heads).
                first_kv = rank * q_heads // (spec.num_heads // spec.num_kv_heads)
                assert layout.kv_head_start == first_kv
                assert torch.equal(k_local, kv_full[first_kv * d:(first_kv
                                                                  + layout.num_kv_heads) * d])
        else:
            assert all(torch.equal(p, whole) for p in parts), param_name


def test_a_model_that_cannot_be_split_is_refused_naming_the_counts(model_dirs):
    spec = resolve_model_config(EngineArgs(model=str(model_dirs["llama"]))).spec
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        check_divisible(spec, 3)
    with pytest.raises(ValueError, match=r"tensor_parallel_size=3 .*num_attention_heads=4"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=3, kv_cache_memory_bytes=KV)


def test_a_rank_that_cannot_start_fails_the_start_naming_it(model_dirs):
    """A worker's start-up error reaches the caller with its type, and the other rank
    (blocked joining the process group) is stopped too: the process check of every test
    covers that nothing is left."""
    with pytest.raises(ValueError, match=r"tensor-parallel rank \d: worker_extension_cls "
                                         r"'no_such_module.Probe' cannot be imported"):
        LLM(str(model_dirs["llama"]), tensor_parallel_size=2, kv_cache_memory_bytes=KV,
            worker_extension_cls="no_such_module.Probe", multiprocess=False)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "qwen3"])
def test_two_ranks_match_transformers_and_one_rank(name, model_dirs, hf_reference,
                                                    make_llm):
    """GQA (llama), one KV head replicated on both ranks (qwen2), q/k norm with a
    head_dim apart from hidden_size / heads (qwen3): greedy tokens equal transformers',
    and logprobs equal the one-rank engine's within 1e-4."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=3)
    one = make_llm(model_dirs[name]).generate(PROMPTS, params, use_tqdm=False)
    two = make_llm(model_dirs[name], tensor_parallel_size=2).generate(PROMPTS, params,
                                                                      use_tqdm=False)
    for a, b in zip(one, two, strict=True):
        expected = hf_reference(name, a.prompt_token_ids, MAX_TOKENS)
        assert b.outputs[0].token_ids == a.outputs[0].token_ids == expected, a.prompt
        for la, lb in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert la.keys() == lb.keys()
            for token, lp in la.items():
                assert abs(lp.logprob - lb[token].logprob) < 1e-4
    assert sum(len(set(o.outputs[0].token_ids)) for o in two) > 4 * len(two)


@pytest.mark.slow
def test_prefix_cache_n_and_seeded_sampling_work_under_tensor_parallel(model_dirs,
                                                                        make_llm):
    """A cached prefix, n > 1, seeded sampling and structured outputs (the step's
    bitmask travels to every rank in the SchedulerOutput) give what one rank gives."""
    shared = PROMPTS[4]
    prompts = [shared + " first", shared + " second"]
    params = SamplingParams(temperature=0.8, top_p=0.9, max_tokens=12, n=3, seed=11)
    regex = r"[a-f]{2}-[0-9]{1,3}"
    constrained = SamplingParams(max_tokens=12, n=2, seed=5,
                                 structured_outputs=StructuredOutputsParams(regex=regex))
    results = []
    for tp in (1, 2):
        llm = make_llm(model_dirs["llama"], tensor_parallel_size=tp)
        llm.generate(prompts[:1], GREEDY, use_tqdm=False)  # fills the prefix cache
        out = llm.generate(prompts, params, use_tqdm=False)
        assert llm.get_stats().prefix_cache_hits > 0
        out += llm.generate(prompts, constrained, use_tqdm=False)
        assert all(re.fullmatch(regex, c.text) for o in out[-2:] for c in o.outputs)
        results.append([[c.token_ids for c in o.outputs] for o in out])
    assert results[0] == results[1]


@pytest.mark.slow
def test_sleep_wake_and_a_weight_update_reach_every_rank(model_dirs, monkeypatch):
    """Each rank offloads and restores its own slice, and loads its slice of new
    weights from the shared buffer; collective_rpc answers once per rank."""
    from pagellm.executor.model.loader import iterate_safetensors, safetensors_files

    qwen3 = dict(iterate_safetensors(safetensors_files(model_dirs["qwen3"])))
    monkeypatch.setenv("PYTHONPATH", str(SUPPORT))  # workers import rl_extension
    with LLM(str(model_dirs["qwen3"]), tensor_parallel_size=2, kv_cache_memory_bytes=KV,
             enable_sleep_mode=True, weight_transfer_config={"backend": "ipc"},
             worker_extension_cls="rl_extension.Probe", multiprocess=False) as llm:
        assert llm.info.world_size == 2  # what /get_world_size reports
        before = _tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False))
        llm.sleep(level=1)
        assert llm.is_sleeping()
        llm.wake_up()
        assert _tokens(llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == before
        ranks = llm.collective_rpc("describe", args=("p",))
        assert [r["rank"] for r in ranks] == [0, 1]
        # Negated weights: a different model whose reference we can compute by hand.
        flipped = {k: (-v if k.endswith("mlp.down_proj.weight") else v)
                   for k, v in qwen3.items()}
        assert llm.update_weights(list(flipped.items())) == len(flipped)
        after = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False)
        assert _tokens(after) != before
        sums = llm.collective_rpc("weight_checksum")
        assert len(sums) == 2 and sums[0] != sums[1]  # each rank holds a different slice
        assert_no_leaks(llm)
    with LLM(str(model_dirs["qwen3"]), kv_cache_memory_bytes=KV, multiprocess=False,
             weight_transfer_config={"backend": "ipc"}) as one:
        one.update_weights(list(flipped.items()))
        assert _tokens(one.generate(PROMPTS[:3], GREEDY, use_tqdm=False)) == _tokens(after)


@pytest.mark.slow
@pytest.mark.parametrize(("sig", "named"), [(signal.SIGKILL, r"rank 1 .*SIGKILL"),
                                            (signal.SIGSTOP, r"rank 1 .*is stopped")])
def test_a_killed_rank_is_an_engine_dead_error_naming_it_within_a_second(model_dirs, sig,
                                                                         named):
    """A stopped rank too (review 2): every collective would wait for it, forever."""
    with LLM(str(model_dirs["llama"]), tensor_parallel_size=2,
             kv_cache_memory_bytes=KV) as llm:
        assert len(_tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))) == 2
        engine = psutil.Process(llm.engine_core.engine_process.pid)
        workers = _workers(engine.pid)
        assert len(workers) == 2
        victim = next(w for w in workers if "--rank 1" in " ".join(w.cmdline()))
        killed = time.monotonic()
        victim.send_signal(sig)
        with pytest.raises(EngineDeadError, match=named):
            llm.generate(PROMPTS[:1], SamplingParams(max_tokens=1000, ignore_eos=True),
                         use_tqdm=False)
        assert time.monotonic() - killed < 1.5
        # The engine core and the other rank are gone too.
        _gone, alive = psutil.wait_procs([engine, *workers], timeout=10)
        assert not alive


@pytest.mark.slow
def test_two_nodes_on_loopback_each_launched_by_its_own_command(model_dirs, hf_reference):
    """Node 0 runs the engine core and rank 0; node 1 (`--headless`) runs rank 1, which
    finds node 0 through --master-addr/--master-port. A frontend attaches to node 0."""
    model = str(model_dirs["qwen2"])
    master, address = free_port(), f"tcp://127.0.0.1:{free_port()}"
    common = ["--model", model, "-tp", "2", "--nnodes", "2", "--master-addr", "127.0.0.1",
              "--master-port", str(master), "--kv-cache-memory-bytes", str(KV)]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    node1 = subprocess.Popen([sys.executable, "-m", "pagellm.enginecore", *common,
                              "--node-rank", "1", "--headless"], cwd=ROOT, env=env)
    node0 = subprocess.Popen([sys.executable, "-m", "pagellm.enginecore", *common,
                              "--node-rank", "0", "--address", address], cwd=ROOT, env=env)
    try:
        with LLM(model, engine_address=address) as llm:
            out = llm.generate(PROMPTS[:4], GREEDY, use_tqdm=False)
            for o in out:
                assert o.outputs[0].token_ids == hf_reference("qwen2", o.prompt_token_ids,
                                                              MAX_TOKENS)
            assert_no_leaks(llm)
        assert stop(node0) == 0
        assert node1.wait(20) == 0  # its worker saw the engine core go, then it exited
    finally:
        stop(node0)
        stop(node1)


@pytest.mark.slow
def test_the_server_serves_a_tensor_parallel_engine(model_dirs, hf_reference):
    """`pagellm serve DIR -tp 2`: completions equal transformers'; SIGTERM stops the
    server, its engine core and both workers."""
    server = Server(model_dirs["llama"], "-tp", "2")
    try:
        workers = _workers(server.engine_pid())
        assert len(workers) == 2
        from transformers import AutoTokenizer

        tokenizer = AutoTokenizer.from_pretrained(model_dirs["llama"])
        completion = server.client().completions.create(
            model="test-model", prompt=PROMPTS[1], max_tokens=MAX_TOKENS, temperature=0)
        expected = hf_reference("llama", tokenizer.encode(PROMPTS[1]), MAX_TOKENS)
        assert completion.choices[0].text == tokenizer.decode(expected)
    finally:
        assert server.stop() == 0
    _, alive = psutil.wait_procs(workers, timeout=10)
    assert not alive


@pytest.mark.slow
def test_a_trainer_broadcasts_weights_to_every_rank(model_dirs):
    """The "nccl" backend (gloo here) with two ranks: each joins the trainer's group as
    rank_offset + rank, receives every full tensor and keeps its slice."""
    from rl_helpers import NcclTrainer, hf_greedy, hf_model, perturbed

    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 3}
    with NcclTrainer(model_dir, init_info) as trainer, \
            LLM(str(model_dir), tensor_parallel_size=2, kv_cache_memory_bytes=KV,
                weight_transfer_config={"backend": "nccl"}) as llm:
        trainer.guard(llm.engine_core.engine_process.pid)
        trainer.push(llm, init_info)
        reference = hf_model(model_dir, perturbed(model_dir, seed=7))
        out = llm.generate(PROMPTS[:4], SamplingParams(temperature=0, max_tokens=10),
                           use_tqdm=False)
        assert [o.outputs[0].token_ids for o in out] == [
            hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)
        assert trainer.finish() == 0


@pytest.mark.slow
def test_a_killed_engine_core_takes_its_workers_with_it_and_leaves_no_socket_directory(
        model_dirs, monkeypatch):
    """A SIGKILL of the engine core takes both workers with it, a stopped one too (it
    cannot read its lifeline: the kernel's parent-death signal kills it). The workers'
    ipc socket files go as soon as every worker has connected: none is left behind,
    even then."""
    import shutil
    import tempfile

    tmp = tempfile.mkdtemp(prefix="tp-", dir="/tmp")  # short: ipc paths are limited
    monkeypatch.setenv("TMPDIR", tmp)  # where the engine core makes its directory
    llm = None
    try:
        llm = LLM(str(model_dirs["llama"]), tensor_parallel_size=2, kv_cache_memory_bytes=KV)
        assert len(_tokens(llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False))) == 2
        assert not [p for p in os.listdir(tmp) if p.startswith("pagellm-tp-")]
        engine = psutil.Process(llm.engine_core.engine_process.pid)
        workers = _workers(engine.pid)
        assert len(workers) == 2
        workers[1].send_signal(signal.SIGSTOP)
        engine.send_signal(signal.SIGKILL)
        _, alive = psutil.wait_procs(workers, timeout=10)
        assert not alive
        assert not [p for p in os.listdir(tmp) if p.startswith("pagellm-tp-")]
    finally:
        if llm is not None:
            llm.shutdown()
        shutil.rmtree(tmp, ignore_errors=True)
