"""What `GET /server_info` (a dev route, dev_routes.py) reports: the engine's resolved
configuration under vLLM's names.

RL trainers read vLLM's `/server_info?config_format=json` to learn what the server
runs before they talk to it: TRL checks `weight_transfer_config` before it joins the
weight-transfer group, `model_config.logprobs_mode` before its importance-sampling
correction, `model_config.dtype` ("torch.bfloat16": vLLM dumps a torch.dtype as its
str), and `lora_config` / `parallel_config.data_parallel_size` before it chooses how to
sync adapters. So the tree keeps vLLM's section and field names (`VllmConfig`), with
the fields pagellm has; a section pagellm has nothing for is null, as vLLM's optional
sections are.

Values the engine core reported once ready (EngineInfo: max_model_len, dtype, the KV
blocks, the parallel sizes) win over the frontend's arguments: they are what is served.
Nothing secret goes in: no API key, no CURVE key, no path but the model's and its
tokenizer's (which vLLM shows too), no engine or rendezvous address. vLLM's answer also
carries `vllm_env` and `system_env` (its VLLM_* variables and the host's collect_env
report); they are left out here: no client reads them, and environment variables may
hold secrets.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.messages import EngineInfo

CONFIG_FORMATS = ("text", "json")  # vLLM's `config_format` query values


def vllm_config(args: EngineArgs, info: EngineInfo, served_model_name: str
                ) -> dict[str, Any]:
    """vLLM's `VllmConfig` as JSON, for what pagellm serves (`args`: the frontend's
    resolved engine arguments; `info`: what the engine core reported)."""
    device = info.device.split(":")[0]  # vLLM's DeviceConfig holds the type alone
    tp = info.world_size
    return {
        "model_config": {
            "model": info.model,
            "tokenizer": args.tokenizer or args.model,
            "tokenizer_mode": args.tokenizer_mode,
            "trust_remote_code": args.trust_remote_code,
            "dtype": f"torch.{info.dtype}",
            "seed": args.seed,
            "revision": args.revision,
            "tokenizer_revision": args.tokenizer_revision,
            "max_model_len": info.max_model_len,
            "quantization": args.quantization,
            "enforce_eager": args.enforce_eager,
            "max_logprobs": info.max_logprobs,
            "logprobs_mode": args.logprobs_mode,
            "skip_tokenizer_init": args.skip_tokenizer_init,
            "served_model_name": served_model_name,
            "enable_sleep_mode": args.enable_sleep_mode,
            "model_impl": args.model_impl,
            "runner_type": "generate",
        },
        "cache_config": {
            "block_size": info.block_size,
            "gpu_memory_utilization": args.gpu_memory_utilization,
            "swap_space": args.swap_space,
            "cache_dtype": args.kv_cache_dtype,
            "num_gpu_blocks": info.num_kv_blocks,
            "kv_cache_memory_bytes": args.kv_cache_memory_bytes,
            "enable_prefix_caching": args.enable_prefix_caching,
        },
        "parallel_config": {
            "pipeline_parallel_size": 1,
            "tensor_parallel_size": tp,
            "data_parallel_size": info.data_parallel_size,
            "world_size": tp,  # vLLM's: one engine core's workers (tp x pp)
            "nnodes": args.nnodes,
            "distributed_executor_backend": "mp" if tp > 1 else "uni",
            "worker_extension_cls": args.worker_extension_cls or "",
        },
        "scheduler_config": {
            "runner_type": "generate",
            "max_num_batched_tokens": info.max_num_batched_tokens,
            "max_num_seqs": info.max_num_seqs,
            "long_prefill_token_threshold": args.long_prefill_token_threshold,
            "enable_chunked_prefill": True,  # the only mode (EngineArgs refuses False)
            "policy": info.scheduling_policy,
            "async_scheduling": args.async_scheduling,
        },
        "device_config": {"device": device, "device_type": device},
        "load_config": {"load_format": args.load_format},
        "structured_outputs_config": {
            "backend": args.structured_outputs("backend", "auto"),
            "disable_any_whitespace": args.structured_outputs("disable_any_whitespace", False),
            "enable_in_reasoning": args.structured_outputs("enable_in_reasoning", False),
            "reasoning_parser": info.reasoning_parser or "",  # the one in effect
        },
        "lora_config": None if not args.enable_lora else {
            "max_loras": args.max_loras, "max_lora_rank": args.max_lora_rank,
            "max_cpu_loras": args.max_cpu_loras or args.max_loras},
        "speculative_config": (None if args.speculative is None
                               else msgspec.structs.asdict(args.speculative)),
        "kv_transfer_config": None,
        "weight_transfer_config": (None if args.weight_transfer_config is None
                                   else dict(args.weight_transfer_config)),
    }


# vLLM's `str(VllmConfig)`, one line of `name=value`, for the fields pagellm has:
# (the name vLLM prints, its section and field in the JSON tree, repr or str).
_TEXT_FIELDS: tuple[tuple[str, str, str, Callable[[Any], str]], ...] = (
    ("model", "model_config", "model", repr),
    ("tokenizer", "model_config", "tokenizer", repr),
    ("skip_tokenizer_init", "model_config", "skip_tokenizer_init", str),
    ("tokenizer_mode", "model_config", "tokenizer_mode", str),
    ("revision", "model_config", "revision", str),
    ("tokenizer_revision", "model_config", "tokenizer_revision", str),
    ("trust_remote_code", "model_config", "trust_remote_code", str),
    ("dtype", "model_config", "dtype", str),
    ("max_seq_len", "model_config", "max_model_len", str),
    ("load_format", "load_config", "load_format", str),
    ("tensor_parallel_size", "parallel_config", "tensor_parallel_size", str),
    ("pipeline_parallel_size", "parallel_config", "pipeline_parallel_size", str),
    ("data_parallel_size", "parallel_config", "data_parallel_size", str),
    ("quantization", "model_config", "quantization", str),
    ("enforce_eager", "model_config", "enforce_eager", str),
    ("kv_cache_dtype", "cache_config", "cache_dtype", str),
    ("device_config", "device_config", "device", str),
    ("seed", "model_config", "seed", str),
    ("served_model_name", "model_config", "served_model_name", str),
    ("enable_prefix_caching", "cache_config", "enable_prefix_caching", str),
    ("enable_chunked_prefill", "scheduler_config", "enable_chunked_prefill", str),
)


def vllm_config_text(config: dict[str, Any]) -> str:
    """`config_format=text`: the one-line summary vLLM logs at start-up and serves by
    default, rendered from the JSON tree so the two never disagree."""
    return ", ".join(f"{name}={show(config[section][key])}"
                     for name, section, key, show in _TEXT_FIELDS)
