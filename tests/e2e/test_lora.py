"""LoRA adapters against transformers + PEFT on the same weights (fp32, greedy).

Adapters are written by PEFT (tests/support/peft_adapters.py: random A and B, saved with
save_pretrained); the reference is PEFT's own merge of each into the base model. Every
token the engine produces must be the merged model's greedy choice after the same
prefix (`argmax_along`): for each adapter alone, for batches that mix adapters and the
base model, with adapters paged in and out of too few slots, and under tensor
parallelism. Each adapter also changes some output: one that did nothing would pass
the comparison with the base model's tokens."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from conftest import PROMPTS, runs_triton_kernels
from peft_adapters import argmax_along, make_adapter, merged

from pagellm import LoRARequest, SamplingParams
from pagellm.demo.model import ModelSpec, make_model
from pagellm.protocol.messages import EngineCoreRequest, FinishReason

pytest.importorskip("peft")

# The floors leg skips these (.ci/run): PEFT's adapter format at its floor is covered by the
# LoRA server tests.
pytestmark = pytest.mark.own_code


ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
# name -> (targets, r, rslora): every projection, parts of the merged ones alone, rank
# 1 and the largest rank the engine is started with.
ADAPTERS: dict[str, tuple[list[str], int, bool]] = {
    "qv": (["q_proj", "v_proj"], 8, False),
    "all": (ALL, 4, True),
    "o_down": (["o_proj", "down_proj"], 16, False),
    "k_gate_up": (["k_proj", "gate_proj", "up_proj"], 1, False),
}
MAX_RANK = 16
MAX_TOKENS = 12
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)


@pytest.fixture(scope="module")
def adapters(model_dirs: dict[str, Path], tmp_path_factory: pytest.TempPathFactory
             ) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return {name: make_adapter(model_dirs["llama"], root / name, targets, r, seed)
            for seed, (name, (targets, r, _)) in enumerate(ADAPTERS.items())
            } | {"qv_rslora": make_adapter(model_dirs["llama"], root / "qv_rslora",
                                           ["q_proj", "v_proj"], 8, 9, rslora=True)}


@pytest.fixture(scope="module")
def references(model_dirs: dict[str, Path], adapters: dict[str, Path]) -> dict[str | None, Any]:
    base = model_dirs["llama"]
    return {None: merged(base, None)} | {name: merged(base, path)
                                         for name, path in adapters.items()}


def lora(adapters: dict[str, Path], name: str | None) -> LoRARequest | None:
    if name is None:
        return None
    return LoRARequest(name, sorted(adapters).index(name) + 1, str(adapters[name]))


def check(outputs: list[Any], names: list[str | None], references: dict[str | None, Any]
          ) -> None:
    for out, name in zip(outputs, names, strict=True):
        ours = out.outputs[0].token_ids
        assert len(ours) == MAX_TOKENS
        assert argmax_along(references[name], out.prompt_token_ids, ours) == ours, name


def test_each_adapter_alone_and_mixed_with_the_base_model_equals_peft(
        model_dirs, adapters, references, make_llm):
    """Each adapter alone, then one batch of 4 adapters and the base model with the
    requests of each adapter apart in it; every adapter changes some prompt's tokens."""
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_loras=4, max_lora_rank=MAX_RANK,
                   dtype="float32")
    prompts = PROMPTS[:4]
    base = llm.generate(prompts, GREEDY, use_tqdm=False)
    check(base, [None] * 4, references)
    for name in ADAPTERS:
        outputs = llm.generate(prompts, GREEDY, use_tqdm=False,
                               lora_request=lora(adapters, name))
        check(outputs, [name] * 4, references)
        assert any(o.outputs[0].token_ids != b.outputs[0].token_ids
                   for o, b in zip(outputs, base, strict=True)), name
    names: list[str | None] = [*ADAPTERS, None] * 2
    mixed_prompts = [PROMPTS[i % 7] for i in range(len(names))]
    outputs = llm.generate(mixed_prompts, GREEDY, use_tqdm=False,
                           lora_request=[lora(adapters, n) for n in names])
    check(outputs, names, references)


