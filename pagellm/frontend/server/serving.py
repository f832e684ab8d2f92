"""`OpenAIServing`: what the OpenAI handlers share, over `AsyncLLM`.

The completions (serving_completions.py) and chat (serving_chat.py) handlers differ in
how they read a body and shape a response; everything between is here, once: checks
only the server can make (the model's name, prompt sizes against max_model_len, the
response's size), chat prompts (templates on the tokenizer thread, never on the event
loop; templates sent by clients in a killable sandbox process), handing prompts to the
input processor, merging the prompts' output streams, and server-sent events. The
/tokenize and /tokenizer_info routes use it directly.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import msgspec

from pagellm.frontend.async_llm import AsyncLLM
from pagellm.frontend.engine_client.core_client import EngineDeadError
from pagellm.frontend.input_processor import ProcessedRequest, child_request_id
from pagellm.frontend.output_processor import EngineUnavailableError
from pagellm.frontend.outputs import CompletionOutput, RequestOutput
from pagellm.frontend.server.api_models import (
    ChatCompletionRequest,
    CompletionRequest,
    TokenizeRequest,
)
from pagellm.frontend.server.edge import APIError, bad_request
from pagellm.frontend.server.formatting import tokenizer_config, usage
from pagellm.frontend.server.lora_modules import LoRAModules
from pagellm.frontend.server.metrics import ServerMetrics
from pagellm.frontend.server.options import ServerOptions
from pagellm.frontend.server.template_sandbox import ChatTemplateSandbox, TemplateTimeout
from pagellm.protocol.lora import LoRARequest

logger = logging.getLogger("pagellm")

# Messages of one chat: far beyond any conversation a context window holds, and
# checked before the per-message work on the event loop (1.2M empty messages held the
# loop for 2 s).
MAX_MESSAGES = 2**16



def _json_chars(value: Any) -> int:
    """Characters (not UTF-8 bytes: the limit is in characters) of `value` as JSON."""
    return 0 if value is None else len(msgspec.json.encode(value).decode())


def _template_chars(message: dict[str, Any]) -> int:
    """The characters of one template message a template may render."""
    return (len(message["role"]) + len(message["content"]) + len(message.get("name") or "")
            + len(message.get("tool_call_id") or "") + _json_chars(message.get("tool_calls")))

class OpenAIServing:
    """Request handling shared by the routes; the completions and chat handlers are its
    subclasses."""

    def __init__(self, engine: AsyncLLM, options: ServerOptions, metrics: ServerMetrics,
                 sandbox: ChatTemplateSandbox | None, loras: LoRAModules | None = None) -> None:
        """`loras`: the adapters served by name (shared by the routes; none: only the
        base model)."""
        if options.trust_request_chat_template and sandbox is None:
            raise ValueError("trust_request_chat_template needs a ChatTemplateSandbox")
        self.engine = engine
        self.options = options
        self.name = options.served_model_name
        self.loras = loras or LoRAModules(self.name)
        self.metrics = metrics
        self.sandbox = sandbox
        # chat_template_kwargs are template variables: names that are parameters of
        # apply_chat_template (tokenize, return_tensors, ...) would change what it does.
        self.reserved_kwargs: frozenset[str] = frozenset()
        if engine.tokenizer is not None:
            parameters = inspect.signature(engine.tokenizer.apply_chat_template).parameters
            self.reserved_kwargs = frozenset(
                name for name, p in parameters.items()
                if p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL))

    def tokenizer(self) -> Any:
        if self.engine.tokenizer is None:
            raise bad_request("this server was started with --skip-tokenizer-init")
        return self.engine.tokenizer

    def check_model(self, model: str | None) -> LoRARequest | None:
        """The LoRA adapter `model` names (None: the base model); 404 for a name this
        server does not serve."""
        try:
            return self.loras.resolve(model)
        except KeyError:
            served = ", ".join(f"`{n}`" for n in [self.name, *self.loras.served][:8])
            raise APIError(404, f"The model `{model}` does not exist (this server serves "
                                f"{served}).", "NotFoundError", "model") from None

    def check_prompt_chars(self, name: str, chars: int) -> None:
        """Refuse text that cannot fit in max_model_len tokens before tokenizing it."""
        limit = self.engine.input_processor.max_prompt_chars
        if chars > limit:
            raise bad_request(f"{name} is {chars} characters: more than max_model_len="
                              f"{self.engine.info.max_model_len} tokens can hold ({limit} "
                              "characters at most)")

    def tokenizer_info(self) -> dict[str, Any]:
        return tokenizer_config(self.tokenizer(), self.engine.info.max_model_len)

    async def tokenize(self, body: TokenizeRequest) -> list[int]:
        tokenizer = self.tokenizer()
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("give exactly one of prompt or messages")
        if body.messages is not None:
            if body.continue_final_message and body.add_generation_prompt:
                raise bad_request("continue_final_message and add_generation_prompt cannot "
                                  "both be true (set add_generation_prompt to false)")
            return await self._chat_prompt(body.messages, body.add_generation_prompt, None,
                                           None, body.continue_final_message)
        assert body.prompt is not None
        self.check_prompt_chars("prompt", len(body.prompt))
        ids = await self.engine.run_in_tokenizer_thread(
            tokenizer.encode, body.prompt, add_special_tokens=body.add_special_tokens)
        return list(ids)

    async def _chat_prompt(self, messages: list[Any], add_generation_prompt: bool,
                           kwargs: dict[str, Any] | None, template: str | None,
                           continue_final_message: bool = False,
                           add_special_tokens: bool = False,
                           tools: list[dict[str, Any]] | None = None) -> list[int]:
        """The conversation's prompt ids: the model's chat template on the tokenizer
        thread, or a template from the request in the sandbox (if trusted), rendered to
        text and then tokenized (with the tokenizer's special tokens only if asked: the
        template holds them already). With continue_final_message the text ends where
        the last message's content does (transformers' rule), so the model continues
        that message instead of starting a new one."""
        tokenizer = self.tokenizer()
        if len(messages) > MAX_MESSAGES:  # before the loop below, which runs on the loop
            raise bad_request(f"messages: {len(messages)} messages, more than {MAX_MESSAGES}")
        try:
            conversation = [m.template_message() for m in messages]
        except ValueError as e:
            raise bad_request(str(e)) from None
        # Bounded before rendering (every string the template may render: roles, texts,
        # names, tool calls, tools, variables) and again before tokenizing (what the
        # template made of them): tokenizing runs on the one tokenizer thread that
        # every request shares.
        self.check_prompt_chars("messages", sum(map(_template_chars, conversation))
                                + len(msgspec.json.encode(kwargs or {}))
                                + _json_chars(tools))
        kwargs = dict(kwargs or {})
        if "chat_template" in kwargs:
            template = kwargs.pop("chat_template")
        reserved = sorted(set(kwargs) & self.reserved_kwargs)
        if reserved:
            raise bad_request(f"chat_template_kwargs may only set template variables, not "
                              f"{', '.join(reserved)}")
        if tools is not None:  # the request's own field (kwargs may not set it)
            kwargs["tools"] = tools
        if template is not None and not self.options.trust_request_chat_template:
            raise bad_request("chat templates from requests are refused (start the server "
                              "with --trust-request-chat-template to allow them)")
        try:
            if template is None:
                text = await self.engine.run_in_tokenizer_thread(
                    tokenizer.apply_chat_template, conversation,
                    add_generation_prompt=add_generation_prompt, tokenize=False, **kwargs)
            else:
                if not isinstance(template, str):
                    raise bad_request("chat_template must be a string")
                assert self.sandbox is not None
                text = await asyncio.to_thread(self.sandbox.render, template, conversation,
                                               add_generation_prompt, kwargs)
        except APIError:
            raise
        except TemplateTimeout as e:
            raise bad_request(f"messages: {e}") from None
        except Exception as e:  # a template error is the request's fault
            raise bad_request(f"messages: the chat template failed: {e}") from None
        if continue_final_message:
            final = conversation[-1]["content"].strip()
            end = text.rfind(final) if final else -1
            if end == -1:
                raise bad_request("continue_final_message: the final message's content is "
                                  "not in the rendered chat template")
            text = text[:end + len(final)]
        self.check_prompt_chars("the rendered chat", len(text))
        ids = await self.engine.run_in_tokenizer_thread(
            tokenizer.encode, text, add_special_tokens=add_special_tokens)
        return list(ids)

    async def _process(self, prompts: list[Any], params: Any, request_id: str, priority: int,
                       salt: str | None, add_special_tokens: bool = True,
                       lora_request: LoRARequest | None = None) -> list[ProcessedRequest]:
        """Validate every prompt before any starts (on the tokenizer thread); a bad one
        is a 400, and the ones after it are never tokenized. One HTTP request may not
        ask for more sequences than the engine runs at once. Without add_special_tokens
        (vLLM's flag) text prompts are tokenized here without the tokenizer's special
        tokens."""
        limit = self.engine.info.max_num_seqs
        if len(prompts) * params.n > limit:
            raise bad_request(f"{len(prompts)} prompt(s) x n={params.n} is more sequences "
                              f"than this engine runs at once (max_num_seqs={limit})")
        tokenizer = None if add_special_tokens else self.tokenizer()
        for p in prompts if tokenizer is not None else ():  # (the engine checks the rest)
            if isinstance(p, str):
                self.check_prompt_chars("prompt", len(p))

        def process_all() -> list[ProcessedRequest]:
            processed = []
            for i, prompt in enumerate(prompts):
                if tokenizer is not None and isinstance(prompt, str):
                    prompt = {"prompt_token_ids": tokenizer.encode(
                        prompt, add_special_tokens=False)}
                if salt is not None:
                    prompt = {"prompt": prompt} if isinstance(prompt, str) else dict(prompt)
                    prompt["cache_salt"] = salt
                processed.append(self.engine.process(
                    prompt, params, child_request_id(request_id, i), priority, lora_request))
            return processed

        try:
            processed = await self.engine.run_in_tokenizer_thread(process_all)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        self.check_response_size(processed)
        return processed

    def check_response_size(self, processed: list[ProcessedRequest]) -> None:
        """Refuse, before anything runs, a request whose response could hold more token
        entries than --max-response-entries (`response_entries`): what the server holds
        and encodes for it grows with n x max_tokens x (1 + logprobs), and the defaults
        let one request build gigabytes on the event loop."""
        entries = sum(response_entries(request) for request in processed)
        limit = self.options.max_response_entries
        if entries > limit:
            raise bad_request(
                f"this request's response could hold {entries} token entries (n x max_tokens "
                f"x (1 + logprobs), plus prompt tokens x (1 + prompt_logprobs)), more than "
                f"--max-response-entries={limit}: lower n, max_tokens or logprobs")

    async def _run_all(self, processed: list[ProcessedRequest]
                       ) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Merge the prompts' streams: (prompt index, output) as they come."""
        queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException | None] = \
            asyncio.Queue()

        async def pump(i: int, request: ProcessedRequest) -> None:
            lora = request.engine_requests[0].lora_request
            tracker = self.metrics.tracker(request.params.n,
                                           None if lora is None else lora.lora_name)
            try:
                async for output in self.engine.stream(request):
                    tracker.observe(output)
                    queue.put_nowait((i, output))
            except Exception as e:
                queue.put_nowait(e)
            finally:
                queue.put_nowait(None)

        tasks = [asyncio.ensure_future(pump(i, r)) for i, r in enumerate(processed)]
        remaining = len(tasks)
        try:
            while remaining:
                item = await queue.get()
                if item is None:
                    remaining -= 1
                elif isinstance(item, BaseException):
                    raise item
                else:
                    yield item
        finally:
            for task in tasks:
                task.cancel()

    # -- server-sent events -------------------------------------------------------------

    async def _events(self, processed: list[ProcessedRequest], header: dict[str, Any],
                      body: CompletionRequest | ChatCompletionRequest,
                      chunks: Callable[[int, RequestOutput, CompletionOutput],
                                       list[dict[str, Any]]]) -> AsyncIterator[str]:
        """Server-sent events: every completion update as `chunks` makes it (the
        payloads without the header), with the usage so far in each if asked
        (continuous_usage_stats), the final usage if asked, then [DONE]; the engine
        dying or the request failing mid-stream becomes an error event."""
        completion = 0
        try:
            async for i, out in self._run_all(processed):
                for c in out.outputs:
                    completion += len(c.token_ids)
                    for payload in chunks(i, out, c):
                        if body.continuous_usage:
                            payload["usage"] = usage(processed, completion)
                        yield _sse({**header, **payload})
            if body.include_usage:
                yield _sse({**header, "choices": [], "usage": usage(processed, completion)})
        except EngineDeadError as e:
            yield _sse({"error": {"message": f"the engine core is dead: {e}",
                                  "type": "ServiceUnavailableError", "code": 503}})
        except EngineUnavailableError as e:
            yield _sse({"error": {"message": str(e), "type": "ServiceUnavailableError",
                                  "code": 503}})
        except Exception as e:  # 200 is sent already: the error must be an event
            logger.warning("a stream failed: %s: %s", type(e).__name__, e)
            yield _sse({"error": {"message": f"{type(e).__name__}: {e}",
                                  "type": "InternalServerError", "code": 500}})
        yield "data: [DONE]\n\n"


def response_entries(request: ProcessedRequest) -> int:
    """The most token entries `request`'s outputs can carry: every completion's tokens,
    each with its logprobs, and the prompt's logprobs (engine params are resolved:
    max_tokens set, logprobs=-1 made the vocabulary's size)."""
    entries = 0
    for engine_request in request.engine_requests:
        params = engine_request.sampling_params
        entries += (params.max_tokens or 0) * (1 + (params.logprobs or 0))
        if params.prompt_logprobs is not None:
            entries += len(engine_request.prompt_token_ids) * (1 + params.prompt_logprobs)
    return entries


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {msgspec.json.encode(payload).decode()}\n\n"
