"""The executor: what the engine core calls to run the model, on one worker or many.

`Executor` holds what is the same however the workers run: KV-cache sizing (the
smallest budget among the ranks, so every rank's cache has the same blocks), the sleep
state, and which rank's answer counts. Subclasses only say how a method reaches every
worker (`_run`): `UniProcExecutor` calls the one `Worker` in this process;
`MultiprocExecutor` (executor/multiproc.py) broadcasts to one worker process per
tensor-parallel rank. Everything passed either way is a protocol Struct or plain data.
"""

from __future__ import annotations

import logging
import threading
from abc import ABC, abstractmethod
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import torch.distributed as dist

from pagellm.executor.model.config import ModelConfig, resolve_device, resolve_model_config
from pagellm.executor.model.parallel import check_divisible
from pagellm.executor.worker.worker import (
    StepFailed,
    Worker,
    cuda_kv_cache_budget,
    is_device_fault,
    max_num_batched_tokens,
    num_kv_blocks,
)
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.scheduling import ModelRunnerOutput, SchedulerOutput
from pagellm.protocol.utility import WeightUpdate

__all__ = ["Executor", "StepFailed", "UniProcExecutor", "cuda_kv_cache_budget",
           "is_device_fault"]

logger = logging.getLogger("pagellm")


class Executor(ABC):
    def __init__(self, args: EngineArgs) -> None:
        self.model_config: ModelConfig = resolve_model_config(args)
        check_divisible(self.model_config.spec, args.tensor_parallel_size)
        self.device = resolve_device(args.device)
        self.max_num_batched_tokens = max_num_batched_tokens(args, self.device)
        self.enable_sleep_mode = args.enable_sleep_mode
        self.sleeping: set[str] = set()  # tags ("weights", "kv_cache") now freed
        # With async_scheduling, the thread steps run on (`execute_model_async`); an
        # in-process worker does all its work there, from loading on (`_on_step_thread`).
        self._step_thread: ThreadPoolExecutor | None = None
        self._step_thread_id: int | None = None
        if args.async_scheduling:
            self._step_thread = ThreadPoolExecutor(1, "pagellm-step",
                                                   initializer=self._enter_step_thread)
        try:
            self._start_workers(args)
            budgets = self._run("kv_cache_budget")
            budget, source, per_block = min(budgets, key=lambda b: b[0])
            if len(budgets) > 1:
                source += f" (the smallest of {len(budgets)} ranks)"
            self.num_kv_blocks = num_kv_blocks(budget, source, per_block, args.block_size,
                                               self.model_config.max_model_len)
            self._run("initialize_kv_cache", self.num_kv_blocks)
        except BaseException:
            if self._step_thread is not None:  # a failed start leaves no thread behind
                self._step_thread.shutdown()
            raise

    @abstractmethod
    def _start_workers(self, args: EngineArgs) -> None: ...

    @abstractmethod
    def _run(self, method: str, *args: Any) -> list[Any]:
        """Call `method` on every worker; their results in rank order."""

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        """Run one step; rank 0's output (every rank samples the same tokens). Raises
        StepFailed when the step failed but every worker is still usable."""
        result: ModelRunnerOutput = self._run("execute_model", scheduler_output)[0]
        return result

    def execute_model_async(self, scheduler_output: SchedulerOutput
                            ) -> Future[ModelRunnerOutput]:
        """Start `execute_model` on the executor's step thread and return at once
        (asynchronous scheduling: the engine core schedules the next step meanwhile;
        the forward pass and the workers' replies release the interpreter lock). Steps
        run one at a time, in the order submitted; the caller makes no other executor
        call while one is in flight."""
        if self._step_thread is None:
            raise RuntimeError("execute_model_async needs an executor made with "
                               "async_scheduling=True")
        return self._step_thread.submit(self.execute_model, scheduler_output)

    def _enter_step_thread(self) -> None:
        """CUDA's current device is per thread: the step thread's is the worker's."""
        self._step_thread_id = threading.get_ident()
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)

    def _on_step_thread(self, call: Callable[..., Any], *args: Any) -> Any:
        """`call(*args)` on the step thread, if there is one. An in-process worker's
        torch work all runs there: a second thread running parallel CPU ops gives
        libgomp two thread teams, more threads than cores, and it then puts each
        team's idle threads to sleep after every parallel region instead of letting
        them spin: the SmolLM2-135M shape's batch-1 forward pass went from 28 to 45 ms
        on 2 cores once the model had been loaded on another thread than the one that
        ran the steps."""
        if self._step_thread is None or threading.get_ident() == self._step_thread_id:
            return call(*args)
        return self._step_thread.submit(call, *args).result()

    def sleep(self, level: int) -> None:
        self.sleeping = set(self._run("sleep", level)[0])

    def wake_up(self, tags: list[str]) -> None:
        self.sleeping = set(self._run("wake_up", tags)[0])

    def update_weights(self, update: WeightUpdate) -> int:
        """Every rank loads its slice of the update; the number of tensors loaded."""
        loaded: int = self._run("update_weights", update)[0]
        return loaded

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        """Start every worker's join of the trainer's group ("nccl"); it goes on in the
        background: poll `weight_transfer_joined`. (Every rank makes the same checks on
        the same state first, so either all start or none does.)"""
        self._run("init_weight_transfer_engine", init_info)

    def weight_transfer_joined(self) -> bool:
        """True once every worker has joined; raises the first failure (and every rank
        leaves, so that a new init starts clean)."""
        try:
            return all(self._run("weight_transfer_joined"))
        except (RuntimeError, ValueError):
            self._run("abandon_weight_transfer")
            raise

    def unloaded_weights(self) -> tuple[int, int]:
        """(checkpoint tensors some rank has not loaded since a wake from sleep level 2,
        of how many)."""
        counts = self._run("unloaded_weights")
        return max(c[0] for c in counts), counts[0][1]

    def collective_rpc(self, method: str, args: list[Any], kwargs: dict[str, Any]
                       ) -> list[Any]:
        """One result per worker, in rank order."""
        return self._run("collective_rpc", method, args, kwargs)

    def add_lora(self, lora: LoRARequest, peft_config: dict[str, Any] | None = None,
                 tensors: WeightUpdate | None = None) -> None:
        """Every rank reads and places its slice of the adapter (from its directory, or
        from `tensors`); raises ValueError naming what is wrong with it."""
        self._run("add_lora", lora, peft_config, tensors)

    def remove_lora(self, lora_int_id: int) -> bool:
        return bool(self._run("remove_lora", lora_int_id)[0])

    def list_loras(self) -> list[int]:
        return list(self._run("list_loras")[0])

    def retain_requests(self, request_ids: set[str]) -> None:
        self._run("retain_requests", sorted(request_ids))

    def shutdown(self) -> None:
        try:
            self._run("shutdown")
        finally:
            if self._step_thread is not None:
                self._step_thread.shutdown()


