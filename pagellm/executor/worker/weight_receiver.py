"""One worker's weight updates: the checks every update passes before the first byte of
it is copied or received, and the three ways one arrives (CUDA IPC handles, a
shared-memory buffer, a broadcast over the weight-transfer group: one tensor per
broadcast, or vLLM's packed chunks). A bad update changes nothing: every name, shape and
dtype is checked first, and the old weights keep serving.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import msgspec
import torch

from pagellm.executor.model.decoder import DecoderForCausalLM
from pagellm.executor.model.weight_map import Destination
from pagellm.executor.worker import memory
from pagellm.protocol.engine_args import DEFAULT_INIT_TIMEOUT_S
from pagellm.protocol.utility import WeightSpec, WeightUpdate
from pagellm.weights.cuda_ipc import open_cuda_ipc
from pagellm.weights.nccl import TransferInit, WeightGroup
from pagellm.weights.packed import chunk_bounds, unpack_tensor
from pagellm.weights.shm import buffer_limit, open_update
from pagellm.weights.tensor_codec import DTYPES, UpdateTooLarge, check_specs, spec_bytes


class WeightUpdates:
    """The weight-transfer side of one worker (`Worker.updates`).

    `config` is the engine's weight_transfer_config (None: updates refused);
    `global_rank` numbers this worker among every worker of every data-parallel engine
    core (vLLM's numbering: core by core, tensor-parallel ranks within each), of
    `workers` in all."""

    def __init__(self, model: DecoderForCausalLM, device: torch.device,
                 config: dict[str, Any] | None, world_size: int, global_rank: int,
                 workers: int) -> None:
        self.model, self.device, self.config = model, device, config
        self.global_rank, self.workers = global_rank, workers
        self.group: WeightGroup | None = None
        self._join: PendingJoin | None = None  # a join in progress (init_engine)
        # The most one update may carry, on every path (`check_specs`): a broadcast is
        # received even when refused, and specs may point many times at one region of a
        # buffer. Each rank holds at least 1/world_size of every tensor, so a full
        # checkpoint is at most world_size x this rank's bytes; twice that for one sent
        # in a wider dtype (float32 to a 16-bit model). Taken while awake: asleep, the
        # parameters hold no bytes.
        self.limit = 2 * world_size * memory.parameter_bytes(model)
        # And at most twice the checkpoint's tensors (room for the ones we skip: RoPE
        # tables, a tied LM head's copy).
        self.max_specs = 2 * len(model.checkpoint_keys())

    def init_engine(self, init_info: dict[str, Any]) -> None:
        """Start joining the trainer's group (backend "nccl"; "ipc" needs nothing) and
        return: the join waits for the trainer, up to the config's init_timeout_s, on a
        thread of its own, so the engine keeps stepping (`joined` says when it is done).
        A second init while one is pending, or after one succeeded, is refused."""
        if self.config is None:
            raise RuntimeError("weight updates need the engine started with "
                               "weight_transfer_config")
        if self.config["backend"] != "nccl":
            return
        if self._join is not None:
            raise RuntimeError("init_weight_transfer_engine is already in progress (waiting "
                               "for the trainer to join)")
        if self.group is not None:
            raise RuntimeError("the weight-transfer engine is already initialized")
        init = msgspec.convert(init_info, TransferInit)
        # Refused by every worker alike before any joins: a rank past the group's size
        # would wait out the join timeout.
        if init.rank_offset + self.workers > init.world_size:
            raise ValueError(
                f"init_info world_size={init.world_size} cannot hold this engine's "
                f"{self.workers} worker(s) from rank_offset={init.rank_offset}: it needs at "
                f"least rank_offset + data_parallel_size x tensor_parallel_size = "
                f"{init.rank_offset + self.workers}")
        timeout = float(self.config.get("init_timeout_s", DEFAULT_INIT_TIMEOUT_S))
        rank, device = init.rank_offset + self.global_rank, self.device
        where = f"{init.master_address}:{init.master_port}"
        self._join = PendingJoin(
            lambda: WeightGroup(init, rank=rank, device=device, join_timeout_s=timeout),
            f"could not join the trainer's weight-transfer group at {where} as rank {rank} "
            f"within init_timeout_s={timeout:g}")

    def joined(self) -> bool:
        """False while a join started by `init_engine` waits; True once it is done (or
        none was started). A failed join raises its error once, and a new init may be
        tried."""
        if self._join is None:
            return True
        try:
            group = self._join.result()
        except RuntimeError:
            self._join = None
            raise
        if group is None:
            return False
        self.group, self._join = group, None
        return True

    def abandon_join(self) -> None:
        """Another rank's join failed: leave the group this one joined, or will join
        (its pending join closes what it makes), so that a new init starts clean."""
        if self._join is not None:
            self._join.abandon()
            self._join = None
        if self.group is not None:
            self.group.close()
            self.group = None

    def apply(self, update: WeightUpdate, weights_asleep: bool) -> int:
        """Copy the update's tensors into the model; the update as a whole (`_check`)
        and every name, shape and dtype are checked before the first copy. Returns the
        number of tensors loaded."""
        if update.cuda_ipc is not None:  # opened first: refused or not, released after
            with open_cuda_ipc(update, self.global_rank) as tensors:
                self._check(update, weights_asleep)
                self._load_checked(tensors)
                return len(tensors)
        if update.buffer is not None:
            self._check(update, weights_asleep)
            with open_update(update) as tensors:
                self._load_checked(tensors)
            return len(tensors)
        if self.group is None:
            if self.config is not None and self.config["backend"] != "nccl":
                raise RuntimeError(
                    "an update_info update (names, dtypes and shapes only) is broadcast "
                    "over backend 'nccl'; this engine's backend is "
                    f"{self.config['backend']!r}: send the tensors themselves")
            raise RuntimeError("a weight update without a buffer arrives over the "
                               "weight-transfer group: init_weight_transfer_engine first"
                               + (" (it is still waiting for the trainer to join)"
                                  if self._join is not None else ""))
        # Every name and shape is checked before the first broadcast arrives, so the
        # tensors can load as they come (one tensor, or one packed chunk, in memory at a
        # time); a refused update is still received, into scratch, so the trainer never
        # hangs; but not one larger than the model allows, nor one with a spec that is
        # no weight (`receive` refuses it before the first broadcast): nothing of those
        # is received.
        packing = self.group.packing.override(update.packing)
        chunk_bytes = packing.buffer_size_bytes if packing.packed else None
        try:
            self._check(update, weights_asleep)
            dests = self._destinations([(spec.name, spec.shape) for spec in update.specs])
        except UpdateTooLarge:
            raise
        except (RuntimeError, ValueError):
            receive(self.group, update.specs, None, chunk_bytes)
            raise
        loaded = receive(self.group, update.specs, dests, chunk_bytes)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.model.mark_loaded(spec.name for spec in update.specs)
        return loaded

    @contextlib.contextmanager
    def open(self, update: WeightUpdate, limit_bytes: int
             ) -> Iterator[list[tuple[str, torch.Tensor]]]:
        """An update's tensors (shared memory or CUDA IPC), valid inside the `with`, for
        what is not the model's weights (a LoRA adapter from tensors): the update as a
        whole checked as `_check` does, against `limit_bytes` of its own."""
        if self.config is None:
            raise RuntimeError("tensors sent in memory need the engine started with "
                               "weight_transfer_config={'backend': 'ipc'}")
        check_specs(update.specs, limit_bytes, self.max_specs)
        if update.cuda_ipc is not None:
            with open_cuda_ipc(update, self.global_rank) as tensors:
                yield tensors
            return
        if update.buffer is None:
            raise ValueError("tensors sent in memory need a buffer (backend 'ipc')")
        if update.buffer_bytes > buffer_limit(limit_bytes, len(update.specs)):
            raise UpdateTooLarge(f"buffer of {update.buffer_bytes} bytes is larger than "
                                 f"its tensors need ({limit_bytes} bytes at most, aligned); "
                                 "refused, nothing read")
        with open_update(update) as tensors:
            yield tensors

    def _check(self, update: WeightUpdate, weights_asleep: bool) -> None:
        """What every path checks first, before any byte of the update is copied or
        received: that this engine takes updates, the update's size and names
        (`check_specs`), then that the weights are awake (after the size: an update
        refused while asleep is drained, one too large never is)."""
        if self.config is None:
            raise RuntimeError("weight updates need the engine started with "
                               "weight_transfer_config={'backend': 'ipc'}")
        check_specs(update.specs, self.limit, self.max_specs)
        if update.buffer is not None and update.buffer_bytes > buffer_limit(
                self.limit, len(update.specs)):  # read whole into host memory
            raise UpdateTooLarge(f"weight buffer of {update.buffer_bytes} bytes is larger "
                                 f"than its tensors need ({self.limit} bytes at most, "
                                 "aligned); refused, nothing read")
        if weights_asleep:
            raise RuntimeError("the weights are asleep; wake_up(tags=['weights']) first")

    def _destinations(self, shapes: list[tuple[str, Sequence[int]]]) -> list[Destination]:
        """Where each `(checkpoint name, full shape)` of an update loads on this rank
        (each rank takes its slice); ValueError naming every one that does not fit, so
        that a bad update changes nothing."""
        params = dict(self.model.named_parameters())
        dests, problems = [], []
        for name, shape in shapes:
            dest = self.model.destination(name, params)
            if dest is None:
                problems.append(f"{name}: no such weight in the model")
            elif dest.tensor is not None and dest.shape != tuple(shape):
                problems.append(f"{name}: shape {tuple(shape)}, the model's is {dest.shape}")
            else:
                dests.append(dest)
        if problems:
            more = f" (and {len(problems) - 8} more)" if len(problems) > 8 else ""
            raise ValueError(f"weight update refused, old weights kept: "
                             f"{'; '.join(problems[:8])}{more}")
        return dests

    def _load_checked(self, tensors: list[tuple[str, torch.Tensor]]) -> None:
        """Copy only when every tensor fits: a bad update changes nothing."""
        dests = self._destinations([(name, tensor.shape) for name, tensor in tensors])
        for dest, (_, tensor) in zip(dests, tensors, strict=True):
            dest.load(tensor, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # the sources may go away on return
        self.model.mark_loaded(name for name, _ in tensors)


class PendingJoin:
    """Joining the trainer's weight-transfer group on a thread of its own. The join
    waits in torch's TCPStore and gloo/NCCL rendezvous (which release the GIL) for a
    trainer that may be slow, misconfigured or absent; on the engine's loop it held up
    every client's steps for up to the whole timeout."""

    def __init__(self, make: Callable[[], WeightGroup], failure: str) -> None:
        self._failure = failure
        self._lock = threading.Lock()  # the group's hand-over against `abandon`
        self._abandoned = False
        self._group: WeightGroup | None = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(make,),
                                        name="weight-transfer-join", daemon=True)
        self._thread.start()

    def _run(self, make: Callable[[], WeightGroup]) -> None:
        try:
            group = make()
        except BaseException as e:  # reported by `result`, on the loop's thread
            self._error = e
            return
        with self._lock:
            if self._abandoned:
                group.close()
            else:
                self._group = group

    def result(self) -> WeightGroup | None:
        """The group once joined; None while the join waits; RuntimeError naming the
        address and the cause if it failed."""
        if self._thread.is_alive():
            return None
        if self._error is not None:
            cause = str(self._error).splitlines()[0][:300] if str(self._error) else ""
            raise RuntimeError(f"{self._failure}: {type(self._error).__name__}: {cause}")
        return self._group

    def abandon(self) -> None:
        """Drop the group, now or whenever the join finishes."""
        with self._lock:
            self._abandoned = True
            if self._group is not None:
                self._group.close()
                self._group = None