def test_rslora_scales_by_the_square_root_of_the_rank(model_dirs, adapters, references,
                                                      make_llm):
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_lora_rank=8, dtype="float32")
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False,
                           lora_request=lora(adapters, "qv_rslora"))
    check(outputs, ["qv_rslora"] * 3, references)


def test_adapters_page_through_too_few_slots_and_host_cache(model_dirs, adapters,
                                                            references, make_llm):
    """Two device slots and two host copies for five adapters: every batch of four
    distinct adapters evicts and reads again, and the scheduler runs at most two
    adapters in a step (the others wait their turn)."""
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_loras=2, max_cpu_loras=2,
                   max_lora_rank=MAX_RANK, dtype="float32")
    manager = llm.llm_engine.model_executor.driver_worker.model_runner.lora
    steps: list[set[int]] = []
    paged_in: list[int] = []
    prepare, page_in = manager.prepare_step, manager._page_in

    def recording(runs: list[tuple[int, int, int]]) -> None:
        steps.append({lora_id for lora_id, _, _ in runs})
        prepare(runs)

    def paging(lora_id: int, needed: set[int]) -> None:
        paged_in.append(lora_id)
        page_in(lora_id, needed)

    manager.prepare_step, manager._page_in = recording, paging
    for order in ([*ADAPTERS, None], [None, *reversed(ADAPTERS)]):
        names = list(order) * 2
        outputs = llm.generate([PROMPTS[i % 5] for i in range(len(names))], GREEDY,
                               use_tqdm=False, lora_request=[lora(adapters, n) for n in names])
        check(outputs, names, references)
    assert max(len(s) for s in steps) == 2
    assert len(manager.host) <= 2
    # The first pass pages in all four (the two slots change hands); the second starts
    # with the pair still in them, runs it, then pages in the other pair.
    ids = {n: lora(adapters, n).lora_int_id for n in ADAPTERS}
    assert sorted(paged_in) == sorted([*ids.values(), ids["qv"], ids["all"]])


def test_the_prefix_cache_never_shares_kv_between_adapters(model_dirs, adapters,
                                                           references, make_llm):
    """A long prompt cached under one adapter is a miss under another and under the base
    model; the same adapter hits. Replacing an adapter's weights in place
    (load_inplace) makes its cached prompts misses, and serves the new weights."""
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_loras=2,
                   max_lora_rank=MAX_RANK, dtype="float32")
    prompt = PROMPTS[6]
    one = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS)

    def run(request: LoRARequest | None) -> Any:
        return llm.generate([prompt], one, use_tqdm=False, lora_request=request)[0]

    first = run(lora(adapters, "qv"))
    assert first.num_cached_tokens == 0
    assert run(lora(adapters, "all")).num_cached_tokens == 0
    assert run(None).num_cached_tokens == 0
    again = run(lora(adapters, "qv"))
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == \
        first.outputs[0].token_ids
    # "qv"'s id now holds o_down's weights: nothing of the old ones is reused.
    replaced = LoRARequest("qv", lora(adapters, "qv").lora_int_id, str(adapters["o_down"]),
                           load_inplace=True)
    assert llm.add_lora(replaced)
    after = run(LoRARequest("qv", replaced.lora_int_id, str(adapters["o_down"])))
    assert after.num_cached_tokens == 0
    check([after], ["o_down"], references)
    assert run(LoRARequest("qv", replaced.lora_int_id,
                           str(adapters["o_down"]))).num_cached_tokens > 0


def test_add_list_and_remove(model_dirs, adapters, make_llm):
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_lora_rank=MAX_RANK)
    assert llm.list_loras() == set()
    assert llm.add_lora(lora(adapters, "qv")) and llm.add_lora(lora(adapters, "all"))
    assert llm.list_loras() == {lora(adapters, "qv").lora_int_id,
                                lora(adapters, "all").lora_int_id}
    assert llm.remove_lora(lora(adapters, "qv").lora_int_id)
    assert not llm.remove_lora(lora(adapters, "qv").lora_int_id)
    assert llm.list_loras() == {lora(adapters, "all").lora_int_id}
    workers = llm.llm_engine.model_executor.driver_worker
    assert workers.list_loras() == [lora(adapters, "all").lora_int_id]


