"""`OpenAIServingChat`: POST /v1/chat/completions over the shared `OpenAIServing`.

What is the chat API's own: the conversation rendered to one prompt (by the shared
`_chat_prompt`, which /tokenize uses too), the assistant's message as each choice, the
prompt's fields on the response (a chat has one prompt), and in a stream the role sent
first per choice, as OpenAI does.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import msgspec

from pagellm.frontend.input_processor import ProcessedRequest
from pagellm.frontend.outputs import CompletionOutput, RequestOutput
from pagellm.frontend.server.api_models import ChatCompletionRequest
from pagellm.frontend.server.chat_tools import (
    ChoiceStream,
    ToolMode,
    ToolSetup,
    chat_message,
    resolve_tool_mode,
    special_tokens_in_text,
    tool_constraint,
)
from pagellm.frontend.server.edge import bad_request
from pagellm.frontend.server.formatting import chat_logprobs, prompt_logprobs_json, usage
from pagellm.frontend.server.serving import OpenAIServing


class OpenAIServingChat(OpenAIServing):
    """The /v1/chat/completions handler."""

    async def chat(self, body: ChatCompletionRequest) -> Any:
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            top = (body.top_logprobs or 0) if body.logprobs else None
            mode = resolve_tool_mode(body.tools, body.tool_choice, self.tool_setup)
            constraint = body.structured_outputs_params()
            implied = tool_constraint(body.tools, mode, body.parallel_tool_calls)
            if implied is not None and constraint is not None:
                raise ValueError(f'tool_choice "{mode.mode}" constrains the output to tool '
                                 f"calls: it cannot be combined with response_format or "
                                 f"structured_outputs")
            params = body.sampling_params(body.completion_limit, top, body.prompt_logprobs,
                                          self.engine.default_sampling_fields,
                                          implied or constraint)
            if special_tokens_in_text(self.tool_setup, mode):  # the parser reads them
                params = msgspec.structs.replace(params, skip_special_tokens=False)
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        thinking = bool((body.chat_template_kwargs or {}).get("enable_thinking", True))
        prompt_ids = await self._chat_prompt(
            body.messages, body.add_generation_prompt, body.template_kwargs,
            body.chat_template, body.continue_final_message, body.add_special_tokens,
            body.tools)
        request_id = f"chatcmpl-{uuid.uuid4().hex}"
        processed = await self._process([{"prompt_token_ids": prompt_ids}], params,
                                        request_id, body.priority, body.cache_salt,
                                        lora_request=lora)
        header = {"id": request_id, "object": "chat.completion", "created": int(time.time()),
                  "model": self.name if lora is None else lora.lora_name}
        if body.stream:
            return self._stream_chat(processed, header, body, mode, thinking)
        final = None
        async for _, out in self._run_all(processed):
            final = out
        assert final is not None
        # Off the event loop: up to --max-response-entries logprob entries to build.
        choices = await asyncio.to_thread(self._chat_choices, final, body, mode, thinking)
        completion = sum(len(c.token_ids) for c in final.outputs)
        # vLLM puts the prompt's fields on the response: a chat has one prompt.
        return {**header, "choices": choices, "usage": usage(processed, completion),
                "prompt_logprobs": prompt_logprobs_json(final.prompt_logprobs),
                "prompt_token_ids": final.prompt_token_ids if body.return_token_ids
                else None}

    @property
    def tool_setup(self) -> ToolSetup:
        return ToolSetup(self.options.enable_auto_tool_choice, self.options.tool_call_parser,
                         self.engine.info.reasoning_parser)

    def _chat_choices(self, final: RequestOutput, body: ChatCompletionRequest,
                      mode: ToolMode, thinking: bool) -> list[dict[str, Any]]:
        choices = []
        for c in final.outputs:
            message, finish_reason = chat_message(c.text, c.finish_reason, mode,
                                                  self.tool_setup, thinking)
            choices.append({
                "index": c.index, "message": message,
                "logprobs": chat_logprobs(c.token_ids, c.logprobs, body.top_logprobs or 0,
                                          body.return_tokens_as_token_ids)
                if body.logprobs else None,
                "finish_reason": finish_reason, "stop_reason": c.stop_reason,
                "token_ids": list(c.token_ids) if body.return_token_ids else None})
        return choices

    def _stream_chat(self, processed: list[ProcessedRequest], header: dict[str, Any],
                     body: ChatCompletionRequest, mode: ToolMode, thinking: bool
                     ) -> AsyncIterator[str]:
        started: set[int] = set()
        streams: dict[int, ChoiceStream] = {}
        setup = self.tool_setup

        def chunks(_: int, out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
            payloads = []
            if c.index not in started:  # the role first, as OpenAI does
                started.add(c.index)
                first: dict[str, Any] = {"choices": [{
                    "index": c.index, "delta": {"role": "assistant", "content": ""},
                    "logprobs": None, "finish_reason": None}]}
                if body.return_token_ids:
                    first["prompt_token_ids"] = out.prompt_token_ids
                payloads.append(first)
            stream = streams.get(c.index)
            if stream is None:
                stream = streams[c.index] = ChoiceStream(mode, setup, thinking)
            deltas = stream.feed(c.text)
            if c.finish_reason is not None:
                deltas += stream.finish()
            # One chunk per delta; the last carries this update's logprobs, token ids
            # and finish reason (a delta-less update still sends one chunk).
            deltas = deltas or [{}]
            for delta in deltas[:-1]:
                payloads.append({"choices": [{"index": c.index, "delta": delta,
                                              "logprobs": None, "finish_reason": None}]})
            choice = {"index": c.index, "delta": deltas[-1],
                      "logprobs": chat_logprobs(c.token_ids, c.logprobs,
                                                body.top_logprobs or 0,
                                                body.return_tokens_as_token_ids)
                      if body.logprobs else None,
                      "finish_reason": stream.finish_reason(c.finish_reason),
                      "stop_reason": c.stop_reason}
            if body.return_token_ids:
                choice["token_ids"] = list(c.token_ids)
            payloads.append({"choices": [choice]})
            return payloads

        return self._events(processed, {**header, "object": "chat.completion.chunk"},
                            body, chunks)
