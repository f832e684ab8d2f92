"""A worker extension for the collective_rpc tests (`worker_extension_cls=
"rl_extension.Probe"`): the engine imports it by name."""

from __future__ import annotations

import dataclasses
import gc
import time
from typing import Any

import torch


class Probe:
    model_runner: Any  # set by the worker this class is mixed into

    def weight_checksum(self) -> float:
        """Sum of every parameter: the trainer's own sum says whether an update landed."""
        return float(sum(p.detach().double().sum() for p in self.model_runner.model.parameters()))

    def embedding_rows(self, rows: torch.Tensor) -> torch.Tensor:
        return self.model_runner.model.model.embed_tokens.weight[rows.long()].clone()

    def load_named(self, name: str, tensor: torch.Tensor) -> list[str]:
        """How TRL's and OpenRLHF's worker extensions push weights: one tensor at a
        time into the model's vLLM-style `load_weights`."""
        return sorted(self.model_runner.model.load_weights(weights=[(name, tensor)]))

    def reload_from(self, directory: str) -> int:
        """vLLM's `reload_weights`, as RL recipes call it after a level-2 wake: every
        checkpoint tensor from disk, through the model's load_weights."""
        from pathlib import Path

        from pagellm.executor.model.loader import iterate_safetensors, safetensors_files

        return len(self.model_runner.model.load_weights(
            iterate_safetensors(safetensors_files(Path(directory)))))

    def load_unseen(self, weights: dict[str, torch.Tensor]) -> int:
        """Write checkpoint tensors where load_weights would, but through `.data`, as
        some extensions do: no version counter sees these writes."""
        model = self.model_runner.model
        for name, tensor in weights.items():
            dest = model.destination(name)
            assert dest is not None and dest.tensor is not None, name
            dataclasses.replace(dest, tensor=dest.tensor.data).load(tensor)
        return len(weights)

    def describe(self, prefix: str, *, scale: float = 1.0) -> dict[str, Any]:
        return {"prefix": prefix, "scale": scale, "rank": getattr(self, "rank", None)}

    def fail(self) -> None:
        raise ValueError("probe failed on purpose")

    def nap(self, seconds: float) -> float:
        time.sleep(seconds)
        return seconds

    def cpu_settings(self) -> dict[str, Any]:
        """The engine process's CPU settings as its threads see them: torch's thread
        count, the share of a multi-threaded product of subnormals that stays
        subnormal (0.0 when every thread flushes them, 0.5 when one of two does), and
        how many objects the garbage collector holds frozen (logger.freeze_startup_heap)."""
        x = torch.full((2**22,), 1e-39)  # parallel ops: every pool thread takes a part
        kept = float(((x * 1.0) != 0).float().mean())
        return {"threads": torch.get_num_threads(), "subnormals_kept": kept,
                "frozen_objects": gc.get_freeze_count()}

    def _private(self) -> None:  # not callable through collective_rpc
        raise AssertionError("unreachable")

    def pid(self) -> int:
        import os

        return os.getpid()

    def ray_placement_group(self) -> str | None:
        """The placement group this worker's Ray actor was placed in (hex id)."""
        import ray

        return ray.get_runtime_context().get_placement_group_id()
