"""weights/shm.py and the update path behind LLM.update_weights with the "ipc" backend:
the weights written to a shared-memory file, described by their specs, and loaded by
every worker. An update lands whole (the prefix cache computed with the old weights is
forgotten) or is refused whole, naming why, while the old weights keep serving: bad
shapes, names and types, a name given twice, specs aliasing one region, more tensors or
bytes than the model allows, and errors that echo only a prefix of what was sent. A
trainer in another process pushes its weights this way, and a /dev/shm too small for
them falls back to the temp dir. References: transformers on the same (perturbed)
weights, and the engine's own tokens before a refused update. (The buffer as an
attacker sends it is test_weight_transfer.py's.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from conftest import assert_no_leaks
from helpers import SUPPORT
from rl_helpers import (
    GREEDY,
    PROMPTS,
    checkpoint,
    greedy,
    hf_greedy,
    hf_model,
    leftover_buffers,
    parameter_count,
    perturbed,
)

from pagellm import LLM, SamplingParams
from pagellm.weights.shm import buffer_dirs, shared_weights, shm_dir

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


def test_update_weights_gives_transformers_tokens_and_logprobs_on_the_new_weights(model_dirs):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir)
    reference = hf_model(model_dir, new)
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        assert llm.update_weights(new.items()) == len(new)
        params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=1)
        outputs = llm.generate(PROMPTS, params, use_tqdm=False)
        assert not leftover_buffers()
        assert [o.outputs[0].token_ids for o in outputs] != before  # the update landed
        for out in outputs:
            completion = out.outputs[0]
            assert completion.token_ids == hf_greedy(reference, out.prompt_token_ids, 10)
            ids = out.prompt_token_ids + completion.token_ids
            with torch.no_grad():
                logprobs = reference(torch.tensor([ids])).logits[0].log_softmax(-1)
            start = len(out.prompt_token_ids) - 1
            for j, (token, position) in enumerate(zip(completion.token_ids,
                                                      completion.logprobs, strict=True)):
                assert abs(position[token].logprob - float(logprobs[start + j, token])) < 1e-4
        assert_no_leaks(llm)


def test_an_update_forgets_cached_prefixes(model_dirs):
    """A prompt whose prefix was cached under the old weights is recomputed."""
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir, seed=1)
    reference = hf_model(model_dir, new)
    prompt = {"prompt_token_ids": list(range(5, 69))}  # four full blocks
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        greedy(llm, [prompt])
        llm.update_weights(new.items())
        hits = llm.get_stats().prefix_cache_hits
        assert greedy(llm, [prompt]) == [hf_greedy(reference, prompt["prompt_token_ids"], 10)]
        assert llm.get_stats().prefix_cache_hits == hits


def test_a_bad_update_is_refused_whole_and_the_old_weights_keep_serving(model_dirs):
    model_dir = model_dirs["llama"]
    new = perturbed(model_dir)
    name = "model.layers.0.self_attn.q_proj.weight"
    bad = dict(new)
    bad[name] = new[name][:-1]  # one row short
    bad["model.layers.9.mlp.up_proj.weight"] = torch.zeros(3, 3)  # no such layer
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with pytest.raises(RuntimeError) as info:
            llm.update_weights(bad.items())
        message = str(info.value)
        assert "old weights kept" in message and name in message
        assert "model.layers.9.mlp.up_proj.weight: no such weight" in message
        with pytest.raises(ValueError, match="dtype int64 is not a weight dtype"):
            llm.update_weights([(name, torch.zeros(2, dtype=torch.int64))])
        # Review 2: each of these was a raw traceback from deep in the sender.
        for weights, error in (([(name, [1.0] * 4)], f"weight {name}: expected a torch"),
                               ([(7, torch.zeros(2))], r"weights\[0\]: the name must be"),
                               ([(name,)], r"weights\[0\] must be a \(name, tensor\) pair")):
            with pytest.raises(TypeError, match=error):
                llm.update_weights(weights)
        with pytest.raises(RuntimeError, match=f"{name}.*shape"):  # 0-d: written, refused
            llm.update_weights([(name, torch.tensor(1.0))])
        with pytest.raises(ValueError, match=r"<= 4611686018427387904 - at update_info\."
                                             r"shapes\[0\]\[0\]"):
            llm.update_weights({"update_info": {"names": [name], "dtype_names": ["float32"],
                                                "shapes": [[10**30]]}})
        with pytest.raises(RuntimeError, match="broadcast over backend 'nccl'; this engine's "
                                               "backend is 'ipc'"):
            llm.update_weights({"update_info": {"names": [name], "dtype_names": ["float32"],
                                                "shapes": [list(new[name].shape)]}})
        assert greedy(llm) == before  # not one tensor of the bad update was copied
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_updates_need_weight_transfer_config_and_buffers_come_only_from_shm(model_dirs):
    """An engine takes updates only when started with weight_transfer_config (what
    AsyncLLM and the server pass through); an LLM that starts its own engine defaults
    it to "ipc" (the script owns that engine, as vLLM's LLM may load weights)."""
    from pagellm.frontend.engine_client.inproc_client import InprocClient
    from pagellm.protocol.engine_args import EngineArgs
    from pagellm.protocol.messages import UtilityMethod

    model_dir = model_dirs["llama"]
    client = InprocClient(EngineArgs(model=str(model_dir), kv_cache_memory_bytes=8 * 2**20))
    try:
        with shared_weights(checkpoint(model_dir).items()) as update, \
                pytest.raises(RuntimeError, match="weight_transfer_config"):
            client.call_utility(UtilityMethod.UPDATE_WEIGHTS, update)
    finally:
        client.shutdown()
    with LLM(str(model_dir), kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        assert llm.engine_args.weight_transfer_config == {"backend": "ipc"}
        assert llm.update_weights(checkpoint(model_dir).items()) > 0
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights(perturbed(model_dir).items()) as update:
            for path in ("/etc/passwd", str(shm_dir() / "other-file"),
                         str(shm_dir() / "pagellm-weights-missing")):
                with pytest.raises(RuntimeError, match="weight buffer"):
                    llm.update_weights(type(update)(update.specs, path, update.buffer_bytes))
            with pytest.raises(RuntimeError, match="regular file of"):
                llm.update_weights(type(update)(update.specs, update.buffer, 7))
        assert greedy(llm) == before


def test_an_update_naming_a_weight_twice_is_refused_naming_it(model_dirs):
    """Each name once per update, checked before the first copy: the old weights keep
    serving."""
    from pagellm.protocol.utility import WeightUpdate

    model_dir = model_dirs["llama"]
    name = "model.layers.0.self_attn.q_proj.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights(perturbed(model_dir).items()) as update:
            spec = next(s for s in update.specs if s.name == name)
            twice = WeightUpdate([*update.specs, spec], update.buffer, update.buffer_bytes)
            with pytest.raises(RuntimeError, match=rf"old weights kept: {name} appears "
                                                   r"more than once"):
                llm.update_weights(twice)
        assert greedy(llm) == before  # nothing of the (otherwise good) update was copied
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_specs_pointing_many_times_at_one_region_are_refused_by_the_limits(model_dirs):
    """Red-team finding 7: a few bytes of specs, all naming one region of one shared
    file, once made the busy loop copy it once per spec while no request was served;
    300,000 distinct names the model skips (RoPE tables) stalled it for 3 s. An
    update's number of tensors (twice the checkpoint's at most) and total size (the
    limit of every path: 2 x the model's bytes) are checked first, and the engine keeps
    serving and taking updates."""
    from pagellm.protocol.utility import WeightSpec, WeightUpdate

    model_dir = model_dirs["llama"]
    weights = checkpoint(model_dir)
    name = "model.embed_tokens.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights([(name, perturbed(model_dir)[name])]) as region:
            copies = 2 * len(weights)  # as many as may come; the old code copied each
            alias = WeightUpdate(region.specs * copies, region.buffer, region.buffer_bytes)
            with pytest.raises(RuntimeError) as info:
                llm.update_weights(alias)
            total = copies * weights[name].numel() * weights[name].element_size()
            limit = 2 * 4 * parameter_count(model_dir)  # float32 on the CPU
            assert (f"weight update of {total} bytes is larger than the model allows "
                    f"({limit}); refused, nothing copied or received") in str(info.value)
            skipped = [WeightSpec(f"model.layers.{i}.self_attn.rotary_emb.inv_freq",
                                  "float32", [0], 0) for i in range(copies + 1)]
            with pytest.raises(RuntimeError, match=rf"weight update of {copies + 1} tensors "
                                                   rf"is more than the model has \({copies} "):
                llm.update_weights(WeightUpdate(skipped, region.buffer, region.buffer_bytes))
        assert greedy(llm) == before
        assert llm.update_weights(weights.items()) == len(weights)  # still takes updates
        assert greedy(llm) == before  # the same weights again
        assert not leftover_buffers()
        assert_no_leaks(llm)


def test_weight_update_errors_echo_at_most_a_prefix_of_what_was_sent(model_dirs):
    """A 40 MB tensor name or dtype came back as a 40 MB error string: refused with a
    prefix of it; the engine keeps serving."""
    from pagellm.protocol.utility import WeightSpec, WeightUpdate

    model_dir = model_dirs["llama"]
    name = "model.norm.weight"
    with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
             kv_cache_memory_bytes=8 * 2**20) as llm:
        before = greedy(llm)
        with shared_weights([(name, checkpoint(model_dir)[name])]) as update:
            spec = update.specs[0]
            for bad, complaint in (
                    (WeightSpec("x" * 100_000, spec.dtype, spec.shape), "characters"),
                    (WeightSpec(name, "y" * 100_000, spec.shape), "not a weight dtype"),
                    (WeightSpec(name, spec.dtype, [1] * 100_000), "dimensions")):
                with pytest.raises(RuntimeError, match=complaint) as info:
                    llm.update_weights(WeightUpdate([bad], update.buffer, update.buffer_bytes))
                assert len(str(info.value)) < 400, len(str(info.value))
        assert greedy(llm) == before
        assert_no_leaks(llm)


TRAINER = """
import sys
from pathlib import Path

import msgspec
from rl_helpers import perturbed

from pagellm.weights.shm import shared_weights

with shared_weights(perturbed(Path(sys.argv[1]), seed=7).items()) as update:
    sys.stdout.write(msgspec.msgpack.encode(update).hex() + "\\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the driver's update_weights has returned: free the buffer
"""


def test_a_trainer_in_another_process_pushes_weights_through_shared_memory(model_dirs):
    """The trainer writes its weights to shared memory and hands the driver only the
    (msgspec) description; the driver's LLM loads them."""
    import msgspec

    from pagellm.protocol.utility import WeightUpdate

    model_dir = model_dirs["llama"]
    reference = hf_model(model_dir, perturbed(model_dir, seed=7))
    trainer = subprocess.Popen([sys.executable, "-c", TRAINER, str(model_dir)], cwd=SUPPORT,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        with LLM(str(model_dir), weight_transfer_config={"backend": "ipc"},
                 kv_cache_memory_bytes=8 * 2**20) as llm:
            line = trainer.stdout.readline()
            update = msgspec.msgpack.decode(bytes.fromhex(line), type=WeightUpdate)
            assert llm.update_weights(update) == len(update.specs)
            trainer.stdin.write("done\n")
            trainer.stdin.flush()
            out = llm.generate(PROMPTS[1], GREEDY, use_tqdm=False)[0]
            assert out.outputs[0].token_ids == hf_greedy(reference, out.prompt_token_ids, 10)
        assert trainer.wait(30) == 0
    finally:
        if trainer.poll() is None:
            trainer.kill()
            trainer.wait()
    assert not leftover_buffers()


def test_a_small_dev_shm_falls_back_to_the_temp_dir_or_names_the_shortage(monkeypatch):
    """Containers often give /dev/shm 64 MiB: a bigger update goes through the temp
    directory instead, and when nothing has room the error says what to enlarge."""

    from pagellm.weights import shm as weight_transfer

    real = os.statvfs

    def small_shm(path):
        stats = real(path)
        if str(path) == "/dev/shm":
            return os.statvfs_result((stats.f_bsize, 4096, 100, 100, 100, *stats[5:]))
        return stats

    monkeypatch.setattr(weight_transfer.os, "statvfs", small_shm)
    dirs = buffer_dirs()
    assert shm_dir(1 << 20) == dirs[-1]  # 1 MiB does not fit in 400 KiB of /dev/shm
    with shared_weights([("w", torch.ones(512, 512))]) as update:
        assert Path(update.buffer).parent == dirs[-1]
    monkeypatch.setattr(weight_transfer.os, "statvfs", lambda path: os.statvfs_result(
        (4096, 4096, 1, 1, 1, 0, 0, 0, 0, 255)))
    with pytest.raises(ValueError, match=r"no room for a 1 MiB weight buffer.*shm-size"):
        shm_dir(1 << 20)