def receive(group: WeightGroup, specs: list[WeightSpec], dests: list[Destination] | None,
            packed_buffer_size_bytes: int | None = None) -> int:
    """Receive every spec's tensor in order, loading each into `dests[i]` (where it
    goes in the model: the caller has checked names and shapes) as it arrives; with
    `dests` None (an update refused before anything arrived) receive them all the same,
    into scratch, so the trainer's broadcasts never hang. The caller has passed the
    specs through `check_specs` (never receive, not even into scratch, an update larger
    than the model allows). Returns the number of tensors received. One broadcast per
    tensor, or with `packed_buffer_size_bytes` vLLM's packed chunks (`_receive_packed`).

    A tensor this rank keeps whole, in the parameter's dtype, lands in the parameter
    itself. Any other lands in one scratch buffer the size of the largest such, reused,
    and is copied from there: never the whole update in memory (on a GPU, a model's
    worth), nor a fresh allocation per tensor (on the CPU, each one's pages faulted in
    and zeroed again: 2.3-2.7 s for a 2 GB update, against 0.8-1.0 s in place)."""
    sizes = [spec_bytes(spec) for spec in specs]
    direct: list[torch.Tensor | None] = [None] * len(specs)  # the parameter, if in place
    if dests is not None:
        direct = [dest.receiver(DTYPES[spec.dtype], group.device)
                  for spec, dest in zip(specs, dests, strict=True)]
    if packed_buffer_size_bytes is not None:
        return _receive_packed(group, specs, sizes, dests, direct, packed_buffer_size_bytes)
    scratch = torch.empty(  # [bytes of the largest tensor received indirectly]
        max((size for size, d in zip(sizes, direct, strict=True) if d is None), default=0),
        dtype=torch.uint8, device=group.device)
    for index, (spec, size, into) in enumerate(zip(specs, sizes, direct, strict=True)):
        tensor = into if into is not None else \
            scratch[:size].view(DTYPES[spec.dtype]).view(spec.shape)
        try:
            group.broadcast(tensor)
        except RuntimeError as e:  # the trainer died or timed out midway
            mixed = (" (the model now mixes old and new weights: push the update again)"
                     if dests is not None and (index or into is not None) else "")
            raise RuntimeError(f"weight broadcast {index + 1} of {len(specs)} ({spec.name}) "
                               f"failed{mixed}: {e}") from e
        if dests is not None and into is None:
            dests[index].load(tensor)  # blocking: the next broadcast overwrites scratch
    return len(specs)


