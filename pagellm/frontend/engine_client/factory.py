"""`make_client`: the one place that chooses an engine-core client, for `LLM`, `AsyncLLM`
and the server alike (vLLM's `EngineCoreClient.make_client`). Apart from the client
classes so that none of them imports its siblings through the base."""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Literal, overload

from pagellm.frontend.engine_client.async_mp_client import AsyncMPClient
from pagellm.frontend.engine_client.core_client import (
    AsyncEngineCoreClient,
    SyncEngineCoreClient,
)
from pagellm.frontend.engine_client.dp_client import DPAsyncClient, DPSyncClient
from pagellm.frontend.engine_client.inproc_client import InprocClient
from pagellm.frontend.engine_client.sync_mp_client import SyncMPClient
from pagellm.protocol.engine_args import EngineArgs

if TYPE_CHECKING:
    from pagellm.transport.curve import CurveClientKeys


# Engine options that shape the frontend itself, so they apply when attaching too, and
# the vLLM options that change nothing anywhere (vLLM scripts pass them to every engine).
FRONTEND_OPTIONS = frozenset({"model", "tokenizer", "skip_tokenizer_init",
                              "trust_remote_code", "disable_log_stats", "swap_space",
                              "max_seq_len_to_capture", "generation_config", "model_impl"})


@overload
def make_client(args: EngineArgs, *, asyncio_mode: Literal[False], multiprocess: bool = ...,
                engine_address: str | None = ..., curve: CurveClientKeys | None = ...
                ) -> SyncEngineCoreClient: ...


@overload
def make_client(args: EngineArgs, *, asyncio_mode: Literal[True], multiprocess: bool = ...,
                engine_address: str | None = ..., curve: CurveClientKeys | None = ...
                ) -> AsyncEngineCoreClient: ...


def make_client(args: EngineArgs, *, asyncio_mode: bool, multiprocess: bool = True,
                engine_address: str | None = None, curve: CurveClientKeys | None = None
                ) -> SyncEngineCoreClient | AsyncEngineCoreClient:
    """The engine core's client: in this process (`multiprocess=False`, for `LLM`
    only), in a child process launched here, or already running at `engine_address`
    (CURVE keys if it requires them); with data_parallel_size > 1, one client for
    several engine cores (frontend/engine_client/dp_client.py). Engine options given with
    `engine_address` are an error: that engine is configured where it runs, and
    ignoring them would mislead."""
    if engine_address is not None:
        configured = [f.name for f in dataclasses.fields(args)
                      if f.name not in FRONTEND_OPTIONS and getattr(args, f.name) != f.default]
        if configured:
            raise ValueError(f"engine option(s) {', '.join(configured)} have no effect on "
                             f"the engine core at {engine_address}: set them where it starts")
        return AsyncMPClient(None, engine_address, curve) if asyncio_mode \
            else SyncMPClient(None, engine_address, curve)
    remote_ranks = args.data_parallel_size > (args.data_parallel_size
                                              if args.data_parallel_size_local is None
                                              else args.data_parallel_size_local)
    if curve is not None and not remote_ranks:
        raise ValueError("CURVE keys are for attaching to an engine core (engine_address) "
                         "or to data-parallel engine cores of other nodes")
    if args.data_parallel_size > 1:
        if not multiprocess:
            raise ValueError("data_parallel_size > 1 runs each engine core in a process of "
                             "its own (multiprocess=False runs one in this process)")
        return DPAsyncClient(args, curve) if asyncio_mode else DPSyncClient(args, curve)
    if asyncio_mode:
        if not multiprocess:
            raise ValueError("AsyncLLM runs its engine core in a process of its own "
                             "(multiprocess=False is for LLM)")
        return AsyncMPClient(args)
    return SyncMPClient(args) if multiprocess else InprocClient(args)