# --- bad adapters: clear errors, the engine serves everyone else -----------------------


def _write(directory: Path, config: dict[str, Any] | None, copy_from: Path) -> Path:
    directory.mkdir()
    (directory / "adapter_model.safetensors").write_bytes(
        (copy_from / "adapter_model.safetensors").read_bytes())
    raw = json.loads((copy_from / "adapter_config.json").read_text())
    (directory / "adapter_config.json").write_text(json.dumps(raw | (config or {})))
    return directory


def bad_adapters(root: Path, adapters: dict[str, Path], model_dirs: dict[str, Path]
                 ) -> dict[str, tuple[Path, str]]:
    """name -> (directory, what the error must say)."""
    qv = adapters["qv"]
    root.mkdir()
    (root / "empty").mkdir()
    torn = _write(root / "torn", None, qv)
    (torn / "adapter_model.safetensors").write_bytes(b"\x10\x00\x00\x00")
    not_json = _write(root / "not_json", None, qv)
    (not_json / "adapter_config.json").write_text("{r: 8")
    pickled = root / "pickled"
    pickled.mkdir()
    (pickled / "adapter_config.json").write_text((qv / "adapter_config.json").read_text())
    (pickled / "adapter_model.bin").write_bytes(b"not read")
    bigger = ModelSpec(arch="llama", hidden_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                       intermediate_size=128, vocab_size=1024, seed=7)
    three_layers = make_model(root / "three_layers_base", bigger)
    return {
        "missing": (root / "nowhere", "is not a directory"),
        "empty": (root / "empty", "has no adapter_config.json"),
        "pickled": (pickled, "adapter_model.bin is not read"),
        "torn": (torn, "cannot read the safetensors file"),
        "not_json": (not_json, "is not JSON"),
        "rank": (adapters["o_down"], "rank r=16 is above max_lora_rank=8"),
        "bias": (_write(root / "bias", {"bias": "lora_only"}, qv),
                 "adapters with biases are not served"),
        "dora": (_write(root / "dora", {"use_dora": True}, qv), "DoRA adapters are not served"),
        "other_model": (make_adapter(three_layers, root / "other_model", ["q_proj"], 4, 3),
                        "model.layers.2.self_attn.q_proj', which this model"),
    }


def test_a_bad_adapter_fails_its_request_alone(model_dirs, adapters, references, make_llm,
                                               tmp_path):
    """Each bad adapter, sent beside a good request of another adapter and one of the
    base model: the bad one finishes with an error naming the problem, the others with
    their tokens; nothing is left held."""
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_lora_rank=8, max_loras=2,
                   dtype="float32")
    core = llm.engine_core.core
    bad = bad_adapters(tmp_path / "bad", adapters, model_dirs)
    tokenizer = llm.get_tokenizer()
    ids = tokenizer.encode(PROMPTS[1])
    for i, (name, (path, why)) in enumerate(bad.items()):
        requests = {
            f"bad-{i}": LoRARequest(name, 100 + i, str(path)),
            f"good-{i}": lora(adapters, "qv"),
            f"base-{i}": None}
        for request_id, request in requests.items():
            core.add_request(EngineCoreRequest(request_id, ids, GREEDY, None, 0.0,
                                               lora_request=request))
        finished: dict[str, Any] = {}
        tokens: dict[str, list[int]] = {r: [] for r in requests}
        while len(finished) < len(requests):
            for message in core.step().values():
                for out in message.outputs:
                    tokens[out.request_id] += out.new_token_ids
                    if out.finish_reason is not None:
                        finished[out.request_id] = out
                for request_id, token in zip(message.token_req_ids, message.token_ids,
                                            strict=True):
                    tokens[request_id].append(token)
        assert finished[f"bad-{i}"].finish_reason == FinishReason.ERROR
        assert why in finished[f"bad-{i}"].error and repr(name) in finished[f"bad-{i}"].error
        for request_id, name_ in ((f"good-{i}", "qv"), (f"base-{i}", None)):
            assert finished[request_id].finish_reason == FinishReason.LENGTH
            assert argmax_along(references[name_], ids, tokens[request_id]) == \
                tokens[request_id]
    assert core.loras.ids() == [lora(adapters, "qv").lora_int_id]


