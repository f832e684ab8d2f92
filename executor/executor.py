"""The executor: what the engine core calls to run the model.

One process today (the model runner lives in the engine core's process). Tensor
parallelism would put workers in other processes behind this same interface, which is
why it only takes and returns protocol Structs.
"""

from __future__ import annotations

import logging

import psutil
import torch

from executor.config import ModelConfig, resolve_device, resolve_model_config
from executor.model_runner import ModelRunner
from protocol.engine_args import EngineArgs
from protocol.scheduling import ModelRunnerOutput, SchedulerOutput

logger = logging.getLogger("pagellm")

# Share of available RAM the CPU KV cache may take by default: the rest stays for the
# weights' working set, activations, the frontend and the OS.
CPU_KV_CACHE_RAM_SHARE = 0.3


class Executor:
    def __init__(self, args: EngineArgs) -> None:
        self.device = resolve_device(args.device)
        self.model_config: ModelConfig = resolve_model_config(args)
        self.max_num_batched_tokens = args.max_num_batched_tokens or (
            8192 if self.device.type == "cuda" else 2048)
        self.block_size = args.block_size
        self.runner = ModelRunner(self.model_config, self.device, args.block_size,
                                  args.max_num_seqs, args.seed, args.attention_backend,
                                  args.logprobs_mode)
        self.num_kv_blocks = self._determine_num_kv_blocks(args)
        self.runner.initialize_kv_cache(self.num_kv_blocks)
        gib = self.num_kv_blocks * self.runner.kv_cache_bytes_per_block() / 2**30
        logger.info("KV cache: %d blocks (%d tokens, %.2f GiB) on %s", self.num_kv_blocks,
                    self.num_kv_blocks * self.block_size, gib, self.device)

    def execute_model(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.runner.execute_model(scheduler_output)

    def shutdown(self) -> None:
        self.runner.kv_caches = []
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _determine_num_kv_blocks(self, args: EngineArgs) -> int:
        per_block = self.runner.kv_cache_bytes_per_block()
        max_len = self.model_config.max_model_len
        needed_blocks = -(-max_len // self.block_size)
        if args.kv_cache_memory_bytes is not None:
            budget, source = args.kv_cache_memory_bytes, "kv_cache_memory_bytes"
        elif self.device.type == "cpu":
            # More than every running request at full length is never used.
            useful = needed_blocks * args.max_num_seqs * per_block
            share = int(psutil.virtual_memory().available * CPU_KV_CACHE_RAM_SHARE)
            budget, source = min(share, useful), "available RAM"
        else:
            budget, source = self._cuda_kv_budget(args), "gpu_memory_utilization"
        num_blocks = budget // per_block
        if num_blocks < needed_blocks:
            raise ValueError(
                f"not enough memory for the KV cache: {budget / 2**20:.1f} MiB "
                f"(from {source}) holds {num_blocks * self.block_size} tokens, but one "
                f"request of max_model_len={max_len} needs {needed_blocks} blocks "
                f"({needed_blocks * per_block / 2**20:.1f} MiB); raise kv_cache_memory_bytes "
                f"or gpu_memory_utilization, or lower max_model_len")
        return int(num_blocks)

    def _cuda_kv_budget(self, args: EngineArgs) -> int:
        """gpu_memory_utilization x total, minus what is already taken and a reserve for
        activations (the step's hidden states, MLP intermediates and logits in fp32)."""
        total = torch.cuda.get_device_properties(self.device).total_memory
        free, _ = torch.cuda.mem_get_info(self.device)
        spec = self.model_config.spec
        tokens = self.max_num_batched_tokens
        activations = tokens * (6 * spec.hidden_size + 4 * spec.intermediate_size) * 4 \
            + args.max_num_seqs * spec.vocab_size * 4 * 3
        used_by_others_and_us = total - free
        return max(0, int(total * args.gpu_memory_utilization) - used_by_others_and_us
                   - activations)
