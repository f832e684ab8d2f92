"""`AsyncLLM`: the engine for asyncio services (and the OpenAI server).

    async for out in engine.generate(prompt, SamplingParams(...), request_id):
        ...

One output-handler task per event loop reads the engine core's outputs (zmq's asyncio
support: no polling) and detokenizes them; one pass on the loop delivers a whole engine
step to every stream's `RequestOutputCollector`, and each consumer builds its
`RequestOutput` when it runs, from everything since its last one (a consumer that is
behind wakes once for several steps). `generate` is an async generator over its
collector. Leaving the loop early or cancelling the consuming task aborts the request
in the engine core.

Tokenization and chat templates never run on the event loop: they run on one
tokenizer thread (`run_in_tokenizer_thread`), one job at a time, so a long prompt
delays other prompts' tokenization but never the loop (health checks, streams).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

from pagellm.demo.model import resolve_model
from pagellm.frontend.engine_client.async_mp_client import in_loop
from pagellm.frontend.engine_client.core_client import (
    AsyncEngineCoreClient,
    EngineDeadError,
    utility_timeout,
)
from pagellm.frontend.engine_client.factory import make_client
from pagellm.frontend.generation_config import (
    default_sampling_fields,
    generation_eos_token_ids,
)
from pagellm.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagellm.frontend.output_processor import OutputProcessor
from pagellm.frontend.outputs import RequestOutput
from pagellm.frontend.tokenizer import tokenizer_for
from pagellm.logger import configure_logging
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.lora import LoRARequest, peft_config_dict, plain
from pagellm.protocol.messages import UtilityMethod
from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.stats import EngineStats
from pagellm.protocol.utility import PauseArgs
from pagellm.protocol.validation import check_float
from pagellm.transport.curve import CurveClientKeys
from pagellm.weights.gguf import resolve_gguf
from pagellm.weights.sender import WeightsArg, cuda_ipc_receivers, init_info_of, weight_update

logger = logging.getLogger("pagellm")
T = TypeVar("T")
DRAIN_POLL_S = 0.05  # wait_for_requests_to_drain (vLLM polls each second)


class AsyncLLM:
    """Takes the same engine arguments as `LLM` (and `engine_address` / CURVE keys to
    attach to a running engine core)."""

    def __init__(self, model: str, *, engine_address: str | None = None,
                 curve_secret_key: str | None = None,
                 curve_server_public_key: str | None = None, **kwargs: Any) -> None:
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        if engine_address is None and args.weight_transfer_config is None:
            # As `LLM`: the service that starts its engine owns it, so `update_weights`
            # works on a first try (a server's shared engine opts in: from_engine_args).
            args = args.replace(weight_transfer_config={"backend": "ipc"})
        self._start(args, engine_address,
                    CurveClientKeys.from_paths(curve_secret_key, curve_server_public_key))

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, *, engine_address: str | None = None,
                         curve: CurveClientKeys | None = None) -> AsyncLLM:
        """vLLM's constructor for services that already hold their `EngineArgs`."""
        engine = cls.__new__(cls)
        engine._start(engine_args, engine_address, curve)
        return engine

    def _start(self, args: EngineArgs, engine_address: str | None,
               curve: CurveClientKeys | None) -> None:
        self.engine_core: AsyncEngineCoreClient | None = None
        self._output_handler: asyncio.Task[None] | None = None
        # One thread: the tokenizers library's objects are not safe to use from several
        # threads at once, and one job at a time keeps prompts in arrival order.
        self._tokenizer_thread = ThreadPoolExecutor(1, thread_name_prefix="pagellm-tokenize")
        configure_logging()
        self.engine_args = args = resolve_gguf(resolve_model(args))
        self.tokenizer = tokenizer_for(args)
        # The model's sampling defaults (generation_config): the server applies them to
        # every field a request leaves unset.
        self.default_sampling_fields = default_sampling_fields(args.model,
                                                               args.generation_config)
        self.engine_core = make_client(args, asyncio_mode=True, engine_address=engine_address,
                                       curve=curve)
        self.info = self.engine_core.info
        self.input_processor = InputProcessor(
            self.tokenizer, self.info, generation_eos_token_ids(args.model),
            self.default_sampling_fields.get("max_tokens"),
            args.structured_outputs("backend", "auto"))
        self.output_processor = OutputProcessor(self.tokenizer)
        # How long after the engine produced them outputs are processed here (mean of
        # recent batches; engine and frontend share time.monotonic() on one host).
        self.output_lag_s = 0.0

    async def generate(self, prompt: PromptType, sampling_params: SamplingParams | None,
                       request_id: str, priority: int = 0,
                       lora_request: LoRARequest | None = None
                       ) -> AsyncGenerator[RequestOutput, None]:
        """Stream the request's outputs as `sampling_params.output_kind` asks (with
        n > 1, each output carries the completions that changed, by index);
        `lora_request`: its adapter (needs enable_lora)."""
        processed = await self.run_in_tokenizer_thread(
            self.process, prompt, sampling_params, request_id, priority, lora_request)
        async for output in self.stream(processed):
            yield output

    async def run_in_tokenizer_thread(self, fn: Callable[..., T], *args: Any,
                                      **kwargs: Any) -> T:
        """Run tokenizer work (`process`, chat templates, encode/decode) off the loop."""
        self._client()  # after shutdown: say so, not "cannot schedule new futures"
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._tokenizer_thread,
                                          functools.partial(fn, *args, **kwargs))

    def process(self, prompt: PromptType, sampling_params: SamplingParams | None,
                request_id: str, priority: int = 0,
                lora_request: LoRARequest | None = None) -> ProcessedRequest:
        """Validate and tokenize without starting anything (the server validates every
        prompt of a request before it starts any). Blocking: from the event loop, call it
        through `run_in_tokenizer_thread`."""
        self._client().check_alive()
        if not isinstance(request_id, str) or not request_id:
            raise ValueError(f"request_id must be a non-empty string, got {request_id!r}")
        return self.input_processor.process_inputs(
            request_id, prompt, sampling_params or SamplingParams(), priority=priority,
            lora_request=lora_request)

    async def stream(self, processed: ProcessedRequest) -> AsyncGenerator[RequestOutput, None]:
        """Run a processed request and stream its outputs."""
        engine_core = self._client()
        engine_core.check_alive()
        self._ensure_output_handler()
        request_id = processed.request_id
        collector = self.output_processor.add_stream(processed)
        state = self.output_processor.requests[request_id]
        finished = False
        try:
            for request in processed.engine_requests:
                engine_core.add_request(request)
            while not finished:
                # No wait (no task switch) when an output is already there.
                item = collector.get_nowait() or await collector.get()
                if isinstance(item, BaseException):
                    finished = True
                    raise item
                finished = item.finished
                yield item
        finally:
            # Cancelled, or the consumer left the loop early: abort the request, unless
            # it finished meanwhile and its id now names another stream's request.
            if not finished and self.output_processor.requests.get(request_id) is state:
                self._abort([request_id])

    async def abort(self, request_id: str | Iterable[str]) -> None:
        """Stop a request, or several (vLLM takes one id or an iterable of them): each
        stream ends with a final output whose finish_reason is "abort"; their blocks
        are freed. Unknown or finished ids are ignored."""
        self._abort([request_id] if isinstance(request_id, str) else list(request_id))

    def get_tokenizer(self) -> Any:
        """The frontend's tokenizer (vLLM's current signature: a plain method; before
        vLLM 0.11 it was a coroutine). ValueError with skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        return self.tokenizer

    async def check_health(self) -> None:
        """Raise EngineDeadError if the engine core died (RuntimeError after shutdown);
        return quietly while it serves."""
        self._client().check_alive()
        if self.errored:
            raise EngineDeadError("the AsyncLLM output handler failed (see the log)")

    @property
    def is_running(self) -> bool:
        """vLLM's meaning: started, not shut down, and its engine core alive."""
        return self.engine_core is not None and not self.errored

    @property
    def errored(self) -> bool:
        """True once the engine core died or the output handler failed (it only ever
        ends by failing or by being cancelled, at shutdown or with its event loop)."""
        handler_failed = self._output_handler is not None and self._output_handler.done() \
            and not self._output_handler.cancelled()
        return self.is_dead or handler_failed

    @property
    def is_stopped(self) -> bool:
        """vLLM's meaning: the engine can serve no more (it errored, or was shut
        down)."""
        return self.engine_core is None or self.errored

    async def get_stats(self) -> EngineStats:
        self._ensure_output_handler()
        return await self._client().get_stats_async()

    async def reset_prefix_cache(self, reset_running_requests: bool = False,
                                 reset_connector: bool = False) -> bool:
        """See `LLM.reset_prefix_cache`."""
        return await self._utility(UtilityMethod.RESET_PREFIX_CACHE, reset_running_requests,
                                   reset_connector)

    # -- LoRA adapters (as `LLM`'s methods, awaitable) -------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> bool:
        """See `LLM.add_lora`."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got "
                            f"{type(lora_request).__name__}")
        tensors = getattr(lora_request, "lora_tensors", None)
        if tensors is None:
            return bool(await self._utility(UtilityMethod.ADD_LORA, plain(lora_request)))
        config = peft_config_dict(getattr(lora_request, "peft_config", None))
        with contextlib.ExitStack() as stack:
            receivers = cuda_ipc_receivers(self.info, in_process=False)  # always a process
            update = await asyncio.to_thread(stack.enter_context,
                                             weight_update(tensors.items(), receivers))
            return bool(await self._utility(UtilityMethod.ADD_LORA, plain(lora_request),
                                            config, update))

    async def remove_lora(self, lora_id: int) -> bool:
        """See `LLM.remove_lora`."""
        return bool(await self._utility(UtilityMethod.REMOVE_LORA, lora_id))

    async def list_loras(self) -> set[int]:
        """See `LLM.list_loras`."""
        return set(await self._utility(UtilityMethod.LIST_LORAS))

    # -- RL rollouts (as `LLM`'s methods, awaitable) ---------------------------------

    async def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """See `LLM.sleep`."""
        await self._utility(UtilityMethod.SLEEP, level, mode)

    async def wake_up(self, tags: list[str] | None = None) -> bool:
        """See `LLM.wake_up`."""
        return await self._utility(UtilityMethod.WAKE_UP, tags)

    async def is_sleeping(self) -> bool:
        return await self._utility(UtilityMethod.IS_SLEEPING)

    async def pause_generation(self, mode: str = "abort", *,
                               wait_for_inflight_requests: bool | None = None,
                               clear_cache: bool = True) -> None:
        """Stop scheduling (vLLM's keywords): "abort" in-flight requests (their streams
        end with finish_reason "abort"), "wait" until they finish (new ones fail
        meanwhile), or "keep" them, and new ones, for `resume_generation()`.
        `wait_for_inflight_requests=True` is vLLM's deprecated spelling of mode="wait".
        `clear_cache` (default True, as in vLLM): once the pause has settled, reset the
        prefix cache, preempting kept requests so that none holds a block (they
        recompute after the resume, with the same tokens). `mode` may also be given by
        position (pagellm's older signature; vLLM's is keyword-only)."""
        await self._utility(UtilityMethod.PAUSE, *PauseArgs.from_vllm(
            mode, wait_for_inflight_requests, clear_cache))

    async def resume_generation(self) -> None:
        await self._utility(UtilityMethod.RESUME)

    async def is_paused(self) -> bool:
        return await self._utility(UtilityMethod.IS_PAUSED)

    async def update_weights(self, weights: WeightsArg) -> int:
        """See `LLM.update_weights` (the shared-memory copy runs off the event loop)."""
        with contextlib.ExitStack() as stack:
            receivers = cuda_ipc_receivers(self.info, in_process=False)  # always a process
            update = await asyncio.to_thread(stack.enter_context,
                                             weight_update(weights, receivers))
            return await self._utility(UtilityMethod.UPDATE_WEIGHTS, update)

    async def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        """See `LLM.init_weight_transfer_engine`."""
        await self._utility(UtilityMethod.INIT_WEIGHT_TRANSFER_ENGINE, init_info_of(request))

    async def start_weight_update(self) -> None:
        await self._utility(UtilityMethod.START_WEIGHT_UPDATE)

    async def finish_weight_update(self, weight_version: str | None = None) -> None:
        await self._utility(UtilityMethod.FINISH_WEIGHT_UPDATE, weight_version)

    async def collective_rpc(self, method: str, timeout: float | None = None,
                             args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                             ) -> list[Any]:
        """See `LLM.collective_rpc`."""
        from pagellm.weights.tensor_codec import decode_value, encode_value

        if timeout is not None:
            check_float("timeout", timeout, minimum=0.0, min_exclusive=True)
        self._ensure_output_handler()
        return decode_value(await self._client().call_utility_async(
            UtilityMethod.COLLECTIVE_RPC, method, encode_value(list(args)),
            encode_value(kwargs or {}), timeout=timeout))

    async def wait_for_requests_to_drain(self, drain_timeout: float = 300) -> None:
        """vLLM's: return once no request is in flight, here (outputs not yet delivered)
        or in the engine core (running or waiting, from any client: a request kept by a
        pause in mode "keep" counts); TimeoutError after `drain_timeout` seconds. Polls
        the engine's stats every DRAIN_POLL_S while this frontend has nothing pending."""
        check_float("drain_timeout", drain_timeout, minimum=0.0)
        deadline = time.monotonic() + drain_timeout
        in_engine = "not asked"
        while True:
            if not self.output_processor.has_unfinished_requests():
                stats = await self.get_stats()
                if stats.num_running_reqs + stats.num_waiting_reqs == 0:
                    return
                in_engine = f"{stats.num_running_reqs} running, {stats.num_waiting_reqs} waiting"
            if time.monotonic() >= deadline:
                raise TimeoutError(
                    f"requests did not drain within {drain_timeout} s (this frontend: "
                    f"{self.output_processor.get_num_unfinished_requests()} unfinished; "
                    f"the engine core: {in_engine})")
            await asyncio.sleep(DRAIN_POLL_S)

    async def _utility(self, method: UtilityMethod, *args: Any) -> Any:
        """A utility call, waited for as long as its row says (`no_timeout`)."""
        self._ensure_output_handler()
        return await self._client().call_utility_async(method, *args,
                                                       timeout=utility_timeout(method))

    @property
    def is_dead(self) -> bool:
        return self.engine_core is not None and self.engine_core.dead_error is not None

    @property
    def engine_busy_s(self) -> float:
        """How long the engine core's loop has been inside its current step or control
        call (0 while it turns, idle included): a loop blocked in one call still
        heartbeats, so this, not `is_dead`, tells a server it can serve no one."""
        return 0.0 if self.engine_core is None else self.engine_core.engine_busy_s()

    def shutdown(self) -> None:
        if getattr(self, "_tokenizer_thread", None) is None:
            return  # failed before anything started
        self._tokenizer_thread.shutdown(wait=False, cancel_futures=True)
        handler, self._output_handler = self._output_handler, None
        if handler is not None and not handler.get_loop().is_closed():
            # Cancelled in its loop, it ends every open stream (`_handle_outputs`).
            if in_loop(handler.get_loop()):
                handler.cancel()
            else:
                handler.get_loop().call_soon_threadsafe(handler.cancel)
        engine_core, self.engine_core = self.engine_core, None
        if engine_core is not None:
            engine_core.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.shutdown()

    # -- internals -------------------------------------------------------------------

    def _client(self) -> AsyncEngineCoreClient:
        if self.engine_core is None:
            raise RuntimeError("this AsyncLLM has been shut down")
        return self.engine_core

    def _abort(self, request_ids: list[str]) -> None:
        unfinished = self.output_processor.abort_requests(request_ids)
        if unfinished and self.engine_core is not None and not self.is_dead:
            self.engine_core.abort_requests(unfinished)

    def _ensure_output_handler(self) -> None:
        loop = asyncio.get_running_loop()
        if self._output_handler is None or self._output_handler.get_loop() is not loop:
            self._output_handler = loop.create_task(self._handle_outputs())

    async def _handle_outputs(self) -> None:
        engine_core = self._client()
        try:
            while True:
                outputs = await engine_core.get_output_async()
                processed = self.output_processor.process_outputs(outputs)
                if processed.reqs_to_abort:  # stop strings: stop the engine at once
                    engine_core.abort_requests(processed.reqs_to_abort)
                lag = time.monotonic() - outputs.timestamp
                self.output_lag_s = 0.9 * self.output_lag_s + 0.1 * lag
        except EngineDeadError as e:
            self.output_processor.fail_all(e)
        except asyncio.CancelledError:  # shutdown(): no stream may wait on
            self.output_processor.fail_all(EngineDeadError("this AsyncLLM was shut down"))
            raise
        except Exception as e:  # a bug here must end the streams, not hang them
            logger.exception("AsyncLLM output handler failed")
            self.output_processor.fail_all(e)
