"""OpenAI API request bodies as msgspec Structs, and their translation to
`SamplingParams`.

A wrong type is a 400 whose message names the field (`$.max_tokens`). Unknown fields
are accepted and named once in the log (extra_fields.py), as vLLM does, so clients
written for other servers work unchanged. Fields of OpenAI's API that change nothing
here (user, service_tier, store, metadata) are accepted and ignored. Features we do not
serve, where ignoring them would silently change the results a client asked for, are
refused by name, on every route: tools on /v1/completions, functions, suffix,
best_of other than n, beam search, logits processors, and chat's echo and documents.
Every field that constrains the output (structured_outputs, response_format, the
deprecated guided_* fields, tools and tool_choice) is read: none can take the
unknown-field path. A chat history's names, tool calls
and tool results reach the chat template as vLLM passes them. vLLM's extra sampling
and output fields are served (prompt_logprobs, return_token_ids,
return_tokens_as_token_ids, add_special_tokens, continue_final_message,
continuous_usage_stats).
"""

from __future__ import annotations

import logging
import re
from typing import Any, Literal

import msgspec

from pagellm.frontend.chat_utils import template_reasoning, template_tool_call
from pagellm.protocol.sampling_params import (
    MAX_TOKEN_IDS,
    RequestOutputKind,
    SamplingParams,
    StructuredOutputsParams,
)

logger = logging.getLogger("pagellm")


def _params_from(field: str, values: dict[str, Any]) -> StructuredOutputsParams:
    """StructuredOutputsParams from a request's dict, an unknown key named."""
    unknown = sorted(set(values) - set(StructuredOutputsParams.__struct_fields__))
    if unknown:
        raise ValueError(f"{field}: unknown field(s) {', '.join(map(str, unknown))[:200]}")
    try:
        return msgspec.convert(values, StructuredOutputsParams, strict=True)
    except msgspec.ValidationError as e:
        raise ValueError(f"{field}: {e}") from None


