"""weights/packed.py, and the "nccl" backend's packed updates on both sides (weights/
nccl.py, executor/worker/weight_receiver.py): vLLM's packed broadcast, as TRL's
VLLMClient drives it (init_info packed=True, then `packed_nccl_broadcast_producer`
while the engine is inside update_weights), and as vLLM < 0.28 did (packed in the
update_info). References: vLLM's chunking rule worked out by hand, the sent tensors
compared exactly, and transformers on the broadcast weights."""

from __future__ import annotations

import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from helpers import free_port
from rl_helpers import GREEDY, PROMPTS, greedy, hf_greedy, hf_model, perturbed

from pagellm import LLM
from pagellm.weights.packed import (
    chunk_bounds,
    packed_nccl_broadcast_consumer,
    packed_nccl_broadcast_producer,
)


class RecordingGroup:
    """The trainer's end of a group: keeps a copy of each broadcast, in order."""

    device = torch.device("cpu")

    def __init__(self) -> None:
        self.sent: list[torch.Tensor] = []

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        assert src == 0 and tensor.dtype == torch.uint8 and tensor.dim() == 1
        self.sent.append(tensor.clone())


class Replay:
    """A receiver's end of a group: each broadcast gets the next chunk the producer
    sent (and must be exactly its size)."""

    device = torch.device("cpu")

    def __init__(self, chunks: list[torch.Tensor]) -> None:
        self._chunks = iter(chunks)
        self.received = 0

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> None:
        chunk = next(self._chunks)
        assert src == 0 and tensor.shape == chunk.shape and tensor.dtype == torch.uint8
        tensor.copy_(chunk)
        self.received += 1


