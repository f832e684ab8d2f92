"""A worker extension making OpenRLHF 0.11's calls (its `WorkerWrap`, read from the
released wheel), for engines on the CPU: OpenRLHF's own `update_weight` allocates its
receive buffer with device="cuda", so on a machine without CUDA this class takes
`self.device` instead; every other call is the one OpenRLHF makes, through `vllm.*`
imports that resolve only with pagellm.install_as_vllm() (PAGELLM_AS_VLLM=1 in the
engine's environment). tests/e2e/test_rl_frameworks.py drives it."""

from __future__ import annotations

from typing import Any


class WorkerWrap:
    device: Any
    model_config: Any
    model_runner: Any

    def init_process_group(self, master_address: str, master_port: int, rank_offset: int,
                           world_size: int, group_name: str, backend: str = "nccl",
                           use_ray: bool = False) -> None:
        import torch
        from vllm.distributed.device_communicators.pynccl import PyNcclCommunicator
        from vllm.distributed.utils import StatelessProcessGroup

        assert torch.distributed.is_initialized(), \
            "default torch process group must be initialized"
        assert group_name != "", "group name must not be empty"
        assert not use_ray
        rank = torch.distributed.get_rank() + rank_offset
        pg = StatelessProcessGroup.create(host=master_address, port=master_port, rank=rank,
                                          world_size=world_size)
        self._model_update_group = PyNcclCommunicator(pg, device=self.device)

    def update_weight(self, name: str, dtype: Any, shape: Any, empty_cache: bool = False
                      ) -> None:
        import torch

        assert dtype == self.model_config.dtype, \
            f"mismatch dtype: src {dtype}, dst {self.model_config.dtype}"
        weight = torch.empty(shape, dtype=dtype, device=self.device)
        self._model_update_group.broadcast(weight, src=0, stream=None)
        self.model_runner.model.load_weights(weights=[(name, weight)])
        del weight
