"""Logprobs, token texts and usage in the shapes OpenAI's and vLLM's clients read.

Token texts for the legacy completions `logprobs` come from incremental detokenization,
not from decoding each token alone: a byte-level tokenizer splits characters over
tokens, and `decode([id])` of half a character is U+FFFD. With the pieces the
detokenizer emits, the tokens concatenate to the text and every `text_offset` is a
character offset into it: text[offset:offset + len(token)] == token.
"""

from __future__ import annotations

import math
from typing import Any

from pagellm.frontend.detokenizer import IncrementalDetokenizer
from pagellm.frontend.input_processor import ProcessedRequest
from pagellm.frontend.outputs import PositionLogprobs


def token_pieces(tokenizer: Any | None, token_ids: list[int], context: list[int],
                 skip_special_tokens: bool) -> list[str]:
    """The text each token adds after `context` (what a stream would print): empty for
    a token that ends mid-character, whose text arrives with the next one."""
    if tokenizer is None:
        return [""] * len(token_ids)
    detokenizer = IncrementalDetokenizer(tokenizer, context, skip_special_tokens)
    pieces = [detokenizer.update([t]) for t in token_ids]
    tail = detokenizer.flush()
    if pieces and tail:
        pieces[-1] += tail
    return pieces


def echo_pieces(tokenizer: Any | None, prompt_ids: list[int], prompt: str | None
                ) -> tuple[str, list[str]]:
    """(the echoed prompt text, each prompt token's piece of it). The prompt as sent
    when its tokens detokenize back to it (special tokens kept, then skipped: a BOS the
    tokenizer added is not in the text); else (a tokenizer that normalizes) the
    detokenized prompt, so that offsets still point into the returned text."""
    pieces: list[str] = []
    for skip in (False, True):
        pieces = token_pieces(tokenizer, prompt_ids, [], skip)
        if prompt is None or "".join(pieces) == prompt:
            break
    return "".join(pieces), pieces


# What a logprob that is not a finite number reads as in JSON, vLLM's value: -inf (a
# token masked out, e.g. in processed mode) or NaN (a model gone numerically wrong) have
# no JSON spelling, and a finished request answered 500 ("Out of range float values are
# not JSON compliant") after its whole generation.
NON_FINITE_LOGPROB = -9999.0


def json_logprob(value: float) -> float:
    """`value` as a response may carry it: NON_FINITE_LOGPROB unless finite."""
    return value if math.isfinite(value) else NON_FINITE_LOGPROB


def token_label(token_id: int, text: str | None, as_id: bool) -> str:
    """How a token is named in logprobs: its text, or vLLM's "token_id:N" (for clients
    that need ids: texts of different tokens can be equal)."""
    return f"token_id:{token_id}" if as_id else (text or "")


def completion_logprobs(positions: list[tuple[int, PositionLogprobs | None, str]],
                        as_ids: bool) -> dict[str, Any]:
    """OpenAI's legacy shape from (token id, its logprobs or None, its piece of the
    text) per token: tokens, token_logprobs, top_logprobs and text_offset."""
    tokens, token_logprobs, top, offsets, offset = [], [], [], [], 0
    for token_id, entry, piece in positions:
        chosen = entry.get(token_id) if entry else None
        tokens.append(f"token_id:{token_id}" if as_ids else piece)
        token_logprobs.append(json_logprob(chosen.logprob) if chosen else None)
        top.append({token_label(t, lp.decoded_token, as_ids): json_logprob(lp.logprob)
                    for t, lp in entry.items()} if entry else None)
        offsets.append(offset)
        offset += len(piece)
    return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": top,
            "text_offset": offsets}


def chat_logprobs(token_ids: list[int], logprobs: list[PositionLogprobs] | None, top: int,
                  as_ids: bool) -> dict[str, Any]:
    """Chat's shape: per token its text, logprob, UTF-8 bytes and the `top` best."""
    content = []
    for token_id, entry in zip(token_ids, logprobs or [], strict=False):
        chosen = entry[token_id]
        ranked = sorted(entry.items(), key=lambda item: item[1].rank)[:top]
        token = token_label(token_id, chosen.decoded_token, as_ids)
        content.append({
            "token": token, "logprob": json_logprob(chosen.logprob),
            "bytes": list(token.encode()),
            "top_logprobs": [{"token": (label := token_label(t, lp.decoded_token, as_ids)),
                              "logprob": json_logprob(lp.logprob),
                              "bytes": list(label.encode())}
                             for t, lp in ranked]})
    return {"content": content}


def prompt_logprobs_json(prompt_logprobs: list[PositionLogprobs | None] | None
                         ) -> list[dict[str, dict[str, Any]] | None] | None:
    """vLLM's `prompt_logprobs`: None for the first prompt token (nothing precedes it),
    then per token {token id: {logprob, rank, decoded_token}} for the actual token and
    the top alternatives."""
    if prompt_logprobs is None:
        return None
    return [None if entry is None else
            {str(t): {"logprob": json_logprob(lp.logprob), "rank": lp.rank,
                      "decoded_token": lp.decoded_token} for t, lp in entry.items()}
            for entry in prompt_logprobs]


def usage(processed: list[ProcessedRequest], completion: int) -> dict[str, int]:
    prompt = sum(len(p.prompt_token_ids) for p in processed)
    return {"prompt_tokens": prompt, "completion_tokens": completion,
            "total_tokens": prompt + completion}


def tokenizer_config(tokenizer: Any, max_model_len: int) -> dict[str, Any]:
    """vLLM's /tokenizer_info: the tokenizer's init kwargs (file paths removed), its
    class and chat template, and the special tokens as strings."""
    config = {k: v for k, v in (getattr(tokenizer, "init_kwargs", None) or {}).items()
              if not k.endswith("_file")}
    for name in ("bos_token", "eos_token", "pad_token", "unk_token"):
        config[name] = getattr(tokenizer, name, None)
    config["model_max_length"] = min(getattr(tokenizer, "model_max_length", max_model_len),
                                     max_model_len)
    config["tokenizer_class"] = type(tokenizer).__name__
    config["chat_template"] = getattr(tokenizer, "chat_template", None)
    return _jsonable(config)


def _jsonable(value: Any) -> Any:
    """Plain JSON values; anything else (AddedToken, ...) as its str()."""
    if value is None or isinstance(value, bool | int | float | str):
        return value
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    return str(value)
