"""The worker: one rank's device, its slice of the model and its KV cache.

With one device the executor calls it in the engine core's process; under tensor
parallelism each rank runs one in its own process (executor/multiproc.py) and the
executor calls the same methods over the wire. Its methods take and return what
msgspec can carry for that reason. It is also what `collective_rpc` extension methods
see as `self`: `worker_extension_cls` is mixed into this class (vLLM's attributes:
`self.model_runner`, `self.device`, `self.rank`, `self.local_rank`, `self.world_size`).
"""

from __future__ import annotations

import logging
import os
import time
from typing import Any

import psutil
import torch

from pagellm.executor.lora.manager import LoRAManager, LoRASettings
from pagellm.executor.model.config import (
    ModelConfig,
    resolve_device,
    resolve_draft_config,
    resolve_model_config,
)
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.worker import memory
from pagellm.executor.worker.model_runner import ModelRunner
from pagellm.executor.worker.sampler import step_peak_bytes
from pagellm.executor.worker.weight_receiver import WeightUpdates
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput
from pagellm.protocol.utility import WeightUpdate
from pagellm.weights.tensor_codec import decode_value, encode_value

logger = logging.getLogger("pagellm")

# Share of available RAM the CPU KV cache may take by default: the rest stays for the
# weights' working set, activations, the frontend and the OS.
CPU_KV_CACHE_RAM_SHARE = 0.3


def device_for(args: EngineArgs, local_rank: int) -> torch.device:
    """The device of tensor-parallel rank `local_rank` on this node: on CUDA, data-parallel
    core d's ranks take the devices after those of cores before it on the node."""
    device = resolve_device(args.device)
    if device.type != "cuda":
        return device
    if args.distributed_executor_backend == "external_launcher" and device.index is None:
        # The launcher started one process per GPU, each with its own engine (vLLM's).
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    if args.distributed_executor_backend == "ray":
        return torch.device("cuda", 0)  # a Ray actor sees only the GPU Ray gave it
    per_node = args.tensor_parallel_size // args.nnodes
    index = ((device.index or 0) + (args.data_parallel_rank - args.data_parallel_start_rank)
             * per_node + local_rank)
    count = torch.cuda.device_count()
    if index >= count:
        raise ValueError(f"tensor-parallel rank {local_rank} of data-parallel rank "
                         f"{args.data_parallel_rank} needs cuda:{index}, but this node has "
                         f"{count} CUDA device(s)")
    return torch.device("cuda", index)


