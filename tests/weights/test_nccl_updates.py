"""weights/nccl.py and executor/worker/weight_receiver.py: vLLM's four-phase weight
transfer (init, start, update, finish) over the "nccl" backend, gloo between CPUs: a
trainer in its own process or thread broadcasts, the engine loads each tensor as it
arrives; a refused update still drains every broadcast (the trainer never hangs) and
leaves the old weights serving; phases out of order, bad init info and an init that no
trainer joins fail alone, naming why. References: transformers on the broadcast
weights, and the received tensors compared exactly with the sent ones."""

from __future__ import annotations

import threading
import time

import pytest
import torch
from conftest import assert_no_leaks
from helpers import free_port
from rl_helpers import (
    GREEDY,
    PROMPTS,
    NcclTrainer,
    greedy,
    hf_greedy,
    hf_model,
    perturbed,
)

from pagellm import LLM

# The floors leg skips these (.ci/run): our weight transfer over torch.distributed (the same
# torch in both legs).
pytestmark = pytest.mark.own_code


def test_the_nccl_backend_uses_nccl_only_between_distinct_gpus():
    from pagellm.weights.nccl import choose_backend

    assert choose_backend(["GPU-a", "GPU-b", "GPU-c"]) == "nccl"
    assert choose_backend(["GPU-a", "GPU-a"]) == "gloo"  # NCCL refuses a shared GPU
    assert choose_backend(["GPU-a", "cpu"]) == "gloo"  # a CPU engine or trainer
    assert choose_backend(["cpu", "cpu"]) == "gloo"


@pytest.mark.parametrize("case", ["good", "bad", "asleep"])
def test_a_trainer_broadcasts_weights_over_the_nccl_backend(model_dirs, case):
    """vLLM's four phases with the trainer in its own process (gloo on the CPU): init
    (both sides join), start, update (the engine receives what the trainer
    broadcasts), finish. A bad tensor is refused after the transfer drained, and the
    old weights keep serving; an update while the weights sleep is refused naming that,
    also after draining (the trainer never hangs)."""
    bad = case == "bad"
    from helpers import free_port

    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2}
    with NcclTrainer(model_dir, init_info, "bad" if bad else "good") as trainer, \
            LLM(str(model_dir), weight_transfer_config={"backend": "nccl"},
                kv_cache_memory_bytes=8 * 2**20, enable_sleep_mode=True) as llm:
        trainer.guard(llm.engine_core.engine_process.pid)
        before = greedy(llm)
        llm.init_weight_transfer_engine({"init_info": init_info})
        if case == "asleep":
            llm.sleep(level=1)
        joined = trainer.joined()
        assert joined["backend"] == "gloo"  # NCCL only between GPUs
        update_info = joined["update_info"]
        llm.start_weight_update()
        with pytest.raises(RuntimeError, match="already in progress"):
            llm.start_weight_update()
        trainer.send()
        if bad:
            with pytest.raises(RuntimeError, match=r"old weights kept: model\.layers\.1"):
                llm.update_weights({"update_info": update_info})
        elif case == "asleep":
            with pytest.raises(RuntimeError, match="the weights are asleep"):
                llm.update_weights({"update_info": update_info})
            assert llm.wake_up() is True
        else:
            assert llm.update_weights({"update_info": update_info}) == len(
                update_info["names"])
        llm.finish_weight_update(weight_version="step-1")
        assert trainer.sent()
        if case != "good":
            assert greedy(llm) == before
        else:
            reference = hf_model(model_dir, perturbed(model_dir, seed=7))
            out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
            assert [o.outputs[0].token_ids for o in out] == [
                hf_greedy(reference, o.prompt_token_ids, 10) for o in out]
        assert_no_leaks(llm)
        assert trainer.finish() == 0