def _receive_packed(group: WeightGroup, specs: list[WeightSpec], sizes: list[int],
                    dests: list[Destination] | None, direct: list[torch.Tensor | None],
                    buffer_size_bytes: int) -> int:
    """`receive` for vLLM's packed broadcasts: the chunks are planned from the specs
    alone (weights/packed.py's rule, the trainer's), each arrives into one scratch
    buffer the size of the largest chunk, reused, and its tensors load from there
    before the next. So the scratch never exceeds the update's own bytes, whatever
    buffer size the client named. A chunk of a single tensor this rank keeps whole, in
    the parameter's dtype (a tensor larger than the buffer, as an embedding often is),
    lands in the parameter itself, as in `receive`."""
    chunks = chunk_bounds(sizes, buffer_size_bytes)
    into = [direct[c[0]] if len(c) == 1 else None for c in chunks]
    scratch = torch.empty(  # [bytes of the largest chunk received into scratch]
        max((sum(sizes[i] for i in c) for c, d in zip(chunks, into, strict=True)
             if d is None), default=0), dtype=torch.uint8, device=group.device)
    for index, (chunk, param) in enumerate(zip(chunks, into, strict=True)):
        nbytes = sum(sizes[i] for i in chunk)
        # [chunk bytes] uint8: the parameter's own bytes, or the scratch's first ones
        buffer = scratch[:nbytes] if param is None else param.view(-1).view(torch.uint8)
        try:
            group.broadcast(buffer)
        except RuntimeError as e:  # the trainer died or timed out midway
            mixed = (" (the model now mixes old and new weights: push the update again)"
                     if dests is not None and (index or param is not None) else "")
            first = specs[chunk[0]].name
            raise RuntimeError(
                f"packed weight broadcast {index + 1} of {len(chunks)} ({len(chunk)} "
                f"tensor(s) from {first}) failed{mixed}: {e}") from e
        if dests is None or param is not None:
            continue
        tensors = unpack_tensor(buffer, [specs[i].name for i in chunk],
                                [specs[i].shape for i in chunk],
                                [DTYPES[specs[i].dtype] for i in chunk],
                                [sizes[i] for i in chunk])
        for i, (_, tensor) in zip(chunk, tensors, strict=True):
            dests[i].load(tensor)  # blocking: the next chunk overwrites scratch
    return len(specs)
