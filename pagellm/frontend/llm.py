"""`LLM`: offline, synchronous generation for scripts (vLLM's interface)."""

from __future__ import annotations

import dataclasses
import inspect
import itertools
import os
import time
import weakref
from collections.abc import Sequence
from typing import Any

from pagellm.demo.model import resolve_model
from pagellm.frontend.chat_utils import template_messages
from pagellm.frontend.engine_client.core_client import (
    EngineDeadError,
    SyncEngineCoreClient,
    utility_timeout,
)
from pagellm.frontend.engine_client.factory import make_client
from pagellm.frontend.engine_client.inproc_client import InprocClient
from pagellm.frontend.generation_config import (
    default_sampling_fields,
    generation_eos_token_ids,
)
from pagellm.frontend.input_processor import InputProcessor, ProcessedRequest, PromptType
from pagellm.frontend.llm_engine import LLMEngine, PendingWeights
from pagellm.frontend.output_processor import OutputProcessor
from pagellm.frontend.outputs import RequestOutput
from pagellm.frontend.tokenizer import tokenizer_for
from pagellm.logger import configure_logging
from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.lora import LoRARequest, peft_config_dict, plain
from pagellm.protocol.messages import UtilityMethod
from pagellm.protocol.sampling_params import RequestOutputKind, SamplingParams
from pagellm.protocol.stats import EngineStats
from pagellm.protocol.utility import PauseArgs
from pagellm.protocol.validation import check_float
from pagellm.transport.curve import CurveClientKeys
from pagellm.weights.gguf import resolve_gguf
from pagellm.weights.sender import WeightsArg, cuda_ipc_receivers, init_info_of, weight_update

ChatMessages = list[dict[str, Any]]


