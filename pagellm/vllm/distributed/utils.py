"""vLLM's `vllm.distributed.utils`: `StatelessProcessGroup`, the rendezvous OpenRLHF's
default weight sync (`stateless_init_process_group`) builds its trainer-to-workers group
on, on both sides, before handing it to `PyNcclCommunicator`.

In pagellm the rendezvous and the group are made together by `WeightGroup`
(weights/nccl.py: a TCPStore whose rank 0 is the master, NCCL between distinct GPUs,
gloo otherwise), so this holds the address and ranks, and the group is made when the
communicator is: the same order of calls OpenRLHF makes on each side."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from pagellm.protocol.validation import check_host, check_int


@dataclass
class StatelessProcessGroup:
    """Who meets where: `rank` of `world_size` at `host:port` (rank 0 hosts the store).
    `store` and `socket` are vLLM's attributes, which trainers clear on close (TRL)."""

    host: str
    port: int
    rank: int
    world_size: int
    store_timeout: int = 300
    store: Any = None
    socket: Any = None

    @staticmethod
    def create(host: str, port: int, rank: int, world_size: int,
               data_expiration_seconds: int = 3600, store_timeout: int = 300
               ) -> StatelessProcessGroup:
        """vLLM's constructor (`data_expiration_seconds` has nothing to expire here: the
        group carries tensors only; `store_timeout` is the communicator's join timeout)."""
        check_host("host", host)
        check_int("port", port, minimum=1, maximum=65535)
        check_int("world_size", world_size, minimum=2, maximum=1024)
        check_int("rank", rank, minimum=0, maximum=world_size - 1)
        check_int("store_timeout", store_timeout, minimum=1, maximum=3600)
        return StatelessProcessGroup(host, port, rank, world_size, store_timeout)


__all__ = ["StatelessProcessGroup"]
