"""The reasoning parsers a server can name (`--reasoning-parser`), and the tags that
delimit a model's reasoning. One table for both sides: the frontend splits reasoning
from content with it, and the engine core holds back a request's grammar until the end
tag has been generated (vLLM's `enable_in_reasoning=False`: the constraint applies to the
answer, not the thinking)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

# name -> (start tag, end tag), as the model's tokenizer spells them: one token each for
# the think tags (Seed-OSS's too); a token sequence each for gpt-oss's Harmony, where
# the reasoning is the analysis messages of an assistant turn and the answer starts
# with its final message (the turn's start is the "start tag": a prompt whose last turn
# reached `final` is past its reasoning, one that opens a new turn is not). The engine
# core matches the ids the tokenizer encodes them to.
REASONING_TAGS: dict[str, tuple[str, str]] = {
    "qwen3": ("<think>", "</think>"),
    "deepseek_r1": ("<think>", "</think>"),
    "glm45": ("<think>", "</think>"),
    "openai_gptoss": ("<|start|>assistant", "<|channel|>final<|message|>"),
    "seed_oss": ("<seed:think>", "</seed:think>"),
    "minimax_m2": ("<think>", "</think>"),
    "minimax_m2_append_think": ("<think>", "</think>"),
    "ernie45": ("<think>", "</think>"),
}


# model_type -> (the reasoning parser a model's family always needs, a special token its
# tokenizer has when it writes that format), used when none is set (vLLM sets
# openai_gptoss for gpt-oss the same way): gpt-oss always reasons first, so a grammar
# must wait for its final message.
MODEL_REASONING_PARSERS: dict[str, tuple[str, str]] = {
    "gpt_oss": ("openai_gptoss", "<|channel|>")}


def effective_reasoning_parser(configured: str | None, model_type: str | None,
                               tokenizer_path: str | None) -> str | None:
    """The reasoning parser in effect: the one configured, else the model family's
    where the tokenizer has the format's special token (a gpt_oss model with some other
    tokenizer, a test model's, does not write Harmony); None without a tokenizer."""
    if configured or tokenizer_path is None:
        return configured
    parser, token = MODEL_REASONING_PARSERS.get(model_type or "", (None, ""))
    return parser if parser is not None and _has_special_token(tokenizer_path, token) \
        else None


def _has_special_token(tokenizer_path: str, token: str) -> bool:
    """Whether the tokenizer's files declare `token` a special token:
    tokenizer_config.json's added_tokens_decoder (transformers 4 writes it) or
    extra_special_tokens / additional_special_tokens (transformers 5), else
    tokenizer.json's added_tokens; False where neither can be read."""
    path = Path(tokenizer_path)
    try:
        config = json.loads((path / "tokenizer_config.json").read_text())
        listed = [*(config.get("extra_special_tokens") or ()),
                  *(config.get("additional_special_tokens") or ())]
        if token in listed or _special_entry(
                (config.get("added_tokens_decoder") or {}).values(), token):
            return True
        added = json.loads((path / "tokenizer.json").read_text()).get("added_tokens") or ()
        return _special_entry(added, token)
    except (OSError, ValueError, AttributeError, TypeError):
        return False


def _special_entry(entries: Any, token: str) -> bool:
    return any(isinstance(entry, dict) and entry.get("content") == token
               and entry.get("special") for entry in entries)


def check_reasoning_parser(name: str | None) -> None:
    """None, or a parser named in REASONING_TAGS (ValueError naming the choices)."""
    if name is not None and name not in REASONING_TAGS:
        raise ValueError(f"reasoning_parser must be one of {sorted(REASONING_TAGS)}, "
                         f"got {name!r}")