def _response_format_params(response_format: dict[str, Any] | None
                            ) -> StructuredOutputsParams | None:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema
    (`{"json_schema": {"name": ..., "schema": {...}, "strict": ...}}`)."""
    if response_format is None:
        return None
    kind = response_format.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True)
    if kind == "json_schema":
        spec = response_format.get("json_schema")
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise ValueError("response_format.json_schema.schema must be a JSON schema "
                             "(an object)")
        return StructuredOutputsParams(json=schema)
    raise ValueError(f"response_format.type must be 'text', 'json_object' or "
                     f"'json_schema', got {kind!r}")


class StreamOptions(msgspec.Struct):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: usage in every chunk


# Fields (vLLM's or OpenAI's) for features not served here: ignoring them would change
# what the client gets without telling it, so any value but the default is a 400.
# A logit_bias key: a token id in decimal (at most int64's digits; the range is checked
# by SamplingParams, naming the field).
_TOKEN_ID_KEY = re.compile(r"-?[0-9]{1,19}")

UNSERVED_FIELDS = {
    "use_beam_search": "beam search",
    "logits_processors": "logits processors", "suffix": "suffix",
    "functions": "function calling", "function_call": "function calling",
    "documents": "documents in chat templates"}


class _SamplingFields(msgspec.Struct, kw_only=True):
    """What both endpoints share: OpenAI's fields and vLLM's extras."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Accepted for compatibility; they change nothing here.
    service_tier: str | None = None
    store: bool | None = None
    metadata: dict[str, str] | None = None
    # vLLM's extra sampling fields.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    ignore_eos: bool = False
    min_tokens: int = 0
    stop_token_ids: list[int] | None = None
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None
    priority: int = 0
    cache_salt: str | None = None
    # vLLM's output fields.
    prompt_logprobs: int | None = None
    return_token_ids: bool = False  # prompt_token_ids and token_ids on the choice
    return_tokens_as_token_ids: bool = False  # logprob tokens as "token_id:N"
    # Structured outputs (vLLM's field, OpenAI's response_format, and vLLM's removed
    # guided_* fields, translated with a warning: never dropped).
    structured_outputs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    # Refused unless default (UNSERVED_FIELDS).
    use_beam_search: bool = False
    logits_processors: list[Any] | None = None

    def check_served(self) -> None:
        """A field asking for a feature not served here is a 400 naming it."""
        for name, feature in UNSERVED_FIELDS.items():
            if getattr(self, name, None) not in (None, False):
                raise ValueError(f"{name}: {feature} is not supported by this server")
        if self.stream and self.prompt_logprobs is not None:
            raise ValueError("prompt_logprobs is not available with stream=true")

    def structured_outputs_params(self) -> StructuredOutputsParams | None:
        """The request's one output constraint, from whichever field gave it:
        `structured_outputs`, `response_format` (json_object, json_schema) or the
        deprecated guided_* fields. Two of them at once is a 400."""
        given: list[tuple[str, StructuredOutputsParams]] = []
        if self.structured_outputs is not None:
            given.append(("structured_outputs", _params_from(
                "structured_outputs", self.structured_outputs)))
        guided = {name: getattr(self, f"guided_{name}")
                  for name in ("json", "regex", "choice", "grammar")
                  if getattr(self, f"guided_{name}") is not None}
        if guided:
            fields = ", ".join(f"guided_{name}" for name in guided)
            # The names in the template: rate-limited per combination (15 at most).
            logger.warning(f"{fields}: deprecated (removed from vLLM in 0.12); served as "
                           "structured_outputs")
            given.append((fields, _params_from("guided_*", guided)))
        response_format = _response_format_params(self.response_format)
        if response_format is not None:
            given.append(("response_format", response_format))
        if len(given) > 1:
            raise ValueError(f"give one output constraint, not {len(given)}: "
                             f"{', '.join(name for name, _ in given)}")
        return given[0][1] if given else None

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        prompt_logprobs: int | None = None,
                        defaults: dict[str, Any] | None = None,
                        structured_outputs: StructuredOutputsParams | None = None
                        ) -> SamplingParams:
        """`defaults`: the model's (generation_config), for the sampling fields this
        request leaves unset; beyond them OpenAI's (temperature 1, top_p 1), not
        greedy. (The model's max_new_tokens caps an unset max_tokens in the
        InputProcessor, which knows the room the prompt leaves.)"""
        bias = None
        if self.logit_bias is not None:
            if len(self.logit_bias) > MAX_TOKEN_IDS:  # before the loop: it runs on the
                raise ValueError(f"logit_bias has {len(self.logit_bias)} entries, "  # loop
                                 f"more than {MAX_TOKEN_IDS}")
            bias = {}
            for key, bias_value in self.logit_bias.items():
                if not _TOKEN_ID_KEY.fullmatch(key):  # ASCII: str.isdigit takes "²"
                    raise ValueError(f"logit_bias keys must be token ids (decimal "
                                     f"integers), got {key[:24]!r}")
                bias[int(key)] = bias_value
        extra: dict[str, Any] = {}
        for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty"):
            value: Any = getattr(self, name)
            if value is None and defaults is not None:
                value = defaults.get(name)
            if value is not None:
                extra[name] = value
        return SamplingParams(
            n=self.n, max_tokens=max_tokens,
            stop=[self.stop] if isinstance(self.stop, str) else self.stop, seed=self.seed,
            presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
            logit_bias=bias, ignore_eos=self.ignore_eos, min_tokens=self.min_tokens,
            stop_token_ids=self.stop_token_ids, skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            include_stop_str_in_output=self.include_stop_str_in_output,
            allowed_token_ids=self.allowed_token_ids, bad_words=self.bad_words,
            truncate_prompt_tokens=self.truncate_prompt_tokens, logprobs=logprobs,
            prompt_logprobs=prompt_logprobs, structured_outputs=structured_outputs,
            output_kind=RequestOutputKind.DELTA if self.stream
            else RequestOutputKind.FINAL_ONLY, **extra)

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def continuous_usage(self) -> bool:
        """Usage in every streamed chunk (vLLM: needs include_usage too)."""
        return self.include_usage and self.stream_options is not None and \
            self.stream_options.continuous_usage_stats


