"""`LoRAManager`: one worker's adapters, from a directory or tensors to a device slot.

Three tiers, as S-LoRA and vLLM keep them:
- sources: every adapter added (`add`) and not removed, by lora_int_id: its directory,
  or, for one added from tensors in memory, the tensors (which have nowhere to be read
  again from, so they count against the host cache and are never dropped from it);
- the host cache: up to `max_cpu_loras` adapters read and placed for this rank
  (`LoadedAdapter`), least recently used dropped first (read again from the directory
  when needed);
- the device: `max_loras` slots in every projection that takes adapters (`LoRASlots`);
  a step's adapters are paged into slots before its forward pass (`prepare_step`),
  taking free slots first, then those of the least recently used adapters not in the
  step. The scheduler never puts more distinct adapters in a step than there are slots.

An adapter is read and checked when added, before any request uses it, so a bad one
fails the request that named it (or the add call), never a step.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from pagellm.executor.lora.adapter import (
    LoadedAdapter,
    LoRAConfig,
    build,
    read_directory,
    targets,
)
from pagellm.executor.model.layers import Linear, RowParallelLinear
from pagellm.executor.model.lora_slots import LoRABatch, LoRASlots
from pagellm.executor.model.parallel import TensorParallel
from pagellm.executor.model.spec import DecoderSpec
from pagellm.protocol.lora import LoRARequest


@dataclass(frozen=True)
class LoRASettings:
    """From EngineArgs (enable_lora): device slots, largest rank, host cache size."""

    max_loras: int
    max_rank: int
    max_cpu_loras: int


@dataclass
class _Source:
    request: LoRARequest
    tensors: dict[str, torch.Tensor] | None = None  # in memory; None: read lora_path
    config: LoRAConfig | None = None


class LoRAManager:
    def __init__(self, model: nn.Module, spec: DecoderSpec, tp: TensorParallel,
                 settings: LoRASettings, dtype: torch.dtype, device: torch.device,
                 kernels: bool = False) -> None:
        """`kernels`: compute with the Triton kernels (lora_slots.py), as the model
        runner does wherever its attention runs Triton's."""
        if spec.short_conv is not None and tp.size > 1:  # its slices of in_proj's three
            raise ValueError("LoRA adapters on LFM2 under tensor parallelism are not "  # parts
                             "served yet: serve them on one rank")
        self.spec, self.tp, self.dtype = spec, tp, dtype
        # A family whose checkpoints name modules their own way (lfm2.py's out_proj,
        # feed_forward.w1): its adapters name them so too; read in our spelling.
        self.our_name: Callable[[str], str] = getattr(model, "our_name", lambda n: n)
        max_loras, max_rank = settings.max_loras, settings.max_rank
        self.max_loras = max_loras
        self.max_rank, self.max_cpu_loras = max_rank, settings.max_cpu_loras
        self.batch = LoRABatch(kernels)
        parts: dict[str, int] = {}
        for target in targets(spec).values():
            parts[target.module] = max(parts.get(target.module, 0), target.part + 1)
        self.slots: dict[str, LoRASlots] = {}
        for name, module in model.named_modules():
            leaf = name.rsplit(".", 1)[-1]
            if leaf in parts and isinstance(module, Linear | RowParallelLinear):
                out_features, in_features = module.weight.shape
                module.lora = self.slots[name] = LoRASlots(
                    self.batch, max_loras, parts[leaf], max_rank, in_features, out_features,
                    dtype, device)
        self.shapes = {name: (s.b.shape[1], s.a.shape[2]) for name, s in self.slots.items()}
        # The most an adapter sent as tensors may weigh: every rank's slice of one slot,
        # in fp32, twice (what is whole on every rank is counted once per rank).
        slot_elements = sum((s.a[0].numel() + s.b[0].numel()) for s in self.slots.values())
        self.max_bytes = 2 * tp.size * slot_elements * 4
        self.sources: dict[int, _Source] = {}
        self.host: OrderedDict[int, LoadedAdapter] = OrderedDict()  # LRU: oldest first
        self.slot_ids = [0] * max_loras  # adapter in each slot (0: free)
        self.slot_of: dict[int, int] = {}
        self.slot_order: list[int] = []  # slots, least recently used first

    # -- adapters in and out -------------------------------------------------------

    def add(self, lora: LoRARequest, tensors: dict[str, torch.Tensor] | None = None,
            config: dict[str, Any] | None = None) -> None:
        """Read and place `lora` (from `tensors` and `config` when given, else its
        directory). An id added before is read again only with `load_inplace` (or when
        its source changed); then a slot holding it is rewritten now: the next step
        runs the new weights. Raises ValueError naming what is wrong."""
        old = self.sources.get(lora.lora_int_id)
        fresh = tensors is not None or old is None or lora.load_inplace or (
            old.request.lora_path != lora.lora_path)
        if not fresh:
            self._loaded(lora.lora_int_id)  # read again if the host cache dropped it
            return
        if tensors is not None:
            if config is None:
                raise ValueError("an adapter from tensors needs its PEFT config")
            parsed = LoRAConfig.from_dict(config, self.max_rank)
            pinned = sum(1 for s in self.sources.values() if s.tensors is not None
                         and s.request.lora_int_id != lora.lora_int_id)
            if pinned >= self.max_cpu_loras:
                raise ValueError(f"max_cpu_loras={self.max_cpu_loras} adapters from tensors "
                                 "are loaded: remove one first")
            source = _Source(lora, dict(tensors), parsed)
        else:
            if not lora.lora_path:
                raise ValueError(f"LoRA adapter {lora.lora_name!r} has no lora_path")
            source = _Source(lora)
        adapter = self._read(source)
        self.sources[lora.lora_int_id] = source
        self._cache(lora.lora_int_id, adapter)
        slot = self.slot_of.get(lora.lora_int_id)
        if slot is not None:
            self._put(slot, adapter)

    def remove(self, lora_int_id: int) -> bool:
        """Forget an adapter everywhere; False if it was not added."""
        if self.sources.pop(lora_int_id, None) is None:
            return False
        self.host.pop(lora_int_id, None)
        slot = self.slot_of.pop(lora_int_id, None)
        if slot is not None:
            self.slot_ids[slot] = 0
            self._put(slot, None)
        return True

    def ids(self) -> list[int]:
        return sorted(self.sources)

    # -- one step ------------------------------------------------------------------

    def prepare_step(self, runs: list[tuple[int, int, int]]) -> None:
        """Page the step's adapters into slots and set the step's runs: `runs` are
        (lora_int_id, first row, end row), one per adapter, base-model runs left out."""
        if not runs:
            self.batch.runs = []
            return
        needed = {lora_id for lora_id, _, _ in runs}
        for lora_id in needed:
            if lora_id not in self.slot_of:
                self._page_in(lora_id, needed)
        for lora_id in needed:  # most recently used last
            slot = self.slot_of[lora_id]
            self.slot_order.remove(slot)
            self.slot_order.append(slot)
        self.batch.runs = [(self.slot_of[lora_id], start, end) for lora_id, start, end in runs]

    def _page_in(self, lora_id: int, needed: set[int]) -> None:
        if lora_id not in self.sources:
            raise RuntimeError(f"LoRA adapter {lora_id} was not added to this worker")
        free = [s for s, held in enumerate(self.slot_ids) if held == 0]
        if free:
            slot = free[0]
        else:
            slot = next(s for s in self.slot_order if self.slot_ids[s] not in needed)
            del self.slot_of[self.slot_ids[slot]]
        if slot in self.slot_order:
            self.slot_order.remove(slot)
        self.slot_order.append(slot)
        self._put(slot, self._loaded(lora_id))
        self.slot_ids[slot] = lora_id
        self.slot_of[lora_id] = slot

    # -- helpers -------------------------------------------------------------------

    def _read(self, source: _Source) -> LoadedAdapter:
        if source.tensors is not None:
            assert source.config is not None
            config, tensors = source.config, source.tensors
        else:
            config, tensors = read_directory(source.request.lora_path, self.max_rank)
        return build(config, ((self.our_name(n), t) for n, t in tensors.items()),
                     self.spec, self.tp, self.shapes, self.dtype)

    def _loaded(self, lora_id: int) -> LoadedAdapter:
        """The adapter's host copy, read again if the cache dropped it."""
        adapter = self.host.get(lora_id)
        if adapter is None:
            adapter = self._read(self.sources[lora_id])
            self._cache(lora_id, adapter)
        else:
            self.host.move_to_end(lora_id)
        return adapter

    def _cache(self, lora_id: int, adapter: LoadedAdapter) -> None:
        self.host[lora_id] = adapter
        self.host.move_to_end(lora_id)
        while len(self.host) > self.max_cpu_loras:  # the oldest one that can be read again
            victim = next((i for i in self.host if self.sources[i].tensors is None
                           and i != lora_id), None)
            if victim is None:
                break
            del self.host[victim]

    def _put(self, slot: int, adapter: LoadedAdapter | None) -> None:
        for name, slots in self.slots.items():
            module = adapter.modules.get(name) if adapter is not None else None
            slots.put(slot, None if module is None else module.a,
                      None if module is None else module.b)
