"""`OpenAIServingCompletion`: POST /v1/completions over the shared `OpenAIServing`.

What is the completions API's own: a body of one or many prompts (text or token ids),
echo (the prompt's text and logprobs before each completion), score-only requests, and
choices numbered across prompts (prompt i's n completions are i*n .. i*n + n - 1), in
one response or as server-sent events.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from pagellm.frontend.input_processor import ProcessedRequest
from pagellm.frontend.outputs import CompletionOutput, PositionLogprobs, RequestOutput
from pagellm.frontend.server.api_models import CompletionRequest
from pagellm.frontend.server.edge import bad_request
from pagellm.frontend.server.formatting import (
    completion_logprobs,
    echo_pieces,
    prompt_logprobs_json,
    token_pieces,
    usage,
)
from pagellm.frontend.server.serving import OpenAIServing


class OpenAIServingCompletion(OpenAIServing):
    """The /v1/completions handler."""

    async def completions(self, body: CompletionRequest) -> Any:
        lora = self.check_model(body.model)
        try:
            body.check_supported()
            prompts = body.prompts()
            prompt_logprobs = body.prompt_logprobs
            if prompt_logprobs is None and body.echo:
                prompt_logprobs = body.logprobs  # echoed tokens carry their logprobs
            params = body.sampling_params(1 if body.score_only else body.max_tokens,
                                          body.logprobs, prompt_logprobs,
                                          self.engine.default_sampling_fields,
                                          body.structured_outputs_params())
        except (ValueError, TypeError) as e:
            raise bad_request(str(e)) from None
        texts = [p if isinstance(p, str) else None for p in prompts]
        request_id = f"cmpl-{uuid.uuid4().hex}"
        processed = await self._process(prompts, params, request_id, body.priority,
                                        body.cache_salt, body.add_special_tokens, lora)
        created = int(time.time())
        header = {"id": request_id, "object": "text_completion", "created": created,
                  "model": self.name if lora is None else lora.lora_name}
        if body.stream:
            return self._stream_completions(processed, header, body)
        finals: dict[int, RequestOutput] = {}
        async for i, output in self._run_all(processed):
            finals[i] = output
        choices = []
        for i in range(len(processed)):
            out = finals[i]
            if texts[i] is not None and out.prompt is None:
                out.prompt = texts[i]  # tokenized here (add_special_tokens=false)
            choices += await self.engine.run_in_tokenizer_thread(
                self._completion_choices, out, i, body)
        completion = 0 if body.score_only else \
            sum(len(c.token_ids) for o in finals.values() for c in o.outputs)
        return {**header, "choices": choices, "usage": usage(processed, completion)}

    def _completion_choices(self, out: RequestOutput, i: int, body: CompletionRequest
                            ) -> list[dict[str, Any]]:
        """The choices of prompt `i` (on the tokenizer thread: echoed prompts and
        logprob texts are detokenized here)."""
        tokenizer = self.engine.tokenizer
        echo_text = ""
        echo_tokens: list[tuple[int, PositionLogprobs | None, str]] = []
        if body.echo:
            echo_text, pieces = echo_pieces(tokenizer, out.prompt_token_ids, out.prompt)
            echo_tokens = list(zip(out.prompt_token_ids, out.prompt_logprobs or
                                   [None] * len(pieces), pieces, strict=True))
        choices = []
        for c in out.outputs:
            logprobs = None
            if body.logprobs is not None:
                generated: list[tuple[int, PositionLogprobs | None, str]] = \
                    [] if body.score_only else list(zip(
                    c.token_ids, c.logprobs or [], token_pieces(
                        tokenizer, c.token_ids, out.prompt_token_ids,
                        body.skip_special_tokens), strict=False))
                logprobs = completion_logprobs(echo_tokens + generated,
                                               body.return_tokens_as_token_ids)
            choices.append({
                "index": i * body.n + c.index,
                "text": echo_text + ("" if body.score_only else c.text),
                "logprobs": logprobs, "finish_reason": c.finish_reason,
                "stop_reason": None if body.score_only else c.stop_reason,
                "prompt_logprobs": prompt_logprobs_json(out.prompt_logprobs)
                if body.prompt_logprobs is not None else None,
                **self._token_ids(body, out.prompt_token_ids,
                                  [] if body.score_only else c.token_ids)})
        return choices

    @staticmethod
    def _token_ids(body: Any, prompt_ids: list[int] | None, ids: list[int]
                   ) -> dict[str, list[int] | None]:
        """vLLM's return_token_ids fields (None when not asked for, as vLLM sends)."""
        if not body.return_token_ids:
            return {"prompt_token_ids": None, "token_ids": None}
        return {"prompt_token_ids": prompt_ids, "token_ids": list(ids)}

    def _stream_completions(self, processed: list[ProcessedRequest], header: dict[str, Any],
                            body: CompletionRequest) -> AsyncIterator[str]:
        started: set[tuple[int, int]] = set()

        def chunks(i: int, out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
            logprobs = None
            if body.logprobs is not None:
                logprobs = completion_logprobs(
                    [(t, e, e[t].decoded_token or "") for t, e in
                     zip(c.token_ids, c.logprobs or [], strict=False)],
                    body.return_tokens_as_token_ids)
            first = (i, c.index) not in started
            started.add((i, c.index))
            choice = {"index": i * body.n + c.index, "text": c.text, "logprobs": logprobs,
                      "finish_reason": c.finish_reason, "stop_reason": c.stop_reason,
                      **self._token_ids(body, out.prompt_token_ids, c.token_ids)}
            if body.return_token_ids and not first:
                choice["prompt_token_ids"] = None  # the first chunk carries them
            return [{"choices": [choice]}]

        return self._events(processed, header, body, chunks)
