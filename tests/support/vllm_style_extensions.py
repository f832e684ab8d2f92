"""Worker extensions shaped like RL frameworks' own (the engine imports them by name,
`worker_extension_cls="vllm_style_extensions.<Class>"`), for
tests/executor/test_worker_extension_kwargs.py:

- `VerlStyle`: the construction of verl's `vLLMColocateWorkerExtension`: a
  `__new__(cls, **kwargs)` that reads `kwargs["vllm_config"]` and sets attributes
  before the worker exists, and an `__init__(self, **kwargs)` that calls super.
- `OpenRLHFStyle`: OpenRLHF's `WorkerWrap`: methods only; `update_weight(name, dtype,
  shape, empty_cache)` checks the dtype against `self.model_config.dtype` and loads a
  tensor of that shape (a constant stands in for the trainer's broadcast).
- `ForgetsSuper`, `ReturnsSomethingElse`, `TakesItsOwnArguments`: constructions that
  cannot end in a worker."""

from __future__ import annotations

from typing import Any

import torch


class VerlStyle:
    model_runner: Any  # these are the worker's, once mixed in
    model_config: Any
    vllm_config: Any
    rank: int

    def __new__(cls, **kwargs: Any) -> VerlStyle:
        vllm_config = kwargs["vllm_config"]
        instance = super().__new__(cls)
        # What verl reads there (quant_config through getattr), kept for `construction`.
        instance._seen_in_new = {
            "kwargs": sorted(kwargs),
            "model": vllm_config.model_config.model,
            "dtype": vllm_config.model_config.dtype,
            "max_model_len": vllm_config.model_config.max_model_len,
            "tensor_parallel_size": vllm_config.parallel_config.tensor_parallel_size,
            "world_size": vllm_config.parallel_config.world_size,
            "parallel_rank": vllm_config.parallel_config.rank,
            "quant_config": getattr(vllm_config, "quant_config", "missing"),
            "worker_started": hasattr(instance, "model_runner"),
        }
        return instance

    def __init__(self, **kwargs: Any) -> None:
        self._seen_in_init = {key: kwargs[key] for key in (
            "rank", "local_rank", "is_driver_worker", "distributed_init_method")}
        super().__init__(**kwargs)

    def construction(self) -> dict[str, Any]:
        runner_config = self.model_runner.vllm_config
        return {
            "new": self._seen_in_new, "init": self._seen_in_init,
            "rank": self.rank, "model_config_dtype": self.model_config.dtype,
            "runner_config_is_the_workers": runner_config is self.vllm_config,
            "runner_model_dtype": runner_config.model_config.dtype,
            "speculative_config": runner_config.speculative_config,
        }


class OpenRLHFStyle:
    model_runner: Any
    model_config: Any

    def update_weight(self, name: str, dtype: torch.dtype, shape: Any,
                      empty_cache: bool = False) -> list[str]:
        assert dtype == self.model_config.dtype, (
            f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}")
        weight = torch.full(shape, 0.5, dtype=dtype)  # the trainer's broadcast, here
        return sorted(self.model_runner.model.load_weights(weights=[(name, weight)]))

    def echo_types(self, dtype: Any, shape: Any) -> dict[str, Any]:
        """The values back, with the types they arrived as."""
        return {"dtype": dtype, "shape": shape, "pair": (dtype, shape),
                "arrived_as": [type(dtype).__name__, type(shape).__name__]}

    def embedding_rows(self, rows: list[int]) -> torch.Tensor:
        return self.model_runner.model.model.embed_tokens.weight[rows].clone()


class ForgetsSuper:
    def __init__(self, **kwargs: Any) -> None:
        self.kwargs = kwargs


class ReturnsSomethingElse:
    def __new__(cls, **kwargs: Any) -> Any:
        return object()


class TakesItsOwnArguments:
    def __init__(self, config: dict[str, Any]) -> None:  # not vLLM's keywords
        self.config = config