def test_requests_naming_adapters_wrongly_are_refused(model_dirs, adapters, make_llm):
    plain = make_llm(model_dirs["llama"])
    with pytest.raises(ValueError, match="started without enable_lora"):
        plain.generate(PROMPTS[0], GREEDY, lora_request=lora(adapters, "qv"), use_tqdm=False)
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_lora_rank=MAX_RANK)
    llm.generate(PROMPTS[0], GREEDY, lora_request=lora(adapters, "qv"), use_tqdm=False)
    other = LoRARequest("other", lora(adapters, "qv").lora_int_id, str(adapters["all"]))
    with pytest.raises(ValueError, match=r"lora_int_id \d+ is adapter 'qv'"):
        llm.generate(PROMPTS[0], GREEDY, lora_request=other, use_tqdm=False)
    with pytest.raises(TypeError, match="lora_request must be a LoRARequest"):
        llm.generate(PROMPTS[0], GREEDY, lora_request="qv", use_tqdm=False)  # type: ignore
    with pytest.raises(ValueError, match="lora_int_id must be in"):
        LoRARequest("x", 0, str(adapters["qv"]))
    with pytest.raises(ValueError, match="2 lora_requests for 1 prompts"):
        llm.generate([PROMPTS[0]], GREEDY, lora_request=[None, None], use_tqdm=False)
    assert llm.generate(PROMPTS[0], GREEDY, use_tqdm=False)[0].outputs[0].token_ids


def test_tensor_parallel_2_equals_peft(model_dirs, adapters, references, make_llm):
    """Each rank holds its slice of every adapter (B's rows of the column-parallel
    projections, A's columns of the row-parallel ones): the tokens are PEFT's."""
    llm = make_llm(model_dirs["llama"], enable_lora=True, max_loras=2, max_lora_rank=MAX_RANK,
                   dtype="float32", tensor_parallel_size=2)
    names: list[str | None] = ["all", "o_down", None, "all", "k_gate_up", "qv"]
    outputs = llm.generate([PROMPTS[i] for i in range(len(names))], GREEDY, use_tqdm=False,
                           lora_request=[lora(adapters, n) for n in names])
    check(outputs, names, references)


@runs_triton_kernels
@pytest.mark.slow
def test_the_triton_kernels_on_the_graph_path_equal_peft(model_dirs, adapters, references,
                                                         make_llm, monkeypatch):
    """The CUDA path on the CPU (Triton's interpreter): every projection's update in
    two grouped launches (kernels/triton_lora.py), prompts eagerly, and decode steps
    through the CUDA-graph forward pass on the persistent buffers, padded up the ladder
    (six requests of four adapters and the base model at size 8), reading each step's
    runs from the step buffer. Base-model steps replay the same forward pass, on the
    empty runs they stage."""
    from eager_replay import EagerReplay

    from pagellm.kernels import triton_lora

    llm = make_llm(model_dirs["llama"], enable_lora=True, max_loras=4, max_lora_rank=MAX_RANK,
                   dtype="float32", attention_backend="triton", max_num_seqs=8)
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    assert runner.lora.batch.kernels
    launches = []
    lora_add = triton_lora.lora_add

    def counting(x, *args, **kwargs):
        launches.append(x.shape[0])
        lora_add(x, *args, **kwargs)

    monkeypatch.setattr(triton_lora, "lora_add", counting)
    runner.stage_padding(8)  # what graphs are captured on: no runs
    assert not runner.buffers.host["lora_runs"].any()
    graphs = EagerReplay([1, 2, 4, 8], runner._decode_forward)
    runner.graphs = graphs
    names: list[str | None] = ["qv", "all", None, "o_down", "k_gate_up", None]
    outputs = llm.generate([PROMPTS[i] for i in range(len(names))], GREEDY, use_tqdm=False,
                           lora_request=[lora(adapters, n) for n in names])
    check(outputs, names, references)
    assert 8 in graphs.replayed and 8 in launches  # decodes of all six, padded
    replayed = len(graphs.replayed)
    # After the adapters: a graph step with no runs must not apply the last ones (two
    # requests: the size-2 graph reads the same runs buffer the size-8 steps filled).
    base = llm.generate(PROMPTS[:2], GREEDY, use_tqdm=False)
    check(base, [None, None], references)
    assert len(graphs.replayed) > replayed


