"""`LoRARegistry`: the adapters the engine core has added to its workers.

A request naming an adapter the workers do not have yet adds it first (`ensure`, on the
busy loop, before the request is queued): the workers read and check it then, so a
missing or malformed adapter fails that request alone, never a step. An id stands for
one adapter: a request naming a known id with another path is refused rather than
served with the adapter the id already means. Replacing an adapter's weights under its
id (`load_inplace`) bumps its *generation*, which is part of its requests' prefix-cache
key (block_hash.py): prompts computed with the old weights are never reused for new
requests. Requests already running finish on the new weights (their KV so far stays:
an RL trainer replaces an adapter between rounds, after its requests drained).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import msgspec

from pagellm.protocol.lora import LoRARequest
from pagellm.protocol.utility import WeightUpdate


class LoRARegistry:
    def __init__(self, enabled: bool,
                 add_to_workers: Callable[[LoRARequest, dict[str, Any] | None,
                                           WeightUpdate | None], None],
                 remove_from_workers: Callable[[int], bool]) -> None:
        self.enabled = enabled
        self._add_to_workers = add_to_workers
        self._remove_from_workers = remove_from_workers
        self.adapters: dict[int, LoRARequest] = {}
        self.generation: dict[int, int] = {}

    def key(self, lora: LoRARequest | None) -> tuple[int, int] | None:
        """The prefix-cache key a request with `lora` hashes under now."""
        if lora is None:
            return None
        return lora.lora_int_id, self.generation.get(lora.lora_int_id, 0)

    def ensure(self, lora: LoRARequest) -> tuple[int, int]:
        """Add `lora` to the workers unless they have it (or replace it: load_inplace);
        returns its key. Raises ValueError naming what is wrong."""
        if not self.enabled:
            raise ValueError("this request names a LoRA adapter, but the engine was started "
                             "without enable_lora")
        known = self.adapters.get(lora.lora_int_id)
        if known is not None and not lora.load_inplace:
            if known.lora_path != lora.lora_path or known.lora_name != lora.lora_name:
                raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter "
                                 f"{known.lora_name!r} ({known.lora_path or 'from tensors'}), "
                                 f"not {lora.lora_name!r} ({lora.lora_path}); use another id "
                                 "or load_inplace=True to replace it")
            return lora.lora_int_id, self.generation[lora.lora_int_id]
        self._add_to_workers(lora, None, None)
        self.added(lora)
        return lora.lora_int_id, self.generation[lora.lora_int_id]

    def add_tensors(self, lora: LoRARequest, peft_config: dict[str, Any] | None,
                    tensors: WeightUpdate) -> None:
        """Add an adapter from tensors in memory; an id added before is replaced (its
        generation bumped: the old weights' cached prompts are never reused)."""
        if not self.enabled:
            raise ValueError("LoRA adapters need the engine started with enable_lora")
        if peft_config is None:
            raise ValueError("an adapter from tensors needs its PEFT config")
        known = self.adapters.get(lora.lora_int_id)
        if known is not None and known.lora_name != lora.lora_name:
            raise ValueError(f"lora_int_id {lora.lora_int_id} is adapter {known.lora_name!r}, "
                             f"not {lora.lora_name!r}")
        self._add_to_workers(lora, peft_config, tensors)
        self.added(lora)

    def added(self, lora: LoRARequest) -> None:
        """The workers now hold `lora` (new, or new weights under its id)."""
        lora_id = lora.lora_int_id
        if lora_id in self.adapters:
            self.generation[lora_id] += 1
        else:
            self.generation.setdefault(lora_id, 0)
        # As kept: load_inplace is what one call asked for, not the adapter's.
        self.adapters[lora_id] = msgspec.structs.replace(lora, load_inplace=False)

    def remove(self, lora_int_id: int) -> bool:
        if lora_int_id not in self.adapters:
            return False
        self._remove_from_workers(lora_int_id)
        del self.adapters[lora_int_id]
        self.generation[lora_int_id] += 1  # added again later: a new adapter
        return True

    def ids(self) -> list[int]:
        return sorted(self.adapters)