def tensors_of(sizes: list[int]) -> list[tuple[str, torch.Tensor]]:
    """One float16 tensor per size (in bytes, even), of distinct random values."""
    generator = torch.Generator().manual_seed(0)
    return [(f"w{i}", torch.randn(size // 2, generator=generator).half())
            for i, size in enumerate(sizes)]


# (tensor sizes in bytes, buffer_size_bytes, the chunks by vLLM's rule: a tensor joins
# the chunk until the chunk's bytes EXCEED the buffer; the crossing tensor stays in it)
CASES = [
    ([60, 60, 30, 250, 10], 100, [[0, 1], [2, 3], [4]]),  # 120 > 100; 280 > 100; the rest
    ([300, 10], 100, [[0], [1]]),  # a tensor larger than the buffer rides alone
    ([50, 50, 50], 100, [[0, 1, 2]]),  # exactly 100 is not more: the third crosses
    ([100, 2, 2], 100, [[0, 1], [2]]),  # exactly 100, then 102 crosses
    ([20, 40], 100, [[0, 1]]),  # all fits: one chunk of what there is
    ([2, 2, 2], 1, [[0], [1], [2]]),  # the smallest buffer: one tensor each
    ([], 100, []),  # nothing: no broadcast at all
]


@pytest.mark.parametrize(("sizes", "buffer", "chunks"), CASES)
def test_packed_chunks_follow_vllms_rule(sizes, buffer, chunks):
    """The producer broadcasts one uint8 tensor per chunk of vLLM's rule, its tensors'
    bytes back to back; the consumer and the engine's receiver plan the same chunks
    from names, shapes and dtypes alone, and the consumer gets every tensor back
    exactly."""
    sent = tensors_of(sizes)
    trainer = RecordingGroup()
    packed_nccl_broadcast_producer(iter(sent), trainer, src=0,
                                   post_iter_func=lambda item: item[1],
                                   buffer_size_bytes=buffer)
    assert [len(t) for t in trainer.sent] == [sum(sizes[i] for i in c) for c in chunks]
    for chunk, wire in zip(chunks, trainer.sent, strict=True):
        expected = torch.cat([sent[i][1].view(torch.uint8) for i in chunk])
        assert torch.equal(wire, expected)
    assert [list(r) for r in chunk_bounds(sizes, buffer)] == chunks

    got: list[tuple[str, torch.Tensor]] = []
    engine = Replay(trainer.sent)
    packed_nccl_broadcast_consumer(
        iter([(name, (list(t.shape), t.dtype)) for name, t in sent]), engine, src=0,
        post_unpack_func=got.extend, buffer_size_bytes=buffer, device="cpu")
    assert engine.received == len(chunks)
    assert [name for name, _ in got] == [name for name, _ in sent]
    assert all(torch.equal(g, s) for (_, g), (_, s) in zip(got, sent, strict=True))


def test_mixed_dtypes_round_trip_even_when_a_tensor_starts_off_its_alignment():
    """A float32 after three float16 values starts 6 bytes in: torch views no such
    bytes as float32, so the consumer hands a copy; 0-dim and empty tensors travel
    too, and post_iter_func's output (not the item's tensor) is what is sent."""
    sent = [("a", torch.tensor([1.0, 2.0, 3.0], dtype=torch.float16)),
            ("b", torch.arange(5, dtype=torch.float32)),
            ("c", torch.tensor(7.5, dtype=torch.bfloat16)),
            ("d", torch.zeros(0, 3)),
            ("e", torch.arange(6, dtype=torch.float32).reshape(2, 3).t())]  # not contiguous
    trainer = RecordingGroup()
    packed_nccl_broadcast_producer(iter(sent), trainer, 0, lambda item: item[1] * 2,
                                   buffer_size_bytes=1000)
    assert [len(t) for t in trainer.sent] == [6 + 20 + 2 + 0 + 24]
    got: list[tuple[str, torch.Tensor]] = []
    packed_nccl_broadcast_consumer(
        iter([(n, (list(t.shape), t.dtype)) for n, t in sent]), Replay(trainer.sent), 0,
        got.extend, buffer_size_bytes=1000, device="cpu")
    for (name, g), (_, s) in zip(got, sent, strict=True):
        assert g.dtype == s.dtype and torch.equal(g, s * 2), name


def test_bad_packing_values_are_refused_naming_the_field():
    from pagellm.protocol.utility import PackingFields
    from pagellm.weights.nccl import TransferInit, update_from_update_info

    def producer(**kw: Any) -> None:
        packed_nccl_broadcast_producer(iter([]), RecordingGroup(), 0, lambda i: i[1], **kw)

    with pytest.raises(ValueError, match=r"packed_buffer_size_bytes must be >= 1"):
        producer(buffer_size_bytes=0)
    with pytest.raises(ValueError, match=r"packed_num_buffers must be <= 16"):
        producer(num_buffers=17)
    base = {"master_address": "127.0.0.1", "master_port": 1, "world_size": 2}
    with pytest.raises(ValueError, match=r"packed_buffer_size_bytes must be <= 17179869184"):
        TransferInit(**base, packed_buffer_size_bytes=2**40)
    assert TransferInit(**base).packed is False  # vLLM's defaults
    assert (TransferInit(**base).packed_buffer_size_bytes,
            TransferInit(**base).packed_num_buffers) == (2**30, 2)
    empty = {"names": [], "dtype_names": [], "shapes": []}
    with pytest.raises(ValueError, match=r"update_info: packed must be a boolean"):
        update_from_update_info({**empty, "packed": "yes"})
    with pytest.raises(ValueError, match=r"packed_num_buffers must be >= 1"):
        update_from_update_info({**empty, "packed_num_buffers": 0})
    assert update_from_update_info({**empty, "packed": True}).packing == PackingFields(
        packed=True)
    assert update_from_update_info(empty).packing is None


def join_pair(init: Any) -> dict[int, Any]:
    """Ranks 0 and 1 of a gloo weight group in this process (each join waits for the
    other, so each runs on a thread of its own)."""
    from pagellm.weights.nccl import WeightGroup

    groups: dict[int, WeightGroup] = {}
    joins = [threading.Thread(target=lambda r=r: groups.__setitem__(r, WeightGroup(init, r)))
             for r in (0, 1)]
    for thread in joins:
        thread.start()
    for thread in joins:
        thread.join(60)
    return groups


def test_the_group_broadcasts_only_from_rank_0():
    from pagellm.weights.nccl import TransferInit

    init = TransferInit(master_address="127.0.0.1", master_port=free_port(), world_size=2,
                        packed=True, packed_buffer_size_bytes=64)
    groups = join_pair(init)
    try:
        assert groups[0].packing == groups[1].packing  # both sides' from init_info
        assert (groups[0].packing.packed, groups[0].packing.buffer_size_bytes) == (True, 64)
        with pytest.raises(ValueError, match="broadcast src=1: the trainer, rank 0"):
            groups[1].broadcast(torch.zeros(1), src=1)
    finally:
        for group in groups.values():
            group.close()


def test_the_receive_scratch_is_one_chunk_never_the_named_buffer(monkeypatch):
    """Over a real gloo group: a client that names a 16 GiB buffer for a small update
    gets a scratch of the update's own bytes; every tensor lands exactly, whether in
    the parameter itself (a chunk of one tensor kept whole) or through the scratch (a
    chunk of several; another dtype; a rank's slice), and a refused update is drained."""
    from pagellm.executor.model.weight_map import Destination
    from pagellm.executor.worker import weight_receiver
    from pagellm.weights.nccl import (
        TransferInit,
        specs_from_update_info,
        update_info_for,
    )

    init = TransferInit(master_address="127.0.0.1", master_port=free_port(), world_size=2)
    groups = join_pair(init)
    generator = torch.Generator().manual_seed(0)
    sent = [("big", torch.randn(64, 40, generator=generator)),  # 10240 B > buffer: alone
            ("a", torch.randn(10, generator=generator)),
            ("b", torch.randn(8, 4, generator=generator).half()),
            ("c", torch.randn(6, 8, generator=generator))]
    specs = specs_from_update_info(update_info_for(sent))
    params = [torch.zeros(64, 40), torch.zeros(10), torch.zeros(8, 4), torch.zeros(6, 4)]
    dests = [Destination(params[0], (64, 40)), Destination(params[1], (10,)),
             Destination(params[2], (8, 4)), Destination(params[3], (6, 8), 1, 4, 4)]
    want = [sent[0][1], sent[1][1], sent[2][1].float(), sent[3][1][:, 4:8]]
    allocated: list[int] = []
    empty = torch.empty

    def spy(*args: Any, **kwargs: Any) -> torch.Tensor:
        tensor = empty(*args, **kwargs)
        if threading.current_thread() is threading.main_thread():
            allocated.append(tensor.numel() * tensor.element_size())
        return tensor

    def send(pairs: list[tuple[str, torch.Tensor]], buffer: int) -> threading.Thread:
        thread = threading.Thread(target=packed_nccl_broadcast_producer, daemon=True,
                                  args=(iter(pairs), groups[0], 0, lambda i: i[1], buffer))
        thread.start()
        return thread

    try:
        monkeypatch.setattr(torch, "empty", spy)
        trainer = send(sent, 2**34)
        assert weight_receiver.receive(groups[1], specs, dests, 2**34) == len(sent)
        trainer.join(60)
        update_bytes = sum(t.numel() * t.element_size() for _, t in sent)
        assert allocated == [update_bytes]  # one chunk of everything
        for got, expected in zip(params, want, strict=True):
            assert torch.equal(got, expected)
        allocated.clear()
        trainer = send(sent, 100)  # chunks: [big] 10240 B, [a, b] 40 + 64, [c] 192
        assert weight_receiver.receive(groups[1], specs, dests, 100) == len(sent)
        trainer.join(60)
        assert allocated == [192]  # c, a slice: big went straight into its parameter
        before = [p.clone() for p in params]
        trainer = send([(n, t + 1) for n, t in sent], 100)
        assert weight_receiver.receive(groups[1], specs, None, 100) == len(sent)
        trainer.join(60)
        assert not trainer.is_alive()  # every chunk was taken
        assert all(torch.equal(p, b) for p, b in zip(params, before, strict=True))
    finally:
        monkeypatch.undo()
        for group in groups.values():
            group.close()


# --- end to end: an engine with weight_transfer_config={"backend": "nccl"} -------------


class Trainer:
    """rank 0 of the group, in a thread of this process, counting its broadcasts."""

    def __init__(self, init_info: dict[str, Any]) -> None:
        self.init_info = init_info
        self.group: Any = None
        self.broadcasts = 0
        self._joiner = threading.Thread(target=self._join, daemon=True)
        self._joiner.start()

    def _join(self) -> None:
        from pagellm.weights.nccl import trainer_init

        group = trainer_init(self.init_info, "cpu")
        broadcast = group.broadcast

        def counted(tensor: torch.Tensor, src: int = 0) -> None:
            self.broadcasts += 1
            broadcast(tensor, src=src)

        group.broadcast = counted
        self.group = group

    def joined(self) -> None:
        self._joiner.join(60)
        assert self.group is not None

    def run(self, send: Callable[[], object]) -> threading.Thread:
        self.broadcasts = 0
        thread = threading.Thread(target=send, daemon=True)
        thread.start()
        return thread


def start(model_dir: Path, **packing: Any) -> tuple[LLM, Trainer]:
    init_info = {"master_address": "127.0.0.1", "master_port": free_port(),
                 "rank_offset": 1, "world_size": 2, **packing}
    llm = LLM(str(model_dir), weight_transfer_config={"backend": "nccl"},
              kv_cache_memory_bytes=8 * 2**20, multiprocess=False)
    try:
        trainer = Trainer(init_info)
        llm.init_weight_transfer_engine({"init_info": init_info})
        trainer.joined()
    except BaseException:
        llm.shutdown()
        raise
    return llm, trainer


def assert_serves(llm: LLM, model_dir: Path, weights: dict[str, torch.Tensor]) -> None:
    reference = hf_model(model_dir, weights)
    out = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in out] == [
        hf_greedy(reference, o.prompt_token_ids, 10) for o in out]


def test_trl_streams_a_packed_update_into_the_engine(model_dirs):
    """TRL 1.16's VLLMClient against vLLM >= 0.28: init_info packed=True (a small
    buffer: several chunks), then every weight streamed by
    `packed_nccl_broadcast_producer(named_params, group, src=0, post_iter_func=...)`
    while the engine is inside update_weights with the three lists only. Fewer
    broadcasts than tensors, and the engine then serves what transformers does on the
    new weights."""
    from pagellm.weights.nccl import update_info_for

    model_dir = model_dirs["llama"]
    buffer = 40_000
    llm, trainer = start(model_dir, packed=True, packed_buffer_size_bytes=buffer)
    try:
        new = perturbed(model_dir, seed=11)
        info = update_info_for(new.items())
        assert set(info) == {"names", "dtype_names", "shapes"}
        llm.start_weight_update()
        sending = trainer.run(lambda: packed_nccl_broadcast_producer(
            iterator=iter(new.items()), group=trainer.group, src=0,
            post_iter_func=lambda item: item[1], buffer_size_bytes=buffer))
        assert llm.update_weights({"update_info": info}) == len(new)
        sending.join(60)
        llm.finish_weight_update()
        sizes = [t.numel() * t.element_size() for t in new.values()]
        assert 1 < trainer.broadcasts == len(chunk_bounds(sizes, buffer)) < len(new)
        assert_serves(llm, model_dir, new)
    finally:
        trainer.group.close()
        llm.shutdown()


def test_a_refused_packed_update_is_drained_and_the_old_weights_serve(model_dirs):
    """One name the model lacks: the engine refuses the update naming it, after taking
    every chunk (the trainer never hangs), and serves the old weights; the group stays
    in step: `trainer_send_weights` then sends packed, as the group was initialized,
    and that update lands."""
    from pagellm.weights.nccl import trainer_send_weights, update_info_for

    model_dir = model_dirs["llama"]
    llm, trainer = start(model_dir, packed=True, packed_buffer_size_bytes=50_000)
    try:
        before = greedy(llm)
        new = perturbed(model_dir, seed=12)
        bad = {("model.layers.9.mlp.up_proj.weight" if name.endswith("1.mlp.up_proj.weight")
                else name): t for name, t in new.items()}
        llm.start_weight_update()
        sending = trainer.run(lambda: trainer_send_weights(bad.items(), trainer.group))
        with pytest.raises(RuntimeError, match=r"old weights kept: model\.layers\.9\.mlp\."
                                               r"up_proj\.weight: no such weight"):
            llm.update_weights({"update_info": update_info_for(bad.items())})
        sending.join(60)
        assert not sending.is_alive()  # every chunk was taken
        assert 1 < trainer.broadcasts < len(bad)
        assert greedy(llm) == before
        sending = trainer.run(lambda: trainer_send_weights(new.items(), trainer.group))
        assert llm.update_weights({"update_info": update_info_for(new.items())}) == len(new)
        sending.join(60)
        llm.finish_weight_update()
        assert 1 < trainer.broadcasts < len(new)
        assert_serves(llm, model_dir, new)
    finally:
        trainer.group.close()
        llm.shutdown()


def test_old_vllm_names_packing_in_the_update_info(model_dirs):
    """vLLM < 0.28: init_info without packing, each update_info with it: the engine
    follows the update's fields over the init_info's, for that update only (the next,
    one tensor per broadcast again, lands too). `trainer_send_weights(packed=True)` on
    a group initialized unpacked says so in the update_info it returns."""
    from pagellm.weights.nccl import (
        trainer_send_weights,
        update_from_update_info,
        update_info_for,
    )

    model_dir = model_dirs["llama"]
    llm, trainer = start(model_dir)
    try:
        new = perturbed(model_dir, seed=13)
        info = {**update_info_for(new.items()), "packed": True,
                "packed_buffer_size_bytes": 30_000}
        llm.start_weight_update()
        sending = trainer.run(lambda: packed_nccl_broadcast_producer(
            iter(new.items()), trainer.group, 0, lambda item: item[1], 30_000))
        assert llm.update_weights(update_from_update_info(info)) == len(new)
        sending.join(60)
        assert 1 < trainer.broadcasts < len(new)
        assert_serves(llm, model_dir, new)

        newer = perturbed(model_dir, seed=14)
        assert update_info_for(newer.items(), packed=True)["packed"] is True
        sending = trainer.run(lambda: trainer_send_weights(newer.items(), trainer.group,
                                                           packed=True))
        assert llm.update_weights(update_from_update_info(
            update_info_for(newer.items(), packed=True))) == len(newer)
        sending.join(60)
        assert trainer.broadcasts == 1  # vLLM's default buffer (1 GiB) holds it all
        sending = trainer.run(lambda: trainer_send_weights(new.items(), trainer.group))
        assert llm.update_weights({"update_info": update_info_for(new.items())}) == len(new)
        sending.join(60)
        assert trainer.broadcasts == len(new)  # the init_info's way: one per tensor
        llm.finish_weight_update()
        assert_serves(llm, model_dir, new)
    finally:
        trainer.group.close()
        llm.shutdown()