@pytest.mark.parametrize(("arch", "modules", "extra"), [
    ("phi3", ["qkv_proj", "o_proj", "gate_up_proj", "down_proj"], {}),
    ("glm4", ["q_proj", "k_proj", "v_proj", "o_proj", "gate_up_proj", "down_proj"],
     {"head_dim": 32, "config_extra": {"partial_rotary_factor": 0.5}})])
def test_fused_projections_take_adapters_of_their_own_names(arch, modules, extra, tmp_path,
                                                            make_llm):
    """Phi-3's checkpoint fuses q/k/v and gate/up, and so do its adapters (PEFT targets
    qkv_proj and gate_up_proj); GLM-4's fuses gate/up only (its adapters target q_proj,
    k_proj, v_proj apart, their queries and keys rotated in GLM's interleaved pairs)."""
    spec = ModelSpec(arch=arch, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2,
                     intermediate_size=96, vocab_size=1024, init_std=0.2, seed=25,
                     tie_word_embeddings=False, **extra)
    base = make_model(tmp_path / arch, spec)
    path = make_adapter(base, tmp_path / "adapter", modules, 8, 4)
    reference = {"fused": merged(base, path), None: merged(base, None)}
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, dtype="float32")
    names: list[str | None] = ["fused", None, "fused"]
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[
        None if n is None else LoRARequest(n, 1, str(path)) for n in names])
    check(outputs, names, reference)


def test_lfm2_adapters_name_its_modules_its_own_way(tmp_path, make_llm):
    """LFM2's checkpoints, and so its PEFT adapters, call the attention's output
    projection out_proj and the MLP's feed_forward.w1/w3/w2, and its short convolutions
    have an in_proj and an out_proj of their own (PEFT's "out_proj" takes both): an
    adapter on all of them is read in the model's spelling and serves PEFT's merged
    model's tokens. Under tensor parallelism (in_proj's rows are three parts) adapters
    are refused at start-up, by name."""
    from family_specs import FAMILY_SPECS

    base = make_model(tmp_path / "lfm2", FAMILY_SPECS["lfm2"])
    path = make_adapter(base, tmp_path / "adapter", ["q_proj", "k_proj", "v_proj",
                                                     "out_proj", "in_proj", "w1", "w2",
                                                     "w3"], 8, 6)
    reference = {"lfm2": merged(base, path), None: merged(base, None)}
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, dtype="float32")
    names: list[str | None] = ["lfm2", None, "lfm2"]
    outputs = llm.generate(PROMPTS[:3], GREEDY, use_tqdm=False, lora_request=[
        None if n is None else LoRARequest(n, 1, str(path)) for n in names])
    check(outputs, names, reference)
    with pytest.raises(Exception, match="LoRA adapters on LFM2 under tensor parallelism"):
        make_llm(base, enable_lora=True, tensor_parallel_size=2)


