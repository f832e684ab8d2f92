"""`LoRARequest`: which adapter a request runs with, as vLLM names it.

A request with one runs its base model's projections plus that adapter's low-rank
update (executor/lora/); one without runs the base model. The engine knows an adapter
by `lora_int_id` (unique per adapter, > 0), the server by `lora_name`. `lora_path` is a
PEFT adapter directory (`adapter_config.json` + `adapter_model.safetensors`) the
engine's workers read; an adapter added from tensors in memory (`LLM.add_lora` with
tensors) has none. `load_inplace`: replace the weights of an adapter already loaded
under this id (an RL trainer's new policy), rather than reuse them.

No torch here: the frontend, the engine core and clients of a standalone engine core all
speak it.
"""

from __future__ import annotations

from typing import Any

import msgspec

# Bounds on what a client names (each travels with every request that uses the adapter).
MAX_LORA_NAME_CHARS = 256
MAX_LORA_PATH_CHARS = 4096
MAX_LORA_INT_ID = 2**31 - 1
# The adapter ranks the engine can be configured for (vLLM's list, and 1).
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)
# Adapter slots on the device, and adapters kept in host memory, at most.
MAX_LORAS = 256
MAX_CPU_LORAS = 4096


class LoRARequest(msgspec.Struct, array_like=True, omit_defaults=True, gc=False):
    """An adapter for a request (vLLM's `vllm.lora.request.LoRARequest`)."""

    lora_name: str
    lora_int_id: int
    lora_path: str = ""
    base_model_name: str | None = None
    load_inplace: bool = False

    def __post_init__(self) -> None:
        problem = lora_request_problem(self)
        if problem is not None:
            raise ValueError(problem)

    @property
    def adapter_id(self) -> int:
        return self.lora_int_id

    @property
    def name(self) -> str:
        return self.lora_name

    @property
    def path(self) -> str:
        return self.lora_path


class TensorLoRARequest(LoRARequest, kw_only=True):
    """An adapter from tensors in memory (verl's and SkyRL's adapter sync, as verl names
    it): `lora_tensors` {PEFT tensor name: tensor}, `peft_config` the PEFT config as a
    dict (or PEFT's LoraConfig). `LLM.add_lora` sends the tensors through shared memory
    (or CUDA IPC); only the adapter's identity travels with requests."""

    peft_config: Any = None
    lora_tensors: Any = None


def plain(lora: LoRARequest) -> LoRARequest:
    """`lora` as it travels with requests: a LoRARequest, not a subclass's extra fields
    (a TensorLoRARequest's tensors, or any framework's own subclass)."""
    if type(lora) is LoRARequest:
        return lora
    return LoRARequest(lora.lora_name, lora.lora_int_id, lora.lora_path,
                       lora.base_model_name, lora.load_inplace)


def lora_request_problem(lora: LoRARequest) -> str | None:
    """What is wrong with `lora`'s fields alone, or None (decoding checks it too: a
    standalone engine core's clients are not all ours)."""
    if isinstance(lora.lora_int_id, bool) or not 1 <= lora.lora_int_id <= MAX_LORA_INT_ID:
        return f"lora_int_id must be in [1, {MAX_LORA_INT_ID}], got {lora.lora_int_id!r}"
    if not lora.lora_name or len(lora.lora_name) > MAX_LORA_NAME_CHARS:
        return f"lora_name must have 1 to {MAX_LORA_NAME_CHARS} characters"
    if len(lora.lora_path) > MAX_LORA_PATH_CHARS or "\x00" in lora.lora_path:
        return f"lora_path must have at most {MAX_LORA_PATH_CHARS} characters and no NUL"
    return None


def peft_config_dict(config: Any) -> dict[str, Any]:
    """A PEFT config as the dict the engine checks: a dict, or PEFT's LoraConfig
    (`to_dict()`, its enums and sets made plain)."""
    if config is None:
        raise ValueError("an adapter from tensors needs its peft_config")
    raw = config.to_dict() if hasattr(config, "to_dict") else config
    if not isinstance(raw, dict):
        raise TypeError(f"peft_config must be a dict or a PEFT LoraConfig, got "
                        f"{type(config).__name__}")
    return {key: (sorted(value) if isinstance(value, set | frozenset)
                  else getattr(value, "value", value)) for key, value in raw.items()}
