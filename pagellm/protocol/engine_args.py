"""`EngineArgs`: every engine option, defined once.

`LLM(...)` and `AsyncLLM(...)` keyword arguments, the `pagellm` CLI flags
(`--max-model-len` style) and the standalone engine core's flags are all derived from
the one dataclass below (the flags by cli_args.py), so each entry point accepts the
same options under vLLM's names. Unknown options raise TypeError naming them: RL
frameworks pass whole config dicts through, and a silently ignored typo would be worse
than a crash.

The dataclass only checks values that need no model (ranges, spellings). Options that
depend on the model (max_model_len against the config, the KV cache size against
memory) are resolved and checked once when the engine core starts.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
from dataclasses import dataclass, field
from typing import Any

from pagellm.protocol import cli_args
from pagellm.protocol.lora import LORA_RANKS, MAX_CPU_LORAS, MAX_LORAS
from pagellm.protocol.reasoning import REASONING_TAGS, check_reasoning_parser
from pagellm.protocol.speculative import SpeculativeConfig, parse_speculative_config
from pagellm.protocol.validation import (
    INT32_MAX,
    INT64_MAX,
    INT64_MIN,
    check_float,
    check_host,
    check_int,
)

DTYPES = ("auto", "float32", "float16", "bfloat16")
DTYPE_ALIASES = {"float": "float32", "half": "float16", "fp32": "float32", "fp16": "float16",
                 "bf16": "bfloat16"}
LOAD_FORMATS = ("auto", "safetensors", "dummy")
SCHEDULING_POLICIES = ("fcfs", "priority")
LOGPROBS_MODES = ("raw_logprobs", "processed_logprobs")
ATTENTION_BACKENDS = ("auto", "triton", "torch")
BLOCK_SIZES = (8, 16, 32, 64, 128)
# The executor backends that run the one worker in the engine core's own process.
SINGLE_WORKER_BACKENDS = ("uni", "external_launcher")
# The Ray placement group a frontend was started in (hex id), for its engine-core
# process, which is no Ray worker and cannot ask Ray itself (executor/ray_executor.py).
RAY_PLACEMENT_GROUP_ENV = "PAGELLM_RAY_PLACEMENT_GROUP"
# "ipc": shared memory on the same host; "nccl": a torch.distributed group with the
# trainer (gloo: host tensors; see weights/shm.py).
WEIGHT_TRANSFER_BACKENDS = ("ipc", "nccl")
# How long init_weight_transfer_engine waits for the trainer's group ("nccl"), unless
# weight_transfer_config says otherwise: the trainer calls its side at the same time.
DEFAULT_INIT_TIMEOUT_S = 60.0
MAX_INIT_TIMEOUT_S = 3600.0
# Most tensor-parallel workers, or data-parallel engine cores, one engine starts.
MAX_PARALLEL = 256
# Most requests running at once: per-request rows of the input batch are preallocated,
# so a count beyond any real use would be an allocation failure, not a setting.
MAX_NUM_SEQS = 2**20
MAX_PATH_CHARS = 4096  # PATH_MAX: generation_config names a directory


def check_weight_transfer_config(config: Any) -> None:
    """{"backend": "ipc" | "nccl"} (vLLM's field), optionally with "init_timeout_s": how
    long init_weight_transfer_engine waits for the trainer to join the "nccl" group
    (DEFAULT_INIT_TIMEOUT_S; the engine keeps serving meanwhile)."""
    if config is None:
        return
    if not (isinstance(config, dict) and "backend" in config
            and set(config) <= {"backend", "init_timeout_s"}
            and config["backend"] in WEIGHT_TRANSFER_BACKENDS):
        raise ValueError(f"weight_transfer_config must be {{'backend': B}} with B one of "
                         f"{', '.join(WEIGHT_TRANSFER_BACKENDS)} (and optionally "
                         f"'init_timeout_s'), got {str(config)[:200]}")
    if "init_timeout_s" in config:
        check_float("weight_transfer_config.init_timeout_s", config["init_timeout_s"],
                    minimum=0.0, maximum=MAX_INIT_TIMEOUT_S, min_exclusive=True)


STRUCTURED_OUTPUT_BACKENDS = ("auto", "xgrammar", "guidance")
_STRUCTURED_OUTPUTS_KEYS = {"backend": str, "disable_any_whitespace": bool,
                            "enable_in_reasoning": bool, "reasoning_parser": str}


def check_structured_outputs_config(config: Any) -> None:
    """vLLM's StructuredOutputsConfig fields served here: backend ("auto": xgrammar,
    llguidance for what it lacks), disable_any_whitespace (compact JSON for every
    request), enable_in_reasoning (apply grammars during reasoning too) and
    reasoning_parser (the same as the reasoning_parser option)."""
    if config is None:
        return
    if not isinstance(config, dict):
        raise TypeError(f"structured_outputs_config must be a dict, got {config!r}")
    for key, value in config.items():
        kind = _STRUCTURED_OUTPUTS_KEYS.get(key)
        if kind is None:
            raise ValueError(f"structured_outputs_config: unknown key {key!r} (known: "
                             f"{', '.join(_STRUCTURED_OUTPUTS_KEYS)})")
        if type(value) is not kind:
            raise TypeError(f"structured_outputs_config.{key} must be a {kind.__name__}, "
                            f"got {value!r}")
    backend = config.get("backend", "auto")
    if backend not in STRUCTURED_OUTPUT_BACKENDS:
        raise ValueError(f"structured_outputs_config.backend must be one of "
                         f"{', '.join(STRUCTURED_OUTPUT_BACKENDS)}, got {backend!r}")
    check_reasoning_parser(config.get("reasoning_parser"))


def usable_cpus() -> int:
    """The CPUs this process may run on (a container's or taskset's share), not the
    host's count."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _opt(default: Any, help: str, choices: tuple[Any, ...] | None = None) -> Any:
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True, kw_only=True)
class EngineArgs:
    """Engine options, with vLLM's names and defaults."""

    model: str = field(metadata={"help": "Hugging Face model directory, or 'demo'."})
    tokenizer: str | None = _opt(None, "Tokenizer directory (default: the model's).")
    dtype: str = _opt("auto", "Weight and activation dtype; 'auto' takes the config's.",
                      DTYPES + tuple(DTYPE_ALIASES))
    device: str = _opt("auto", "'auto' (cuda when available, else cpu), 'cpu' or 'cuda[:N]'.")
    seed: int = _opt(0, "Seed for unseeded sampling and dummy weights.")
    block_size: int = _opt(16, "Tokens per KV-cache block.", BLOCK_SIZES)
    max_model_len: int | None = _opt(
        None, "Longest prompt plus output (default: the config's max_position_embeddings).")
    max_num_seqs: int = _opt(256, "Most requests running at once.")
    max_num_batched_tokens: int | None = _opt(
        None, "Most tokens computed in one step (default: 8192 on cuda, 2048 on cpu).")
    gpu_memory_utilization: float = _opt(
        0.9, "Share of GPU memory the engine may use (weights, activations, KV cache).")
    kv_cache_memory_bytes: int | None = _opt(
        None, "KV-cache size in bytes (accepts 512MiB, 4GiB); overrides the automatic size.")
    load_format: str = _opt("auto", "'dummy' gives random weights of the right shapes.",
                            LOAD_FORMATS)
    enable_prefix_caching: bool = _opt(
        True, "Reuse the KV of prompt prefixes already computed (hash-identified blocks).")
    scheduling_policy: str = _opt(
        "fcfs", "'fcfs' (arrival order) or 'priority' (lower `priority` first, then "
        "arrival).", SCHEDULING_POLICIES)
    long_prefill_token_threshold: int = _opt(
        0, "Most tokens one prompt may take in a step (0: no cap below the step budget).")
    max_logprobs: int = _opt(20, "Most logprobs / prompt_logprobs a request may ask for "
                             "(-1: no limit, so requests may ask for -1, the whole "
                             "vocabulary).")
    logprobs_mode: str = _opt(
        "raw_logprobs", "'raw_logprobs' (from the model's logits) or 'processed_logprobs' "
        "(after penalties, masks, temperature, top-k/top-p).", LOGPROBS_MODES)
    attention_backend: str = _opt(
        "auto", "'auto' (triton on cuda, torch on cpu), 'triton' (on the CPU through "
        "Triton's interpreter: slow, for tests) or 'torch'.", ATTENTION_BACKENDS)
    enforce_eager: bool = _opt(
        False, "Run every step eagerly: no CUDA graphs for decode steps (cuda only).")
    skip_tokenizer_init: bool = _opt(
        False, "Load no tokenizer: prompts must be token ids and outputs carry no text.")
    enable_sleep_mode: bool = _opt(
        False, "Allow sleep levels 1 and 2 (free the KV cache and the weights between "
        "RL rollouts).")
    weight_transfer_config: dict[str, Any] | None = field(default=None, metadata={
        "help": 'Enable weight updates: JSON such as {"backend": "ipc"} (backends: ipc, nccl; '
                '"init_timeout_s": how long an nccl init waits for the trainer, default 60).'})
    structured_outputs_config: dict[str, Any] | None = field(default=None, metadata={
        "help": 'Structured outputs: JSON such as {"backend": "guidance"} (backends: auto, '
                'xgrammar, guidance; also "disable_any_whitespace", "enable_in_reasoning"); '
                'one key alone as --structured-outputs-config.backend guidance.',
        "keys": {"backend": str, "disable_any_whitespace": bool, "enable_in_reasoning": bool}})
    speculative_config: dict[str, Any] | None = field(default=None, metadata={
        "help": 'Speculative decoding: JSON such as {"method": "ngram", '
                '"num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}'
                ' or {"method": "draft_model", "model": DIR, "num_speculative_tokens": 4} '
                '(optional "disable_by_batch_size": no proposals above that many running '
                'requests).'})
    reasoning_parser: str | None = _opt(
        None, "Split reasoning (<think>, or gpt-oss's analysis) into reasoning_content "
        "(server), and apply structured outputs after it ends. Default: openai_gptoss for "
        "gpt-oss models, none otherwise.", (None, *REASONING_TAGS))
    worker_extension_cls: str | None = _opt(
        None, "'package.module.Class' whose public methods collective_rpc may call.")
    # -- vLLM options with one meaning here -------------------------------------------
    # vLLM scripts pass these routinely. Each is accepted where its value is the one we
    # implement, or where it changes nothing here (the help says so); any other value is
    # refused naming what is supported (`_SUPPORTED`): silently ignoring it would serve
    # something other than what was asked for.
    trust_remote_code: bool = _opt(
        False, "Accepted for vLLM compatibility: pagellm never runs code from a model "
        "directory (its own decoder serves the supported architectures), either way.")
    disable_log_stats: bool = _opt(
        False, "Accepted for vLLM compatibility: pagellm logs no periodic stats (they are "
        "at /metrics and get_stats()), either way.")
    enable_chunked_prefill: bool | None = _opt(
        None, "pagellm always chunks long prefills within the step budget: only True (or "
        "unset) is accepted.")
    distributed_executor_backend: str | None = _opt(
        None, "'mp' (or unset): tensor-parallel workers are processes of this host (or of "
        "--nnodes hosts). 'uni': the one worker (tensor_parallel_size=1) in the engine "
        "core's process. 'external_launcher': the launcher (torchrun, accelerate) owns the "
        "processes; each runs its own engine, in-process, on cuda:$LOCAL_RANK "
        "(tensor_parallel_size=1). 'ray': the workers are Ray actors in a placement group "
        "(RAY_ADDRESS's cluster; pip install 'pagellm[ray]').")
    quantization: str | None = _opt(
        None, "Unset: a quantized checkpoint (config.json's quantization_config: gptq, "
        "awq, compressed-tensors, fp8) loads as it is, any other in --dtype. A "
        "checkpoint format's name (vLLM's gptq_marlin and awq_marlin too) must match "
        "it. Quantize on load: 'int4' or 'int8' keeps the decoder's projections as "
        "weight-only integers with group-wise scales; 'fp8' as e4m3 with per-channel "
        "scales, activations quantized per token (W8A8). These and packed checkpoints "
        "run Triton's kernels: CUDA (on the CPU attention_backend='triton', for tests). "
        "On the CPU's own path 'int8' is W8A8 (int8 weights and per-token activations: "
        "fast with VNNI/AMX), int4 and fp8 are refused, and a quantized checkpoint "
        "loads dequantized to --dtype.")
    kv_cache_dtype: str = _opt(
        "auto", "'auto': the KV cache has the model's dtype. 'bfloat16': bf16 whatever the "
        "model's dtype (an fp32 model's cache in half the memory, its keys and values rounded "
        "to bf16 on the way in; read back in fp32). 'fp8' (or 'fp8_e4m3'): e4m3, "
        "a byte per value (twice bf16's tokens in the same memory), with vLLM's "
        "uncalibrated per-tensor scale of 1.0: values beyond +-448 saturate. On CUDA it "
        "needs an Ada or Hopper GPU (sm_89+).")
    revision: str | None = _opt(
        None, "Only unset: the model is a local directory, which has no Hub revision.")
    tokenizer_revision: str | None = _opt(
        None, "Only unset: the tokenizer is a local directory, which has no Hub revision.")
    tokenizer_mode: str = _opt(
        "auto", "Only 'auto': the directory's tokenizer as transformers' AutoTokenizer "
        "loads it (the fast one when it exists).")
    swap_space: float = _opt(
        4.0, "Accepted for vLLM compatibility (GiB, >= 0): pagellm preempts by "
        "recomputing, never swaps to host memory, so no swap space is used.")
    max_seq_len_to_capture: int = _opt(
        8192, "Accepted for vLLM compatibility (>= 1): pagellm's decode CUDA graphs serve "
        "every sequence length, so there is no length past which steps run eagerly.")
    generation_config: str = _opt(
        "auto", "Where the default sampling parameters come from (vLLM's): 'auto' the "
        "model directory's generation_config.json (temperature, top_p, top_k, min_p, "
        "repetition_penalty, max_new_tokens), 'vllm' none of it, or a directory holding "
        "one. A request's own values win; max_new_tokens caps max_tokens.")
    model_impl: str = _opt(
        "auto", "Only 'auto' or 'vllm': pagellm's own decoder serves the model (no "
        "transformers fallback).")
    # -- LoRA adapters (vLLM's LoRAConfig names) ---------------------------------------
    enable_lora: bool = _opt(
        False, "Serve LoRA adapters: a request's lora_request picks one (PEFT directories, "
        "or tensors added with add_lora).")
    max_loras: int = _opt(1, "Adapter slots on the device: the most distinct adapters in "
                          "one step.")
    max_lora_rank: int = _opt(16, "Largest adapter rank served (the slots' size).",
                              LORA_RANKS)
    max_cpu_loras: int | None = _opt(
        None, "Adapters kept loaded in host memory, least recently used dropped first "
        "(default: max_loras; at least max_loras).")
    async_scheduling: bool = _opt(
        False, "Schedule step n+1 while step n runs (its sampled tokens feed n+1 in the "
        "worker); steps run one at a time while speculative decoding or structured "
        "outputs are active.")
    # -- past one device (vLLM's ParallelConfig names) --------------------------------
    tensor_parallel_size: int = field(default=1, metadata={
        "alias": "-tp", "help": "Worker processes that each hold 1/N of the model (attention "
        "heads, MLP columns, vocabulary, KV cache), joined by torch.distributed (gloo on "
        "the CPU, NCCL on CUDA)."})
    data_parallel_size: int = field(default=1, metadata={
        "alias": "-dp", "help": "Engine cores, each with its own KV cache (and its own "
        "tensor-parallel workers), behind one frontend that routes each request to the "
        "least loaded."})
    data_parallel_size_local: int | None = _opt(
        None, "Data-parallel engine cores on this node (default: all of them).")
    data_parallel_start_rank: int = _opt(
        0, "Data-parallel rank of the first engine core on this node (headless nodes).")
    data_parallel_rank: int = _opt(
        0, "This engine core's data-parallel rank (set by the frontend that launches it).")
    data_parallel_address: str = _opt(
        "127.0.0.1", "Address of the node that runs the frontend (data parallel across "
        "nodes).")
    data_parallel_rpc_port: int = _opt(
        29550, "Port on --data-parallel-address where engine cores of other nodes attach.")
    nnodes: int = _opt(1, "Nodes the tensor-parallel workers span.")
    node_rank: int = _opt(0, "This node's rank among --nnodes (0 runs the engine core).")
    master_addr: str = _opt(
        "127.0.0.1", "torch.distributed rendezvous host for tensor parallel across nodes "
        "(node 0's address).")
    master_port: int = _opt(
        29501, "torch.distributed rendezvous port on --master-addr (used when nnodes > 1; "
        "a single node takes a free port).")

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model:
            raise ValueError(f"model must be a non-empty path or 'demo', got {self.model!r}")
        if self.tokenizer is not None and not isinstance(self.tokenizer, str):
            raise TypeError(f"tokenizer must be a path, got {self.tokenizer!r}")
        dtype = DTYPE_ALIASES.get(self.dtype, self.dtype)
        if dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        object.__setattr__(self, "dtype", dtype)
        if not isinstance(self.device, str) or not re.fullmatch(r"auto|cpu|cuda(:\d+)?",
                                                                  self.device):
            raise ValueError(f"device must be 'auto', 'cpu' or 'cuda[:N]', got {self.device!r}")
        check_int("seed", self.seed, minimum=INT64_MIN, maximum=INT64_MAX)
        check_int("block_size", self.block_size)
        check_int("max_model_len", self.max_model_len, minimum=1, maximum=INT32_MAX,
                  allow_none=True)
        check_int("max_num_seqs", self.max_num_seqs, minimum=1, maximum=MAX_NUM_SEQS)
        check_int("max_num_batched_tokens", self.max_num_batched_tokens, minimum=1,
                  maximum=INT32_MAX, allow_none=True)
        check_float("gpu_memory_utilization", self.gpu_memory_utilization, minimum=0.0,
                    maximum=1.0, min_exclusive=True)
        check_int("kv_cache_memory_bytes", self.kv_cache_memory_bytes, minimum=1,
                  maximum=INT64_MAX, allow_none=True)
        check_int("long_prefill_token_threshold", self.long_prefill_token_threshold, minimum=0,
                  maximum=INT32_MAX)
        check_int("max_logprobs", self.max_logprobs, minimum=-1, maximum=INT32_MAX)
        check_int("tensor_parallel_size", self.tensor_parallel_size, minimum=1,
                  maximum=MAX_PARALLEL)
        check_int("data_parallel_size", self.data_parallel_size, minimum=1,
                  maximum=MAX_PARALLEL)
        check_int("data_parallel_size_local", self.data_parallel_size_local, minimum=0,
                  maximum=self.data_parallel_size, allow_none=True)
        check_int("data_parallel_start_rank", self.data_parallel_start_rank, minimum=0,
                  maximum=self.data_parallel_size - 1)
        check_int("data_parallel_rank", self.data_parallel_rank, minimum=0,
                  maximum=self.data_parallel_size - 1)
        check_int("nnodes", self.nnodes, minimum=1, maximum=self.tensor_parallel_size)
        check_int("node_rank", self.node_rank, minimum=0, maximum=self.nnodes - 1)
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(f"tensor_parallel_size={self.tensor_parallel_size} must be a "
                             f"multiple of nnodes={self.nnodes} (the same number of workers "
                             "on every node)")
        for name in ("data_parallel_rpc_port", "master_port"):
            check_int(name, getattr(self, name), minimum=1, maximum=65535)
        for name in ("data_parallel_address", "master_addr"):
            check_host(name, getattr(self, name))
        check_weight_transfer_config(self.weight_transfer_config)
        check_structured_outputs_config(self.structured_outputs_config)
        parse_speculative_config(self.speculative_config)
        if self.worker_extension_cls is not None and not (
                isinstance(self.worker_extension_cls, str)
                and re.fullmatch(r"[A-Za-z_][\w]*(\.[A-Za-z_][\w]*)+",
                                 self.worker_extension_cls)):
            raise ValueError("worker_extension_cls must be 'package.module.Class', got "
                             f"{self.worker_extension_cls!r}")
        if self.distributed_executor_backend in SINGLE_WORKER_BACKENDS and (
                self.tensor_parallel_size > 1):
            raise ValueError(f"distributed_executor_backend={self.distributed_executor_backend!r} "
                             "runs one worker: tensor_parallel_size must be 1, got "
                             f"{self.tensor_parallel_size} (use 'mp')")
        check_int("max_loras", self.max_loras, minimum=1, maximum=MAX_LORAS)
        check_int("max_cpu_loras", self.max_cpu_loras, minimum=self.max_loras,
                  maximum=MAX_CPU_LORAS, allow_none=True)
        check_float("swap_space", self.swap_space, minimum=0.0)
        if not (isinstance(self.generation_config, str)
                and 0 < len(self.generation_config) <= MAX_PATH_CHARS):
            raise ValueError(f"generation_config must be 'auto', 'vllm' or a directory, got "
                             f"{str(self.generation_config)[:80]!r}")
        check_int("max_seq_len_to_capture", self.max_seq_len_to_capture, minimum=1,
                  maximum=INT32_MAX)
        for name, (supported, why) in _SUPPORTED.items():
            value = getattr(self, name)
            if not any(value is s or (type(value) is type(s) and value == s)
                       for s in supported):
                raise ValueError(f"{name}={value!r} is not supported: {why} (supported: "
                                 f"{', '.join(map(repr, supported))})")
        for f in dataclasses.fields(self):  # every option with choices, and every flag
            value, choices = getattr(self, f.name), f.metadata.get("choices")
            if choices is not None and f.name != "dtype" and value not in choices:
                raise ValueError(f"{f.name} must be one of {', '.join(map(str, choices))}, "
                                 f"got {value!r}")
            if (isinstance(f.default, bool) or f.name in _OPTIONAL_FLAGS) and not (
                    isinstance(value, bool) or (value is None and f.default is None)):
                raise TypeError(f"{f.name} must be a bool, got {value!r}")

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> EngineArgs:
        """Build from keyword arguments, naming every unknown one in the TypeError."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise TypeError(
                f"unknown engine option(s): {', '.join(unknown)} "
                f"(known: {', '.join(sorted(names))})")
        return cls(**kwargs)

    def replace(self, **changes: Any) -> EngineArgs:
        return dataclasses.replace(self, **changes)

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """speculative_config, checked and with its defaults (None: no speculation)."""
        return parse_speculative_config(self.speculative_config)

    def structured_outputs(self, key: str, default: Any) -> Any:
        """One setting of structured_outputs_config (reasoning_parser: either option)."""
        config = self.structured_outputs_config or {}
        if key == "reasoning_parser":
            return self.reasoning_parser or config.get(key)
        return config.get(key, default)

    # -- as command-line flags (cli_args.py) -------------------------------------------

    @classmethod
    def add_cli_args(cls, parser: argparse.ArgumentParser, *, model_positional: bool = False
                     ) -> argparse.ArgumentParser:
        """Add one `--flag-name` per field (`model` as a positional when asked)."""
        return cli_args.add_cli_args(cls, parser, model_positional=model_positional)

    def to_cli_args(self) -> list[str]:
        """The flags that rebuild these args (non-defaults only): how a frontend starts
        its engine-core process."""
        return cli_args.to_cli_args(self)

    @classmethod
    def from_cli_args(cls, namespace: argparse.Namespace) -> EngineArgs:
        """The args the parsed flags give; a value refused names its flag
        ("--max-num-seqs: max_num_seqs must be <= ...")."""
        return cli_args.from_cli_args(cls, namespace)



# vLLM's name for the options an AsyncLLM takes (`AsyncLLM.from_engine_args`): the same
# options here (vLLM's adds request logging, which pagellm does not do).
AsyncEngineArgs = EngineArgs

# The vLLM options above that take only some of vLLM's values: name -> (the values
# accepted, why the others are not).
_SUPPORTED: dict[str, tuple[tuple[Any, ...], str]] = {
    "enable_chunked_prefill": ((None, True), "pagellm always chunks long prefills"),
    "distributed_executor_backend": ((None, "mp", "uni", "external_launcher", "ray"),
                                     "these are the executors pagellm has"),
    "quantization": ((None, "int4", "int8", "fp8", "gptq", "gptq_marlin", "awq",
                      "awq_marlin", "compressed-tensors"),
                     "pagellm quantizes on load to weight-only int4 or int8, or fp8, and "
                     "reads gptq, awq, compressed-tensors and fp8 checkpoints"),
    "kv_cache_dtype": (("auto", "bfloat16", "fp8", "fp8_e4m3"), "the KV cache takes the "
                       "model's dtype, bf16 or e4m3"),
    "revision": ((None,), "the model is a local directory, which has no Hub revision"),
    "tokenizer_revision": ((None,), "the tokenizer is a local directory, which has no Hub "
                           "revision"),
    "tokenizer_mode": (("auto",), "the tokenizer is the one AutoTokenizer loads"),
    "model_impl": (("auto", "vllm"), "pagellm's own decoder serves the model"),
}
# Flags whose default is None (unset) rather than a bool.
_OPTIONAL_FLAGS = frozenset({"enable_chunked_prefill"})