def test_async_adapters_keep_through_sleep_levels_1_and_2(model_dirs, adapters, references):
    """AsyncLLM with its engine core in a process (the LoRARequest travels the socket),
    started without weight_transfer_config: adapter and base requests run at once; after
    sleep level 1 and after level 2 (the base weights pushed back with update_weights,
    which needs no weight_transfer_config from a script's own engine) the adapters
    still give PEFT's tokens."""
    import asyncio

    from safetensors.torch import load_file

    from pagellm import AsyncLLM
    from pagellm.executor.model.loader import safetensors_files

    names: list[str | None] = ["qv", None, "all"]

    async def run(engine: AsyncLLM, tag: str) -> list[Any]:
        async def one(i: int, name: str | None) -> Any:
            final = None
            async for out in engine.generate(PROMPTS[i], GREEDY, f"{tag}-{i}",
                                             lora_request=lora(adapters, name)):
                final = out
            return final
        return list(await asyncio.gather(*(one(i, n) for i, n in enumerate(names))))

    async def main() -> None:
        engine = AsyncLLM(str(model_dirs["llama"]), enable_lora=True, max_loras=2,
                          max_lora_rank=MAX_RANK, dtype="float32", enable_sleep_mode=True,
                          kv_cache_memory_bytes=8 * 2**20)
        try:
            assert await engine.add_lora(lora(adapters, "qv"))
            check(await run(engine, "first"), names, references)
            assert await engine.list_loras() == {lora(adapters, n).lora_int_id
                                                 for n in ("qv", "all")}
            await engine.sleep(level=1)
            await engine.wake_up()
            check(await run(engine, "level1"), names, references)
            await engine.sleep(level=2)
            await engine.wake_up(tags=["weights"])
            weights = {}
            for file in safetensors_files(model_dirs["llama"]):
                weights.update(load_file(str(file)))
            assert await engine.update_weights(weights.items()) == len(weights)
            await engine.wake_up(tags=["kv_cache"])
            check(await run(engine, "level2"), names, references)
            stats = await engine.get_stats()
            assert stats.num_free_blocks == stats.num_total_blocks
        finally:
            engine.shutdown()

    asyncio.run(main())


def test_an_adapter_from_tensors_in_memory_loads_and_is_replaced_in_place(
        model_dirs, adapters, references, make_llm):
    """RL adapter sync (verl's TensorLoRARequest: PEFT's config object and its
    in-memory state dict, no file): the adapter serves PEFT's tokens; sending other
    tensors under the same id replaces it, cached prompts of the old weights unused."""
    from peft import PeftModel, get_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    from pagellm.protocol.lora import TensorLoRARequest

    def trained(name: str) -> tuple[Any, dict[str, Any]]:
        base = AutoModelForCausalLM.from_pretrained(model_dirs["llama"])
        model = PeftModel.from_pretrained(base, adapters[name])
        return model.peft_config["default"], get_peft_model_state_dict(model)

    llm = make_llm(model_dirs["llama"], enable_lora=True, max_lora_rank=MAX_RANK,
                   max_cpu_loras=2, dtype="float32", multiprocess=True)
    config, tensors = trained("all")
    assert llm.add_lora(TensorLoRARequest("policy", 7, peft_config=config,
                                          lora_tensors=tensors))
    policy = LoRARequest("policy", 7)
    first = llm.generate(PROMPTS[6:7], GREEDY, use_tqdm=False, lora_request=policy)
    check(first, ["all"], references)
    assert llm.generate(PROMPTS[6:7], GREEDY, use_tqdm=False,
                        lora_request=policy)[0].num_cached_tokens > 0
    config, tensors = trained("qv")
    assert llm.add_lora(TensorLoRARequest("policy", 7, peft_config=config,
                                          lora_tensors=tensors))
    second = llm.generate(PROMPTS[6:7], GREEDY, use_tqdm=False, lora_request=policy)
    assert second[0].num_cached_tokens == 0
    check(second, ["qv"], references)
    with pytest.raises(RuntimeError, match="which this model"):
        llm.add_lora(TensorLoRARequest("broken", 8, peft_config=config, lora_tensors={
            "base_model.model.model.layers.9.self_attn.q_proj.lora_A.weight":
                tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]}))
    check(llm.generate(PROMPTS[6:7], GREEDY, use_tqdm=False, lora_request=policy),
          ["qv"], references)