class LLM:
    """Generate completions for batches of prompts.

    Keyword arguments are `EngineArgs` fields (`max_model_len`, `dtype`, ...); unknown
    ones raise TypeError naming them. The engine core runs in a child process
    (`multiprocess=False` keeps it in this one, for debugging; unset, vLLM's
    VLLM_ENABLE_V1_MULTIPROCESSING and external launcher decide: `engine_in_own_process`),
    or, with
    `engine_address`, is one already running elsewhere (CURVE key files if it requires
    them); the model directory then only provides the tokenizer. With
    `data_parallel_size=N`, N engine cores serve behind one client
    (frontend/engine_client/dp_client.py); the CURVE keys then secure those of other nodes.
    """

    # What llm_engine's proxy queued for the engine (class-level default: the object
    # exists before __init__ runs, e.g. for tests that build one without it).
    _pending_weights: PendingWeights | None = None

    def __init__(self, model: str, *, engine_address: str | None = None,
                 multiprocess: bool | None = None, curve_secret_key: str | None = None,
                 curve_server_public_key: str | None = None, **kwargs: Any) -> None:
        self.engine_core: SyncEngineCoreClient | None = None
        configure_logging()
        args = EngineArgs.from_kwargs(model=model, **kwargs)
        if engine_address is None and args.weight_transfer_config is None:
            # This script owns the engine it starts, so it may load weights into it (as
            # vLLM's LLM may, through llm_engine); a shared engine opts in where it runs.
            args = args.replace(weight_transfer_config={"backend": "ipc"})
        self.engine_args = args = resolve_gguf(resolve_model(args))
        self.tokenizer = tokenizer_for(args)
        self.default_sampling_fields = default_sampling_fields(args.model,
                                                               args.generation_config)
        self.engine_core = make_client(
            args, asyncio_mode=False, multiprocess=engine_in_own_process(args, multiprocess),
            engine_address=engine_address,
            curve=CurveClientKeys.from_paths(curve_secret_key, curve_server_public_key))
        # At exit, before the interpreter tears its modules down (a __del__ run then
        # found torch.distributed half gone and printed a traceback), and when collected.
        self._finalizer = weakref.finalize(self, self.engine_core.shutdown)
        self.info = self.engine_core.info
        self.input_processor = InputProcessor(
            self.tokenizer, self.info, generation_eos_token_ids(args.model),
            self.default_sampling_fields.get("max_tokens"),
            args.structured_outputs("backend", "auto"))
        self.output_processor = OutputProcessor(self.tokenizer)
        self._request_counter = itertools.count()

    @property
    def llm_engine(self) -> LLMEngine:
        """vLLM's `llm.llm_engine`, for the path RL trainers load weights through:
        `llm_engine.model_executor.driver_worker.model_runner.model.load_weights(...)`
        (frontend/llm_engine.py): the real model with the engine core in this process,
        else a proxy that sends the tensors batched."""
        client = self.engine_core  # not _client(): that would send the queue per tensor
        if client is None:
            raise RuntimeError("this LLM has been shut down")
        if isinstance(client, InprocClient):
            return LLMEngine(self.info, client.core.executor)
        if self._pending_weights is None:
            self._pending_weights = PendingWeights(self.update_weights)
        return LLMEngine.remote(self.info, self._pending_weights)

    @classmethod
    def from_engine_args(cls, engine_args: EngineArgs, **kwargs: Any) -> LLM:
        """vLLM's constructor for scripts that already hold their `EngineArgs`
        (`kwargs`: this class's own, e.g. multiprocess)."""
        fields = {f.name: getattr(engine_args, f.name) for f in dataclasses.fields(engine_args)}
        return cls(**fields, **kwargs)

    # -- generation ----------------------------------------------------------------

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, priority: Sequence[int] | None = None,
                 lora_request: LoRARequest | Sequence[LoRARequest | None] | None = None
                 ) -> list[RequestOutput]:
        """Complete every prompt; outputs come back in input order.

        prompts: a string, {"prompt": ...} or {"prompt_token_ids": [...]} (either may add
            "cache_salt"), or a list of those.
        sampling_params: one for all prompts or a list with one per prompt; n > 1 gives
            n completions per prompt. None: `get_default_sampling_params()`.
        priority: one per prompt, for scheduling_policy="priority" (lower first).
        lora_request: the LoRA adapter for all prompts, or a list with one (or None: the
            base model) per prompt (needs enable_lora).
        """
        engine_core = self._client()
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        if sampling_params is None:
            sampling_params = self.get_default_sampling_params()
        params_list = _per_prompt(sampling_params, SamplingParams, "sampling_params",
                                  "sampling_params", len(prompt_list))
        priorities = [0] * len(prompt_list) if priority is None else list(priority)
        if len(priorities) != len(prompt_list):
            raise ValueError(f"got {len(priorities)} priorities for {len(prompt_list)} prompts")
        loras = _per_prompt(lora_request, LoRARequest, "lora_request", "lora_requests",
                            len(prompt_list))
        # Validate everything before sending anything: a bad prompt leaves no trace.
        requests = [self._process(p, sp, prio, lora) for p, sp, prio, lora in zip(
            prompt_list, params_list, priorities, loras, strict=True)]
        request_ids = [r.request_id for r in requests]
        try:
            for processed in requests:
                self.output_processor.add_request(processed)
                for request in processed.engine_requests:
                    engine_core.add_request(request)
        except BaseException:  # a send failed: what was registered or sent must go too
            self._abort(engine_core, request_ids)
            raise
        return self._run(request_ids, use_tqdm)

    def chat(self, messages: ChatMessages | Sequence[ChatMessages],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them, rendered with
        `chat_template` (a Jinja template string; default: the tokenizer's) as vLLM
        does: with the assistant's generation prompt, or, with
        continue_final_message=True, continuing the last (assistant) message where it
        stops. `tools` and `chat_template_kwargs` reach the template."""
        if self.tokenizer is None:
            raise ValueError("chat needs a tokenizer (this LLM has skip_tokenizer_init=True)")
        if add_generation_prompt and continue_final_message:
            raise ValueError("Cannot set both `continue_final_message` and "
                             "`add_generation_prompt` to True.")
        # A script's own template is trusted like the script: it renders here, unsandboxed
        # (the server sandboxes templates that come with requests).
        template_args: dict[str, Any] = dict(chat_template_kwargs or {})
        template_args.update(add_generation_prompt=add_generation_prompt,
                             continue_final_message=continue_final_message)
        if chat_template is not None:
            template_args["chat_template"] = chat_template
        if tools is not None:
            template_args["tools"] = tools
        conversations = ([messages] if messages and isinstance(messages[0], dict)
                         else list(messages))
        prompts: list[PromptType] = []
        for conversation in conversations:
            if not isinstance(conversation, list) or not all(
                    isinstance(m, dict) and "role" in m for m in conversation):
                raise TypeError("messages must be a list of {'role': ..., 'content': ...} "
                                "dicts, or a list of such lists")
            # Rendered, then encoded without the tokenizer's own specials (the template
            # has them): the ids transformers' tokenize=True gives, and the text the
            # outputs report as their prompt (vLLM's).
            text = self.tokenizer.apply_chat_template(template_messages(conversation),
                                                      tokenize=False, **template_args)
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            prompts.append({"prompt_token_ids": list(ids), "prompt": text})
        return self.generate(prompts, sampling_params, use_tqdm)

    def get_default_sampling_params(self) -> SamplingParams:
        """What `generate` samples with when given no params (vLLM's): the model's
        generation_config.json defaults (`generation_config` option), else
        SamplingParams()'s."""
        return SamplingParams(**self.default_sampling_fields)

    def get_tokenizer(self) -> Any:
        """The tokenizer prompts are encoded with (vLLM's method). ValueError with
        skip_tokenizer_init."""
        if self.tokenizer is None:
            raise ValueError("Tokenizer not available when `skip_tokenizer_init=True`")
        return self.tokenizer

    def check_health(self) -> None:
        """Raise EngineDeadError if the engine core died (RuntimeError after
        shutdown)."""
        engine_core = self._client()
        if engine_core.dead_error is not None:
            raise EngineDeadError(engine_core.dead_error)

    def get_stats(self) -> EngineStats:
        return self._client().get_stats()

    def reset_prefix_cache(self, reset_running_requests: bool = False,
                           reset_connector: bool = False) -> bool:
        """Forget every cached prefix (e.g. after pushing new weights); vLLM's
        signature. False, changing nothing, while requests hold KV blocks, unless
        `reset_running_requests` first preempts the running ones (they keep their tokens
        and recompute their KV when next scheduled). There is no KV connector here:
        `reset_connector=True` resets the local cache all the same and answers False
        (with a warning), as vLLM does when none is configured."""
        return self._utility(UtilityMethod.RESET_PREFIX_CACHE, reset_running_requests,
                             reset_connector)

    # -- LoRA adapters (vLLM's names) -------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> bool:
        """Read an adapter into the workers before any request names it (a request
        naming a new one adds it too): from its directory, or, for a TensorLoRARequest
        (verl's shape: `peft_config` and `lora_tensors`), from tensors in memory sent
        through shared memory, no file written (an id added before is then replaced).
        With `lora_request.load_inplace`, replace the
        weights of the adapter under its id. Raises RuntimeError naming what is wrong
        with it (as the engine's workers found it)."""
        if not isinstance(lora_request, LoRARequest):
            raise TypeError(f"lora_request must be a LoRARequest, got "
                            f"{type(lora_request).__name__}")
        tensors = getattr(lora_request, "lora_tensors", None)
        if tensors is None:
            return bool(self._utility(UtilityMethod.ADD_LORA, plain(lora_request)))
        config = peft_config_dict(getattr(lora_request, "peft_config", None))
        client = self._client()
        receivers = cuda_ipc_receivers(self.info, isinstance(client, InprocClient))
        with weight_update(tensors.items(), receivers) as update:
            return bool(self._utility(UtilityMethod.ADD_LORA, plain(lora_request), config,
                                      update))

    def remove_lora(self, lora_id: int) -> bool:
        """Forget an adapter (False: not added); no request may be using it."""
        return bool(self._utility(UtilityMethod.REMOVE_LORA, lora_id))

    def list_loras(self) -> set[int]:
        """The ids of the adapters added."""
        return set(self._utility(UtilityMethod.LIST_LORAS))

    # -- RL rollouts: sleep, pause, weight updates, collective_rpc (vLLM's names) -----

    def sleep(self, level: int = 1, mode: str = "abort") -> None:
        """Pause scheduling (in-flight requests: "abort" them, "wait" for them, or
        "keep" them for later) and, at level 1, free the KV cache and move the weights
        to host memory; at level 2, discard both. Needs enable_sleep_mode=True for
        levels 1 and 2. Requests sent while asleep fail, except in mode "keep"."""
        self._utility(UtilityMethod.SLEEP, level, mode)

    def wake_up(self, tags: list[str] | None = None) -> bool:
        """Allocate again what `tags` name ("weights", "kv_cache", "scheduling"; None:
        all). Scheduling resumes once nothing is asleep; True when fully awake."""
        return self._utility(UtilityMethod.WAKE_UP, tags)

    def is_sleeping(self) -> bool:
        """True while paused or while any memory is asleep (vLLM's meaning)."""
        return self._utility(UtilityMethod.IS_SLEEPING)

    def pause_generation(self, mode: str = "abort", *,
                         wait_for_inflight_requests: bool | None = None,
                         clear_cache: bool = True) -> None:
        """Stop scheduling without freeing memory; `mode` as for `sleep` (vLLM's
        keywords: `wait_for_inflight_requests=True` is its deprecated spelling of
        mode="wait"). `clear_cache` (default True, as in vLLM): once the pause has
        settled, reset the prefix cache, preempting kept requests so that none holds a
        block. `mode` may also be given by position (vLLM's is keyword-only)."""
        self._utility(UtilityMethod.PAUSE, *PauseArgs.from_vllm(
            mode, wait_for_inflight_requests, clear_cache))

    def resume_generation(self) -> None:
        self._utility(UtilityMethod.RESUME)

    def is_paused(self) -> bool:
        return self._utility(UtilityMethod.IS_PAUSED)

    def update_weights(self, weights: WeightsArg) -> int:
        """Load new weights into the running engine: `(checkpoint name, tensor)` pairs
        (Hugging Face names, full tensors, any subset of the model's). They travel
        through shared memory, not the socket (GPU tensors to a CUDA engine in another
        process: CUDA IPC, device to device); the engine checks every name, shape and
        dtype before copying (a bad update leaves the old weights serving) and forgets
        cached prefixes. Needs weight_transfer_config={"backend": "ipc"}. Returns the
        number of tensors loaded. A trainer process on the same host may instead write
        the shared memory itself (`pagellm.weights.shm.shared_weights`) and
        pass the `WeightUpdate` it yields."""
        client = self._client()
        receivers = cuda_ipc_receivers(self.info, isinstance(client, InprocClient))
        with weight_update(weights, receivers) as update:
            return self._utility(UtilityMethod.UPDATE_WEIGHTS, update)

    def init_weight_transfer_engine(self, request: dict[str, Any]) -> None:
        """vLLM's phase 0: {"init_info": {"master_address", "master_port", "rank_offset",
        "world_size"}} joins the trainer's group (backend "nccl"; call it while the
        trainer calls `pagellm.weights.nccl.trainer_init`)."""
        self._utility(UtilityMethod.INIT_WEIGHT_TRANSFER_ENGINE, init_info_of(request))

    def start_weight_update(self) -> None:
        self._utility(UtilityMethod.START_WEIGHT_UPDATE)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        """Ends the round: cached prefixes are forgotten."""
        self._utility(UtilityMethod.FINISH_WEIGHT_UPDATE, weight_version)

    def collective_rpc(self, method: str, timeout: float | None = None,
                       args: tuple[Any, ...] = (), kwargs: dict[str, Any] | None = None
                       ) -> list[Any]:
        """Call `method` of the worker extension (worker_extension_cls) on every worker;
        one result each. A method is a name, never a callable: nothing is pickled.
        Arguments and results are msgpack values and tensors. `timeout` bounds the
        caller's wait (TimeoutError), not the method, which runs on in the engine; an
        in-process engine (multiprocess=False) runs it in this thread, so it has none."""
        from pagellm.weights.tensor_codec import decode_value, encode_value

        if timeout is not None:
            check_float("timeout", timeout, minimum=0.0, min_exclusive=True)
        results = self._client().call_utility(
            UtilityMethod.COLLECTIVE_RPC, method, encode_value(list(args)),
            encode_value(kwargs or {}), timeout=timeout)
        return decode_value(results)

    # -- lifecycle -----------------------------------------------------------------

    def shutdown(self) -> None:
        self.engine_core = None
        finalizer = getattr(self, "_finalizer", None)  # absent if __init__ failed early
        if finalizer is not None:
            finalizer()  # the client's shutdown, once

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    # -- internals -----------------------------------------------------------------

    def _process(self, prompt: PromptType, params: SamplingParams, priority: int,
                 lora_request: LoRARequest | None = None) -> ProcessedRequest:
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be SamplingParams, got "
                            f"{type(params).__name__}")
        # Only finished outputs are needed here: skip building per-step outputs.
        return self.input_processor.process_inputs(
            str(next(self._request_counter)), prompt, params, priority=priority,
            output_kind=RequestOutputKind.FINAL_ONLY, lora_request=lora_request)

    def _client(self) -> SyncEngineCoreClient:
        """The engine core's client, once what `llm_engine` queued is sent (every call
        reaches the engine through here, so none sees the weights before the queue)."""
        if self.engine_core is None:
            raise RuntimeError("this LLM has been shut down")
        if self._pending_weights:
            self._pending_weights.flush()
        return self.engine_core

    def _utility(self, method: UtilityMethod, *args: Any) -> Any:
        """A utility call, waited for as long as its row says (`no_timeout`)."""
        return self._client().call_utility(method, *args, timeout=utility_timeout(method))

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine_core = self._client()
        results: dict[str, RequestOutput] = {}
        bar = _progress_bar(len(request_ids)) if use_tqdm else None
        start, num_output_tokens = time.perf_counter(), 0
        try:
            while self.output_processor.has_unfinished_requests():
                message = engine_core.get_output()
                num_output_tokens += len(message.token_ids) + sum(
                    len(o.new_token_ids) for o in message.outputs)
                processed = self.output_processor.process_outputs(message)
                if processed.reqs_to_abort:
                    engine_core.abort_requests(processed.reqs_to_abort)
                if processed.errors:
                    request_id, error = next(iter(processed.errors.items()))
                    raise ValueError(f"request {request_id} failed in the engine: {error}")
                for output in processed.request_outputs:
                    results[output.request_id] = output
                if bar is not None:
                    bar.update(len(processed.request_outputs))
                    elapsed = max(time.perf_counter() - start, 1e-9)
                    bar.set_postfix_str(f"{num_output_tokens / elapsed:.1f} tok/s", refresh=False)
        finally:
            if bar is not None:
                bar.close()
            self._abort(engine_core, request_ids)  # interrupted or failed: leave nothing
        return [results[r] for r in request_ids]

    def _abort(self, engine_core: SyncEngineCoreClient, request_ids: list[str]) -> None:
        """Forget what is unfinished of these requests, here and in the engine (the
        client the call started with: shutdown() may have cleared ours since)."""
        unfinished = self.output_processor.abort_requests(request_ids)
        if unfinished and engine_core.dead_error is None:
            engine_core.abort_requests(unfinished)


# vLLM's switch for the engine core's process (its default "1": a process of its own).
MULTIPROCESSING_ENV = "VLLM_ENABLE_V1_MULTIPROCESSING"


def engine_in_own_process(args: EngineArgs, multiprocess: bool | None) -> bool:
    """Where `LLM` runs its engine core: as `multiprocess` says; unset, as
    VLLM_ENABLE_V1_MULTIPROCESSING says ("0": in this process); unset too, in this
    process under an external launcher (the trainer's process holds the model, as in
    vLLM), else in a process of its own."""
    if multiprocess is not None:
        return multiprocess
    env = os.environ.get(MULTIPROCESSING_ENV)
    if env is not None:
        if env not in ("0", "1"):
            raise ValueError(f"{MULTIPROCESSING_ENV} must be 0 or 1, got {env[:40]!r}")
        return env == "1"
    return args.distributed_executor_backend != "external_launcher"


def _engine_signature() -> inspect.Signature:
    """`LLM(model, *, <every EngineArgs field>)`, so help() and IDEs show the options."""
    kind = inspect.Parameter.KEYWORD_ONLY
    own = inspect.signature(LLM.__init__).parameters
    params = [p for name, p in own.items() if name != "kwargs"]
    params += [inspect.Parameter(f.name, kind, default=f.default, annotation=f.type)
               for f in dataclasses.fields(EngineArgs) if f.name != "model"]
    return inspect.Signature(params, return_annotation=None)


LLM.__init__.__signature__ = _engine_signature()  # type: ignore[attr-defined]


def _per_prompt(value: Any, kind: type, name: str, plural: str, prompts: int) -> list[Any]:
    """One `kind` (or None) for every prompt, or a list or tuple with one per prompt."""
    if value is None or isinstance(value, kind):
        return [value] * prompts
    if not isinstance(value, (list, tuple)):
        raise TypeError(f"{name} must be a {kind.__name__} or a list of them, got "
                        f"{type(value).__name__}")
    if len(value) != prompts:
        raise ValueError(f"got {len(value)} {plural} for {prompts} prompts; pass one, or "
                         "one per prompt")
    return list(value)


def _progress_bar(total: int) -> Any:
    from tqdm import tqdm

    return tqdm(total=total, desc="Processed prompts", unit="req", dynamic_ncols=True)