class Worker:
    """One rank (rank 0 of 1 without tensor parallelism). Start-up is two-phase because
    the KV cache must be the same size on every rank: `kv_cache_budget` profiles, the
    executor takes the smallest, then `initialize_kv_cache` allocates it."""

    def __init__(self, args: EngineArgs, rank: int = 0, local_rank: int = 0,
                 world_size: int = 1, local_world_size: int = 1) -> None:
        self.rank, self.local_rank, self.world_size = rank, local_rank, world_size
        self.local_world_size = local_world_size
        self.device = device_for(args, local_rank)
        self.model_config: ModelConfig = resolve_model_config(args)
        self.max_num_batched_tokens = max_num_batched_tokens(args, self.device)
        self.block_size = args.block_size
        # Blocks one request of max_model_len needs: the cache must hold at least that.
        self.blocks_per_request = -(-self.model_config.max_model_len // self.block_size)
        self.args = args
        if self.device.type == "cuda":  # what others (and our context) hold before loading
            torch.cuda.set_device(self.device)
            free, total = torch.cuda.mem_get_info(self.device)
            self._used_before = total - free
        tp = TensorParallel.layout(self.model_config.spec, rank, world_size)
        self.model_runner = ModelRunner(self.model_config, self.device, args.block_size,
                                        args.max_num_seqs, self.max_num_batched_tokens,
                                        args.seed, args.attention_backend,
                                        args.logprobs_mode, tp, self._host_ranks(),
                                        lora_settings(args),
                                        resolve_draft_config(args, self.model_config),
                                        args.speculative.num_speculative_tokens
                                        if args.speculative is not None else 0)
        self.num_kv_blocks = 0
        # (Not yet for models with per-request state: their steps index it by request.)
        self.use_cuda_graphs = (self.device.type == "cuda" and not args.enforce_eager
                                and self.model_runner.attention.name == "triton"
                                and not self.model_runner.state_shapes)
        self.enable_sleep_mode = args.enable_sleep_mode
        self.sleeping: set[str] = set()  # tags ("weights", "kv_cache") now freed
        self._weight_shapes = memory.shapes(self.model_runner.model)
        self._weight_backup: memory.HostBackup | None = None
        self.updates = WeightUpdates(
            self.model_runner.model, self.device, args.weight_transfer_config, world_size,
            global_rank=args.data_parallel_rank * world_size + rank,
            workers=args.data_parallel_size * world_size)

    @property
    def runner(self) -> ModelRunner:
        return self.model_runner

    def kv_cache_budget(self) -> tuple[int, str, int]:
        """(bytes this rank can give the KV cache, where that figure comes from, bytes
        per block)."""
        args = self.args
        if args.kv_cache_memory_bytes is not None:
            budget, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
            # Refused now rather than allocated lazily and OOM-killed mid-serving.
            available = (torch.cuda.mem_get_info(self.device)[0]
                         if self.device.type == "cuda" else psutil.virtual_memory().available)
            if budget > available:
                raise ValueError(f"kv_cache_memory_bytes={budget} is more than {self.device} "
                                 f"has available ({available} bytes)")
            if self.device.type == "cpu":
                self._check_step_fits(available - budget, "next to kv_cache_memory_bytes")
        elif self.device.type == "cuda":
            budget, source = self._profiled_cuda_budget(args, self._used_before), (
                "gpu_memory_utilization after profiling")
        else:
            budget, source = self._cpu_budget(args), "available RAM"
        # The per-request states of the layers that keep one (lfm2.py, qwen3_5.py) come
        # out of it: max_num_seqs rows of them, whatever the requests' lengths.
        states, per_block = self.model_runner.state_bytes(), \
            self.model_runner.kv_cache_bytes_per_block()
        if states and budget - states < self.blocks_per_request * per_block:
            rows = args.max_num_seqs
            raise ValueError(
                f"the per-request states of {self.model_config.spec.architecture}'s "
                f"{len(self.model_runner.state_shapes)} stateful layers take "
                f"{states / 2**30:.2f} GiB for max_num_seqs={rows} rows "
                f"({states // rows} bytes a request), leaving less than one request of "
                f"max_model_len={self.model_config.max_model_len} needs in the KV "
                f"cache's {budget / 2**30:.2f} GiB ({source}); lower max_num_seqs")
        return budget - states, source, per_block

    def _check_step_fits(self, room: int, where: str) -> None:
        """On the CPU, where no step is profiled: refuse a max_num_seqs whose logits (and
        the sampler's copies of them) would not fit in `room` bytes, rather than be
        OOM-killed by the first full batch. On CUDA `profile_run` measures them."""
        rows, vocab = self.args.max_num_seqs, self.model_config.vocab_size
        step = step_peak_bytes(rows, vocab)
        if step > room:
            raise ValueError(
                f"one step's logits need {step} bytes ({step / 2**30:.1f} GiB: "
                f"max_num_seqs={rows} rows x vocab_size={vocab}, fp32, with the sampler's "
                f"working copies), more than the {max(room, 0)} bytes "
                f"({max(room, 0) / 2**30:.1f} GiB) of RAM available {where}; "
                f"lower max_num_seqs")

    def initialize_kv_cache(self, num_blocks: int) -> None:
        self.num_kv_blocks = num_blocks
        self.model_runner.initialize_kv_cache(num_blocks)
        gib = num_blocks * self.model_runner.kv_cache_bytes_per_block() / 2**30
        logger.info("KV cache: %d blocks (%d tokens), %.2f GiB on %s", num_blocks,
                    num_blocks * self.block_size, gib, self.device)
        self._capture_graphs()

    def _capture_graphs(self) -> None:
        if not self.use_cuda_graphs:
            return
        try:
            graphs, seconds = self.runner.capture_cuda_graphs()
        except RuntimeError as e:
            raise RuntimeError(f"capturing CUDA graphs for decode steps failed ({e}); "
                               "enforce_eager=True runs without them") from e
        logger.info("CUDA graphs: %d decode batch sizes captured in %.1f s", graphs, seconds)

    # -- sleep mode ------------------------------------------------------------------

    def sleep(self, level: int) -> list[str]:
        """Level 1: the KV cache is freed and the weights go to host memory (where they
        already are on the CPU); level 2: both are discarded. What is freed goes back to
        the system (`memory.release`). Tags already asleep stay as they are."""
        if not self.enable_sleep_mode:
            raise RuntimeError("sleep levels 1 and 2 need the engine started with "
                               "enable_sleep_mode=True")
        t0, before = time.perf_counter(), memory.used_bytes(self.device)
        if self.runner.graphs is not None:  # they hold the addresses about to be freed
            self.runner.graphs.clear()
            self.runner.graphs = None
        if "kv_cache" not in self.sleeping:
            self.runner.kv_caches = []
            self.runner.attention.release()  # gathered copies of it, kept for reuse
            self.sleeping.add("kv_cache")
        if "weights" not in self.sleeping:
            self._weight_backup = memory.offload(self.runner.model, keep=level == 1)
            self.sleeping.add("weights")
        elif level == 2 and self._weight_backup is not None:
            self._weight_backup.free()  # a level-1 sleep deepened: the host copy goes too
            self._weight_backup = None
        self.runner.weights_changed()  # what the CPU keeps of them: made again next step
        memory.release(self.device)
        after = memory.used_bytes(self.device)
        logger.info("sleep level %d: freed %.1f MiB in %.2f s; %.1f MiB still used on %s",
                    level, (before - after) / 2**20, time.perf_counter() - t0, after / 2**20,
                    self.device)
        return sorted(self.sleeping)

    def wake_up(self, tags: list[str]) -> list[str]:
        """Allocate (and, after level 1, refill) what `tags` name; CUDA graphs are captured
        again once everything is back (their addresses changed)."""
        t0, before = time.perf_counter(), memory.used_bytes(self.device)
        if "weights" in tags and "weights" in self.sleeping:
            if self._weight_backup is None:  # level 2: allocated, not filled
                self.runner.model.unloaded = self.runner.model.checkpoint_keys()
            memory.restore(self.runner.model, self._weight_shapes, self._weight_backup)
            self._weight_backup = None  # restore freed it: not kept until the next sleep
            self.sleeping.discard("weights")
        if "kv_cache" in tags and "kv_cache" in self.sleeping:
            self.model_runner.initialize_kv_cache(self.num_kv_blocks)
            self.sleeping.discard("kv_cache")
        if not self.sleeping and self.runner.graphs is None:
            self._capture_graphs()
        memory.release(self.device)
        after = memory.used_bytes(self.device)
        logger.info("wake up %s: %.1f MiB allocated in %.2f s; %.1f MiB used on %s",
                    ",".join(tags), (after - before) / 2**20, time.perf_counter() - t0,
                    after / 2**20, self.device)
        return sorted(self.sleeping)

    # -- weight updates and collective_rpc ----------------------------------------

    def update_weights(self, update: WeightUpdate) -> int:
        """Copy the update's tensors into the model, every check passed before the first
        copy (`WeightUpdates.apply`). Returns the number of tensors loaded."""
        try:
            return self.updates.apply(update, weights_asleep="weights" in self.sleeping)
        finally:  # a collective's receive writes past the version counters packs check
            self.runner.weights_changed()

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Start joining the trainer's group; `weight_transfer_joined` says when done."""
        self.updates.init_engine(init_info)

    def unloaded_weights(self) -> tuple[int, int]:
        """(checkpoint tensors not loaded since a wake from sleep level 2, of how many):
        the engine refuses requests until the first is 0."""
        model = self.runner.model
        return len(model.unloaded), len(model.checkpoint_keys())

    def weight_transfer_joined(self) -> bool:
        return self.updates.joined()

    def abandon_weight_transfer(self) -> None:
        self.updates.abandon_join()

    # -- LoRA adapters -------------------------------------------------------------

    def add_lora(self, lora: LoRARequest, peft_config: dict[str, Any] | None = None,
                 tensors: WeightUpdate | None = None) -> None:
        """Read and place an adapter from its directory, or from `tensors` (a weight
        update: shared memory or CUDA IPC) with its `peft_config`; raises ValueError
        naming what is wrong with it."""
        manager = self._lora_manager()
        if tensors is None:
            manager.add(lora)
            return
        with self.updates.open(tensors, manager.max_bytes) as received:
            # Copies: the update's views are valid only while it is open.
            manager.add(lora, {name: t.to("cpu", copy=True) for name, t in received},
                        peft_config)

    def remove_lora(self, lora_int_id: int) -> bool:
        return self._lora_manager().remove(lora_int_id)

    def list_loras(self) -> list[int]:
        return self._lora_manager().ids()

    def _lora_manager(self) -> LoRAManager:
        if self.runner.lora is None:
            raise ValueError("LoRA adapters need enable_lora=True")
        return self.runner.lora

    rpc_methods: frozenset[str] = frozenset()  # set by the extension's subclass

    def collective_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]) -> Any:
        """This rank's result; tensors in and out travel as msgpack extensions
        (tensor_codec)."""
        try:
            if method not in self.rpc_methods:
                known = ", ".join(sorted(self.rpc_methods)) or "none: set worker_extension_cls"
                raise ValueError(f"collective_rpc: unknown method {method!r} (callable: {known})")
            result = getattr(self, method)(*decode_value(args), **decode_value(kwargs))
        except Exception as e:
            raise RuntimeError(f"collective_rpc {method!r} failed on worker "
                               f"{self.rank}: {type(e).__name__}: {e}") from e
        finally:  # an extension may have written the weights any way (param.data)
            self.runner.weights_changed()
        return encode_value(result)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step. A failure that leaves the device usable (out of memory, a bad
        value that slipped past validation) is a StepFailed: the engine core fails the
        step's requests and goes on. A device fault (a CUDA error poisons the context)
        propagates: the engine core dies and says why."""
        try:
            return self.runner.execute_model(scheduler_output)
        except Exception as e:
            if is_device_fault(e):
                raise
            logger.exception("engine step failed; failing its %d request(s)",
                             len(scheduler_output.num_scheduled_tokens))
            raise StepFailed(f"the engine step failed: {type(e).__name__}: {e}") from e

    def retain_requests(self, request_ids: list[str]) -> None:
        """After a failed step: forget every request but these (the runner's state for
        the failed ones may be half updated)."""
        self.runner.retain(set(request_ids))

    def shutdown(self) -> None:
        if self.runner.graphs is not None:
            self.runner.graphs.clear()
        self.runner.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _host_ranks(self) -> int:
        """Workers on this host, of every engine core here: they share its RAM."""
        args = self.args
        local_cores = (args.data_parallel_size if args.data_parallel_size_local is None
                       else args.data_parallel_size_local) or 1
        return self.local_world_size * local_cores

    def _cpu_budget(self, args: EngineArgs) -> int:
        """A share of available RAM (split among the ranks of every engine core on this
        host), and never more than every running request at full length could use."""
        useful = (self.blocks_per_request * args.max_num_seqs
                  * self.runner.kv_cache_bytes_per_block())
        ranks = self._host_ranks()
        available = psutil.virtual_memory().available
        # Every rank samples the full logits (tensor parallelism all-gathers them).
        self._check_step_fits(int(available * (1 - CPU_KV_CACHE_RAM_SHARE) / ranks),
                              "beside the KV cache's share")
        return min(int(available * CPU_KV_CACHE_RAM_SHARE / ranks), useful)

    def _profiled_cuda_budget(self, args: EngineArgs, used_before: int) -> int:
        """Profile the largest step, then give the KV cache what is left of its share."""
        weights = torch.cuda.memory_allocated(self.device)
        try:
            activations = self.runner.profile_run()
        except torch.cuda.OutOfMemoryError as e:
            raise ValueError(
                f"the largest step (max_num_batched_tokens={self.max_num_batched_tokens}, "
                f"max_num_seqs={args.max_num_seqs}) does not fit in GPU memory next to the "
                f"weights; lower max_num_batched_tokens or max_num_seqs") from e
        free, total = torch.cuda.mem_get_info(self.device)
        # Memory the driver and libraries took outside torch's allocator since start-up.
        non_torch = max(0, total - free - torch.cuda.memory_reserved(self.device)
                        - used_before)
        logger.info("Profiled step of %d tokens: weights %.2f GiB, peak activations "
                    "%.2f GiB, other processes and CUDA context %.2f GiB, non-torch %.2f GiB",
                    self.max_num_batched_tokens, weights / 2**30, activations / 2**30,
                    used_before / 2**30, non_torch / 2**30)
        return cuda_kv_cache_budget(total, args.gpu_memory_utilization, used_before,
                                    weights, activations, non_torch)


def lora_settings(args: EngineArgs) -> LoRASettings | None:
    if not args.enable_lora:
        return None
    return LoRASettings(args.max_loras, args.max_lora_rank,
                        args.max_cpu_loras or args.max_loras)


def max_num_batched_tokens(args: EngineArgs, device: torch.device) -> int:
    return args.max_num_batched_tokens or (8192 if device.type == "cuda" else 2048)


def num_kv_blocks(budget: int, source: str, per_block: int, block_size: int,
                  max_model_len: int) -> int:
    """Blocks `budget` bytes hold; the error says what to change when one request of
    max_model_len would not fit."""
    needed_blocks = -(-max_model_len // block_size)
    num_blocks = budget // per_block
    if num_blocks < needed_blocks:
        raise ValueError(
            f"not enough memory for the KV cache: {budget / 2**20:.1f} MiB "
            f"(from {source}) holds {max(num_blocks, 0) * block_size} tokens, but "
            f"one request of max_model_len={max_model_len} needs {needed_blocks} blocks "
            f"({needed_blocks * per_block / 2**20:.1f} MiB); raise kv_cache_memory_bytes "
            f"or gpu_memory_utilization, or lower max_model_len or "
            f"max_num_batched_tokens")
    return int(num_blocks)


class StepFailed(RuntimeError):
    """One engine step could not run; the device is still usable."""


def is_device_fault(error: BaseException) -> bool:
    """A CUDA error (illegal address, device-side assert, ...) leaves the context
    unusable: nothing after it can be trusted. Out-of-memory is not one."""
    if isinstance(error, torch.cuda.OutOfMemoryError):
        return False
    accelerator_error = getattr(torch, "AcceleratorError", None)
    if accelerator_error is not None and isinstance(error, accelerator_error):
        return True
    return isinstance(error, RuntimeError) and ("CUDA error" in str(error)
                                                or "device-side assert" in str(error))


def cuda_kv_cache_budget(total: int, utilization: float, used_before: int, weights: int,
                         activations: int, non_torch: int) -> int:
    """The KV cache's bytes: the engine's share of the GPU (utilization x total) less
    what is not ours to take (held by others and our CUDA context before we loaded),
    our weights, the peak activations of the largest step, and memory the libraries took
    outside torch's allocator. Negative when nothing is left."""
    return int(total * utilization) - used_before - weights - activations - non_torch
