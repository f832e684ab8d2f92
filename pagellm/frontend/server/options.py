"""The HTTP server's own options (no FastAPI here: the CLI builds them before the
`serve` extra is known to be installed)."""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

MAX_BODY_BYTES = 16 * 2**20
# /health answers 503 while the engine core's loop has been inside one step or control
# call for longer (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S, 60 s, is the same bound).
ENGINE_STALL_TIMEOUT_S = 60.0
# Token entries one request's response may hold: n x max_tokens x (1 + logprobs), plus
# prompt tokens x (1 + prompt_logprobs). Each is ~0.5 KB of Python objects while the
# response is built (~80 bytes of JSON): 2**21 entries is about a gigabyte, where the
# defaults let one request ask for 10-42 million.
MAX_RESPONSE_ENTRIES = 2**21
# vLLM's switch for its dev endpoints; here it turns on --enable-dev-endpoints, so that
# launch lines written for vLLM (TRL's `VLLM_SERVER_DEV_MODE=1 vllm serve ...`) work.
DEV_MODE_ENV = "VLLM_SERVER_DEV_MODE"


@dataclass(frozen=True)
class ServerOptions:
    """What `pagellm serve` decides about the HTTP layer."""

    served_model_name: str
    api_key: str | None = None  # guards every route but /health, /metrics, /version
    max_body_bytes: int = MAX_BODY_BYTES
    trust_request_chat_template: bool = False  # requests may bring a chat template
    enable_dev_endpoints: bool = False  # the RL control routes (dev_routes.py)
    chat_template: str | None = None  # replaces the tokenizer's own (--chat-template)
    engine_stall_timeout_s: float = ENGINE_STALL_TIMEOUT_S  # /health: 503 past this
    max_response_entries: int = MAX_RESPONSE_ENTRIES  # a larger request is a 400
    enable_auto_tool_choice: bool = False  # tool_choice "auto" (needs tool_call_parser)
    tool_call_parser: str | None = None  # finds "auto" calls in the text (tool_parsers/)
    # --lora-modules: (name, path, base_model_name) served from the start (lora_modules.py)
    lora_modules: tuple[tuple[str, str, str | None], ...] = ()
    # /v1/load_lora_adapter and /v1/unload_lora_adapter (VLLM_ALLOW_RUNTIME_LORA_UPDATING)
    allow_runtime_lora_updating: bool = False


def dev_mode_from_env(environ: Mapping[str, str]) -> bool:
    """VLLM_SERVER_DEV_MODE as vLLM reads it (`bool(int(value))`: an integer, on unless
    zero; unset is off). Where vLLM would crash on a value that is no integer ("true",
    ""), this names the variable instead."""
    value = environ.get(DEV_MODE_ENV)
    if value is None:
        return False
    digits = re.fullmatch(r"\s*[+-]?([0-9]+)\s*", value, re.ASCII)
    if digits is None:
        raise ValueError(f"{DEV_MODE_ENV} must be an integer, as vLLM reads it (1: serve "
                         f"the dev endpoints, like --enable-dev-endpoints; 0: not), got "
                         f"{value[:40]!r}")
    return digits.group(1).strip("0") != ""  # no int(): 5000 digits are still a number