def test_broadcast_tensors_load_as_they_arrive_and_a_refused_update_is_drained():
    """The receiving side of the "nccl" backend, over a real gloo group (trainer and
    engine ranks in two threads): every tensor reaches its destination exactly as sent,
    whether it lands in the parameter itself (kept whole, same dtype) or goes through
    scratch (another dtype; a rank's slice); a refused update still drains every
    broadcast and leaves the parameters alone; an oversized one is refused before the
    first; a trainer that leaves midway is named."""
    import threading

    from helpers import free_port

    from pagellm.executor.model.weight_map import Destination
    from pagellm.executor.worker.weight_receiver import receive
    from pagellm.weights.nccl import (
        TransferInit,
        WeightGroup,
        specs_from_update_info,
        trainer_send_weights,
        update_info_for,
    )
    from pagellm.weights.tensor_codec import UpdateTooLarge, check_specs

    init = TransferInit(master_address="127.0.0.1", master_port=free_port(), world_size=2)
    groups: dict[int, WeightGroup] = {}

    def run(target, *args) -> threading.Thread:
        thread = threading.Thread(target=target, args=args, daemon=True)
        thread.start()
        return thread

    joins = [run(lambda r: groups.__setitem__(r, WeightGroup(init, r)), r) for r in (0, 1)]
    for thread in joins:
        thread.join(60)
    assert set(groups) == {0, 1} and groups[0].backend == groups[1].backend == "gloo"
    generator = torch.Generator().manual_seed(0)
    sent = [(f"w{i}", torch.randn(48, 40, generator=generator).to(dtype))
            for i, dtype in enumerate([torch.float32, torch.bfloat16, torch.float16,
                                       torch.float32])]
    specs = specs_from_update_info(update_info_for(sent))
    params = [torch.zeros(48, 40), torch.zeros(48, 40, dtype=torch.bfloat16),
              torch.zeros(48, 40), torch.zeros(48, 16)]  # [3]: this rank's 16 columns
    dests = [Destination(params[0], (48, 40)), Destination(params[1], (48, 40)),
             Destination(params[2], (48, 40)), Destination(params[3], (48, 40), 1, 8, 16)]
    want = [sent[0][1], sent[1][1], sent[2][1].float(), sent[3][1][:, 8:24]]
    assert [d.receiver(t.dtype, torch.device("cpu")) is not None
            for d, (_, t) in zip(dests, sent, strict=True)] == [True, True, False, False]
    try:
        trainer = run(trainer_send_weights, sent, groups[0])
        assert receive(groups[1], specs, dests) == len(sent)
        trainer.join(60)
        for got, expected in zip(params, want, strict=True):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
        before = [p.clone() for p in params]
        trainer = run(trainer_send_weights, [(n, t + 1) for n, t in sent], groups[0])
        assert receive(groups[1], specs, None) == len(sent)
        trainer.join(60)
        assert not trainer.is_alive()  # every broadcast was taken
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
        with pytest.raises(UpdateTooLarge, match="larger than the model allows"):
            check_specs(specs, limit_bytes=1000, limit_count=10)  # the worker's, first

        def send_half_and_leave() -> None:
            trainer_send_weights(sent[:2], groups[0])
            groups[0].close()

        trainer = run(send_half_and_leave)
        with pytest.raises(RuntimeError, match=r"broadcast 3 of 4 \(w2\) failed \(the model "
                                               r"now mixes old and new weights"):
            receive(groups[1], specs, dests)
        trainer.join(60)
    finally:
        for group in groups.values():
            group.close()