class CompletionRequest(_SamplingFields, kw_only=True):
    # A string, strings, token ids, or lists of token ids (msgspec takes one list type
    # in a union: the item kinds are checked in prompts()).
    prompt: str | list[str | int | list[int]]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None
    add_special_tokens: bool = True  # vLLM's: the tokenizer's BOS etc. on text prompts
    # Named here so they never take the unknown-field path (a 200 with free text would
    # be silently wrong); refused in check_supported.
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None

    def prompts(self) -> list[str | dict[str, Any]]:
        """Each prompt as the InputProcessor takes it (text, or token ids)."""
        prompt = self.prompt
        if isinstance(prompt, str):
            return [prompt]
        if not prompt:
            raise ValueError("prompt must not be empty")
        if all(isinstance(p, int) for p in prompt):
            return [{"prompt_token_ids": list(prompt)}]  # one prompt of token ids
        if all(isinstance(p, str) for p in prompt):
            return list(prompt)  # type: ignore[arg-type]
        if all(isinstance(p, list) for p in prompt):
            return [{"prompt_token_ids": p} for p in prompt]
        raise ValueError("prompt must be a string, a list of strings, a list of token ids "
                         "or a list of lists of token ids, not a mix")

    @property
    def score_only(self) -> bool:
        """echo with max_tokens 0 (vLLM's): the prompt and its logprobs, nothing
        generated (the engine generates one token, which is dropped)."""
        return self.echo and self.max_tokens == 0

    def check_supported(self) -> None:
        self.check_served()
        if self.tools or self.tool_choice not in (None, "none"):
            raise ValueError("tools: tool calling is not supported on /v1/completions")
        if self.best_of is not None and self.best_of != self.n:
            raise ValueError("best_of is not supported (it must be absent or equal n)")
        if self.echo and self.stream:
            raise ValueError("echo is not supported with stream")


class ChatMessage(msgspec.Struct):
    role: str
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # the call a tool message answers
    # an assistant's earlier reasoning, as this server returned it (`reasoning` is the
    # name newer vLLM and OpenAI-style clients send)
    reasoning_content: str | None = None
    reasoning: str | None = None

    def template_message(self) -> dict[str, Any]:
        """The message as chat templates read it (vLLM's): role and text, plus name,
        tool_call_id and tool_calls when given, each call's JSON `arguments` parsed
        (templates render them with tojson), and earlier reasoning under the names the
        templates read (chat_utils.template_reasoning)."""
        message: dict[str, Any] = {"role": self.role, "content": self.text()}
        for name, value in (("reasoning_content", self.reasoning_content),
                            ("reasoning", self.reasoning)):
            if value is not None:
                message[name] = value
        if self.name is not None:
            message["name"] = self.name
        if self.tool_call_id is not None:
            message["tool_call_id"] = self.tool_call_id
        if self.tool_calls is not None:
            message["tool_calls"] = [template_tool_call(call) for call in self.tool_calls]
        return template_reasoning(message)

    def text(self) -> str:
        """The message's text; content parts must all be text."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for part in self.content:
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"messages: only text content parts are supported, got "
                                 f"{part.get('type')!r}")
            texts.append(part["text"])
        return "".join(texts)


class ChatCompletionRequest(_SamplingFields, kw_only=True):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # vLLM's: the last message is continued
    add_special_tokens: bool = False  # vLLM's: the template has them already
    echo: bool = False  # vLLM's chat echo: refused (UNSERVED_FIELDS)
    documents: list[dict[str, Any]] | None = None  # refused (UNSERVED_FIELDS)
    functions: list[dict[str, Any]] | None = None  # refused (UNSERVED_FIELDS)
    function_call: str | dict[str, Any] | None = None  # refused (UNSERVED_FIELDS)
    chat_template: str | None = None  # refused unless --trust-request-chat-template
    chat_template_kwargs: dict[str, Any] | None = None
    # OpenAI's: how long a reasoning model thinks; a template variable (gpt-oss's
    # template writes it into the system message), overridden by chat_template_kwargs
    reasoning_effort: Literal["low", "medium", "high"] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool = True

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's extra variables: chat_template_kwargs, and
        reasoning_effort where they do not set it."""
        if self.reasoning_effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": self.reasoning_effort, **(self.chat_template_kwargs or {})}

    def check_supported(self) -> None:
        self.check_served()
        if self.echo:
            raise ValueError("echo: chat echo is not supported by this server")
        if not self.messages:
            raise ValueError("messages must not be empty")
        if self.continue_final_message and self.add_generation_prompt:
            raise ValueError("continue_final_message and add_generation_prompt cannot both "
                             "be true (set add_generation_prompt to false)")
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")

    @property
    def completion_limit(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None \
            else self.max_tokens


class TokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # text prompts only (a chat template has them)
    add_generation_prompt: bool = True
    continue_final_message: bool = False  # as in chat completions


class LoadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    """vLLM's body of /v1/load_lora_adapter."""

    lora_name: str
    lora_path: str
    load_inplace: bool = False  # replace the weights of an adapter served by this name


class UnloadLoRAAdapterRequest(msgspec.Struct, kw_only=True):
    lora_name: str
    lora_int_id: int | None = None  # vLLM's field; the name decides here


class DetokenizeRequest(msgspec.Struct, kw_only=True):
    model: str | None = None
    tokens: list[int]