def test_vllms_import_path_gives_the_same_class():
    """RL frameworks import `vllm.lora.request.LoRARequest` (through install_as_vllm, in
    a child process: the alias is process-wide)."""
    import subprocess
    import sys

    code = ("import pagellm; pagellm.install_as_vllm()\n"
            "from vllm.lora.request import LoRARequest\n"
            "import pagellm.protocol.lora as ours\n"
            "assert LoRARequest is ours.LoRARequest is pagellm.LoRARequest\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def _hand_adapter(base_dir: Path, out: Path, modules: list[str], r: int, alpha: float,
                  seed: int) -> dict[str, tuple[Any, Any]]:
    """An adapter written as PEFT lays one out (adapter_config.json, lora_A/lora_B per
    module), by hand: PEFT 0.21 turns gate/up/down targets of a transformers-5 MoE model
    into its experts' parameters, so it cannot write one for a DeepSeek dense layer or
    shared expert. Returns module -> (A, B)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(base_dir)
    generator = torch.Generator().manual_seed(seed)
    weights, updates = {}, {}
    for module in modules:
        proj = module.rsplit(".", 1)[-1]
        hidden = config.hidden_size
        inner = config.moe_intermediate_size * config.n_shared_experts \
            if "shared_experts" in module else config.intermediate_size
        in_f, out_f = (inner, hidden) if proj == "down_proj" else (hidden, inner)
        a = 0.3 * torch.randn(r, in_f, generator=generator)
        b = 0.3 * torch.randn(out_f, r, generator=generator)
        weights[f"base_model.model.{module}.lora_A.weight"] = a
        weights[f"base_model.model.{module}.lora_B.weight"] = b
        updates[module] = (a, b)
    out.mkdir(parents=True)
    save_file(weights, out / "adapter_model.safetensors")
    (out / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": r, "lora_alpha": alpha, "bias": "none",
        "target_modules": sorted({m.rsplit(".", 1)[-1] for m in modules})}))
    return updates


def test_deepseek_adapters_on_its_mlps_are_served_and_on_its_latent_attention_refused(
        tmp_path, make_llm):
    """DeepSeek-V3: an adapter on the dense layer's MLP and the MoE layer's shared
    expert equals transformers with each update merged by hand (W += alpha / r * B A);
    one on o_proj (whose input the absorbed kv_b_proj changes) and PEFT's own adapter
    on the experts (target_parameters) are refused, naming why."""
    import torch
    from family_specs import FAMILY_SPECS
    from transformers import AutoModelForCausalLM

    base = make_model(tmp_path / "deepseek_v3", FAMILY_SPECS["deepseek_v3"])
    modules = ["model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
               "model.layers.0.mlp.down_proj", "model.layers.1.mlp.shared_experts.gate_proj",
               "model.layers.1.mlp.shared_experts.down_proj"]
    r, alpha = 4, 6.0
    updates = _hand_adapter(base, tmp_path / "mlp", modules, r, alpha, seed=5)
    reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    with torch.no_grad():
        for module, (a, b) in updates.items():
            reference.get_submodule(module).weight += alpha / r * b @ a
    llm = make_llm(base, enable_lora=True, max_lora_rank=8, dtype="float32")
    params = SamplingParams(temperature=0.0, max_tokens=8)
    prompt = llm.get_tokenizer().encode(PROMPTS[0])
    adapted = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                           lora_request=LoRARequest("mlp", 1, str(tmp_path / "mlp")))
    plain = llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False)
    tokens = adapted[0].outputs[0].token_ids
    assert tokens != plain[0].outputs[0].token_ids  # the adapter changes the output
    assert argmax_along(reference, prompt, tokens) == tokens

    refused = {"o_proj": (make_adapter(base, tmp_path / "o", ["o_proj"], 4, 1),
                          "takes no adapter on"),
               "experts": (make_adapter(base, tmp_path / "experts", ["gate_proj", "up_proj"], 4, 2),
                           "target_parameters")}
    for name, (path, why) in refused.items():
        with pytest.raises(ValueError, match=why):
            llm.generate({"prompt_token_ids": prompt}, params, use_tqdm=False,
                         lora_request=LoRARequest(name, 2 + len(name), str(path)))