def test_a_broadcast_update_is_checked_in_the_same_place(model_dirs):
    """The "nccl" path refuses what the others do, before the first broadcast: a name
    given twice is refused after every broadcast was drained (the trainer never hangs)
    and the old weights keep serving; an update larger than the model allows is refused
    with nothing received. The group stays in step: a good update then lands."""
    from helpers import free_port

    from pagellm.weights.nccl import (
        trainer_init,
        trainer_send_weights,
        update_info_for,
    )

    model_dir = model_dirs["llama"]
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2}
    new = perturbed(model_dir, seed=7)
    info = update_info_for(new.items())
    first, second = (f"model.layers.{i}.self_attn.q_proj.weight" for i in (0, 1))
    twice = {**info, "names": [first if n == second else n for n in info["names"]]}
    copies = 2 * len(new)  # as many tensors as may come, too many bytes
    huge = {"names": ["model.embed_tokens.weight"] * copies,
            "dtype_names": ["float32"] * copies,
            "shapes": [list(new["model.embed_tokens.weight"].shape)] * copies}
    groups: list = []

    def send() -> threading.Thread:
        thread = threading.Thread(target=trainer_send_weights, args=(new.items(), groups[0]),
                                  daemon=True)
        thread.start()
        return thread

    with LLM(str(model_dir), weight_transfer_config={"backend": "nccl"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        before = greedy(llm)
        joiner = threading.Thread(target=lambda: groups.append(trainer_init(init_info, "cpu")),
                                  daemon=True)
        joiner.start()
        llm.init_weight_transfer_engine({"init_info": init_info})
        joiner.join(60)
        try:
            llm.start_weight_update()
            trainer = send()
            with pytest.raises(RuntimeError, match=rf"old weights kept: {first} appears more "
                                                   r"than once"):
                llm.update_weights({"update_info": twice})
            trainer.join(60)
            assert not trainer.is_alive()  # every broadcast was taken
            assert greedy(llm) == before
            with pytest.raises(RuntimeError, match=r"larger than the model allows \(\d+\); "
                                                   r"refused, nothing copied or received"):
                llm.update_weights({"update_info": huge})  # the trainer sends nothing
            trainer = send()
            assert llm.update_weights({"update_info": info}) == len(new)
            trainer.join(60)
            llm.finish_weight_update()
            assert greedy(llm) != before  # the good update landed, in step
        finally:
            for group in groups:
                group.close()


def test_phases_out_of_order_and_bad_init_info_are_errors(model_dirs):
    with LLM(str(model_dirs["llama"]), weight_transfer_config={"backend": "nccl"},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        with pytest.raises(RuntimeError, match="start_weight_update first"):
            llm.finish_weight_update()
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine first"):
            llm.update_weights({"update_info": {"names": [], "dtype_names": [],
                                                "shapes": []}})
        with pytest.raises(RuntimeError, match="world_size"):
            llm.init_weight_transfer_engine({"init_info": {
                "master_address": "127.0.0.1", "master_port": 1, "world_size": 1}})
        with pytest.raises(ValueError, match="init_info"):
            llm.init_weight_transfer_engine({"master_port": 1})
        # vLLM's packed broadcasts are spoken (test_packed_broadcast.py): an update_info
        # naming packing fields (vLLM < 0.28) is an update like any other, and its
        # fields and init_info's are bounded where they enter.
        from pagellm.weights.nccl import update_from_update_info

        empty = {"names": [], "dtype_names": [], "shapes": []}
        with pytest.raises(RuntimeError, match="init_weight_transfer_engine first"):
            llm.update_weights(update_from_update_info({**empty, "packed": True}))
        with pytest.raises(ValueError, match=r"unknown field.*is_checkpoint_format"):
            llm.update_weights({"update_info": {**empty, "is_checkpoint_format": True}})
        with pytest.raises(ValueError, match=r"packed_buffer_size_bytes must be <= "):
            update_from_update_info({**empty, "packed_buffer_size_bytes": 2**40})
        with pytest.raises(RuntimeError, match=r"packed_buffer_size_bytes must be >= 1"):
            llm.init_weight_transfer_engine({"init_info": {
                "master_address": "127.0.0.1", "master_port": 1, "world_size": 2,
                "packed": True, "packed_buffer_size_bytes": 0}})


def test_an_init_that_no_trainer_joins_fails_alone_naming_where_it_looked(model_dirs):
    """Issue 37, item 1, in process (the client steps the engine while the join waits):
    the join gives up after init_timeout_s naming the address; the next init starts
    clean; a host name beyond any DNS name is refused before anything connects."""
    port = free_port()
    info = {"init_info": {"master_address": "127.0.0.1", "master_port": port,
                          "world_size": 2}}
    with LLM(str(model_dirs["llama"]), weight_transfer_config={"backend": "nccl",
                                                               "init_timeout_s": 1},
             kv_cache_memory_bytes=8 * 2**20, multiprocess=False) as llm:
        for _ in range(2):  # a failed join leaves nothing behind: the second is the same
            start = time.monotonic()
            with pytest.raises(RuntimeError, match=rf"could not join the trainer's "
                                                   rf"weight-transfer group at 127.0.0.1:"
                                                   rf"{port} as rank 1 within "
                                                   rf"init_timeout_s=1"):
                llm.init_weight_transfer_engine(info)
            assert 1 <= time.monotonic() - start < 30
        with pytest.raises(RuntimeError, match="master_address must be a host name"):
            llm.init_weight_transfer_engine({"init_info": {
                **info["init_info"], "master_address": "x" * 254}})
        assert greedy(llm, PROMPTS[:1])
