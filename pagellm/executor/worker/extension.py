"""`collective_rpc` targets: the worker's methods, by name only; and the construction of
a worker whose class is extended.

vLLM lets `collective_rpc` ship a pickled callable; here a method is a name, looked up
on the `Worker` object (executor/worker/worker.py, one per tensor-parallel rank), whose class
may be extended with the engine arg `worker_extension_cls="package.module.Class"`
(vLLM's dotted form). That class is imported, never unpickled, and mixed into `Worker`,
so its methods see vLLM's worker attributes (`self.model_runner.model`, `self.device`,
`self.rank`, `self.model_config.dtype`). Only public methods (no leading underscore) of
the extension class are callable.

An extended worker is built as vLLM builds one, with `Worker(**kwargs)` of vLLM's
keywords (`vllm_config`, `local_rank`, `rank`, `distributed_init_method`,
`is_driver_worker`), because RL frameworks' extensions hook its construction (verl's
`__new__(cls, **kwargs)` reads `kwargs["vllm_config"]`): `vllm_config` is a read-only
`VllmConfigView` built from the `EngineArgs`, never unpickled. The class order is

    <Extension>Worker -> Extension -> VllmKwargsWorker -> Worker

so an extension's `__init__(self, **kwargs)` runs first and its `super().__init__(
**kwargs)` reaches `VllmKwargsWorker`, which starts the `Worker` with its own arguments.
(vLLM appends the extension after its worker class, so there an extension's `__init__`
is never called; placed first, one that calls super() runs and still ends in the
worker's. Methods cannot clash either way: a name the worker has is refused.)
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any

from pagellm.executor.model.config import ModelConfig, resolve_model_config
from pagellm.executor.worker.worker import Worker
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.speculative import SpeculativeConfig

# What vLLM's WorkerWrapperBase passes its worker class (vllm/v1/worker/gpu_worker.py).
VLLM_WORKER_KWARGS = ("vllm_config", "local_rank", "rank", "distributed_init_method",
                      "is_driver_worker")


@dataclasses.dataclass(frozen=True)
class ParallelConfigView:
    """The fields of vLLM's ParallelConfig that RL extensions read (verl's weight sync
    maps local ranks with the data-parallel ones)."""

    tensor_parallel_size: int
    pipeline_parallel_size: int
    world_size: int  # one engine core's workers: tensor x pipeline parallel
    rank: int
    data_parallel_size: int
    data_parallel_rank: int
    data_parallel_size_local: int
    data_parallel_rank_local: int


@dataclasses.dataclass(frozen=True)
class CacheConfigView:
    """vLLM's CacheConfig as it stands when the worker is built: the number of KV blocks
    is not known yet (the executor sizes the cache after every worker has profiled)."""

    block_size: int
    gpu_memory_utilization: float
    enable_prefix_caching: bool
    num_gpu_blocks: int | None = None


@dataclasses.dataclass(frozen=True)
class VllmConfigView:
    """What an extension may read of vLLM's VllmConfig, built from the worker's
    `EngineArgs`: `model_config` is pagellm's (`.model`, `.dtype` as a torch.dtype,
    `.max_model_len`, `.hf_config`); `speculative_config` the checked one
    (`.method`, `.num_speculative_tokens`, ...); what pagellm has none of is None
    (quantization, LoRA, a KV connector), as in a vLLM config without them.
    `engine_args` is what `VllmKwargsWorker` starts the `Worker` with."""

    engine_args: EngineArgs
    model_config: ModelConfig
    parallel_config: ParallelConfigView
    cache_config: CacheConfigView
    speculative_config: SpeculativeConfig | None = None
    quant_config: None = None
    lora_config: None = None
    kv_transfer_config: None = None
    additional_config: Mapping[str, Any] = dataclasses.field(
        default_factory=lambda: MappingProxyType({}))

    @classmethod
    def of(cls, args: EngineArgs, rank: int) -> VllmConfigView:
        world = args.tensor_parallel_size
        local_dp = (args.data_parallel_size if args.data_parallel_size_local is None
                    else args.data_parallel_size_local)
        return cls(
            engine_args=args, model_config=resolve_model_config(args),
            speculative_config=args.speculative,
            parallel_config=ParallelConfigView(
                tensor_parallel_size=world, pipeline_parallel_size=1, world_size=world,
                rank=rank, data_parallel_size=args.data_parallel_size,
                data_parallel_rank=args.data_parallel_rank,
                data_parallel_size_local=local_dp,
                data_parallel_rank_local=args.data_parallel_rank - args.data_parallel_start_rank),
            cache_config=CacheConfigView(
                block_size=args.block_size, gpu_memory_utilization=args.gpu_memory_utilization,
                enable_prefix_caching=args.enable_prefix_caching))


class VllmKwargsWorker(Worker):
    """The `Worker` under vLLM's constructor keywords: what an extension's
    `super().__init__(**kwargs)` ends in. It adds vLLM's attributes that RL extensions
    read: `vllm_config`, `parallel_config`, `cache_config`, `distributed_init_method`,
    `is_driver_worker`, and `model_runner.vllm_config` (verl's)."""

    vllm_config: VllmConfigView

    def __init__(self, *, vllm_config: VllmConfigView, local_rank: int, rank: int,
                 distributed_init_method: str | None = None,
                 is_driver_worker: bool = False) -> None:
        if not isinstance(vllm_config, VllmConfigView):
            raise TypeError(f"the worker's vllm_config must be the VllmConfigView it was "
                            f"given, got {type(vllm_config).__name__}")
        args = vllm_config.engine_args
        world = args.tensor_parallel_size
        super().__init__(args, rank, local_rank, world, world // args.nnodes)
        self.vllm_config = vllm_config
        self.parallel_config = vllm_config.parallel_config
        self.cache_config = vllm_config.cache_config
        self.distributed_init_method = distributed_init_method
        self.is_driver_worker = is_driver_worker
        # The runner is pagellm's own class; vLLM's runner carries the config.
        self.model_runner.vllm_config = vllm_config  # type: ignore[attr-defined]


def make_worker(args: EngineArgs, rank: int = 0, local_rank: int = 0) -> Worker:
    """Rank `rank`'s worker (`local_rank` on its node), its class extended by
    `args.worker_extension_cls` if set. ValueError, naming the class, for an extension
    whose construction does not end in the worker's (its `__new__` returned something
    else, or its `__init__` did not call `super().__init__(**kwargs)`)."""
    dotted = args.worker_extension_cls
    if dotted is None:
        world = args.tensor_parallel_size
        return Worker(args, rank, local_rank, world, world // args.nnodes)
    cls = _extended_class(dotted)
    # No init method: the ranks join their group through the engine's own store
    # (worker_proc.py), before the worker is built.
    worker = cls(vllm_config=VllmConfigView.of(args, rank), local_rank=local_rank,
                 rank=rank, distributed_init_method=None, is_driver_worker=rank == 0)
    if not isinstance(worker, cls):
        raise ValueError(f"worker_extension_cls {dotted!r}: its __new__ returned "
                         f"{type(worker).__name__!r}, not the worker (return "
                         f"super().__new__(cls))")
    if not isinstance(vars(worker).get("vllm_config"), VllmConfigView):
        raise ValueError(f"worker_extension_cls {dotted!r}: its __init__ did not start the "
                         f"worker (call super().__init__(**kwargs))")
    return worker


def worker_class(dotted: str | None) -> type[Worker]:
    """`Worker`, extended by the class `dotted` names (its public methods become the
    ones collective_rpc may call: `rpc_methods`). An extension's own `__init__` and
    `__new__` must take vLLM's worker keywords (**kwargs will do)."""
    return Worker if dotted is None else _extended_class(dotted)


def _extended_class(dotted: str) -> type[VllmKwargsWorker]:
    module_name, _, class_name = dotted.rpartition(".")
    if not module_name:
        raise ValueError(f"worker_extension_cls must be 'package.module.Class', got {dotted!r}")
    try:
        extension = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"worker_extension_cls {dotted!r} cannot be imported: {e}") from e
    if not inspect.isclass(extension):
        raise ValueError(f"worker_extension_cls {dotted!r} is not a class")
    if extension.__module__ == "builtins":
        raise ValueError(f"worker_extension_cls {dotted!r} is a builtin type: it must be a "
                         "mixin class (methods, and an __init__/__new__ taking vLLM's "
                         "worker keywords if any)")
    for name in ("__init__", "__new__"):
        why = _refuses_vllm_kwargs(extension, name)
        if why is not None:
            raise ValueError(f"worker_extension_cls {dotted!r} has an {name} that {why}: "
                             f"it must be a mixin class whose {name}, if any, takes them "
                             f"({', '.join(VLLM_WORKER_KWARGS)}; **kwargs will do)")
    methods = frozenset(name for name, member in inspect.getmembers(extension)
                        if callable(member) and not name.startswith("_")
                        and not hasattr(VllmKwargsWorker, name))
    clash = [name for name in vars(extension) if hasattr(VllmKwargsWorker, name)
             and not name.startswith("__")]
    if clash:
        raise ValueError(f"worker_extension_cls {dotted!r} redefines worker attribute(s) "
                         f"{', '.join(sorted(clash))}")
    try:
        return type(f"{class_name}Worker", (extension, VllmKwargsWorker),
                    {"rpc_methods": methods})
    except TypeError as e:  # e.g. a metaclass or layout conflict
        raise ValueError(f"worker_extension_cls {dotted!r} cannot be mixed into the "
                         f"worker: {e}") from None


def _refuses_vllm_kwargs(extension: type, name: str) -> str | None:
    """Why the extension's own `name` (`__init__` or `__new__`) cannot be called with
    vLLM's worker keywords; None if it can, or if it has none of its own."""
    method = getattr(extension, name)
    if method is getattr(object, name):
        return None
    try:
        signature = inspect.signature(method)
    except (TypeError, ValueError):
        return "cannot be checked for vLLM's worker keywords"  # a C type's
    try:  # read from the class, both take their receiver first (self, cls)
        signature.bind(None, **dict.fromkeys(VLLM_WORKER_KWARGS))
    except TypeError as e:
        return f"cannot take vLLM's worker keywords ({e})"  # e.g. threading.Thread's
    return None