class UniProcExecutor(Executor):
    """One worker, in the engine core's process (`distributed_executor_backend` "uni",
    "external_launcher", or the default at tensor_parallel_size=1): no wire.

    The worker still gets a default torch.distributed group of one (vLLM's workers
    always have one: worker extensions such as OpenRLHF's call
    `torch.distributed.get_rank()`), unless the process already has one, e.g. the
    trainer's under an external launcher, which is then the engine's, as in vLLM."""

    worker: Worker
    _own_group = False  # whether the default group is ours to destroy at shutdown

    def __init__(self, args: EngineArgs) -> None:
        try:
            super().__init__(args)
        except BaseException:
            # A start that fails (a KV cache too small, a bad checkpoint) leaves no
            # default group behind: the process's later users would take it for theirs.
            self._release_group()
            raise

    def _start_workers(self, args: EngineArgs) -> None:
        from pagellm.executor.worker.extension import make_worker

        self._own_group = _default_group_of_one(self.device)
        self.worker = self._on_step_thread(make_worker, args)

    @property
    def runner(self) -> Any:
        return self.worker.model_runner

    @property
    def driver_worker(self) -> Worker:
        """vLLM's name for the one worker (`llm.llm_engine.model_executor.driver_worker
        .model_runner.model.load_weights(...)`, TRL's weight sync in colocate mode)."""
        return self.worker

    def _run(self, method: str, *args: Any) -> list[Any]:
        return [self._on_step_thread(getattr(self.worker, method), *args)]

    def shutdown(self) -> None:
        try:
            super().shutdown()
        finally:
            self._release_group()

    def _release_group(self) -> None:
        if self._own_group:
            self._own_group = False
            if dist.is_initialized():
                dist.destroy_process_group()


def _default_group_of_one(device: Any) -> bool:
    """Make this process's default torch.distributed group, of one rank, if it has
    none (an in-memory store: nothing listens on a port). True if made here."""
    if not dist.is_available() or dist.is_initialized():
        return False
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            store=dist.HashStore(), rank=0, world_size=1)
    return True
