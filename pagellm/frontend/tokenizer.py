"""Tokenizer loading, and the generation defaults that travel with a model."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from pagellm.protocol.engine_args import EngineArgs
from pagellm.protocol.validation import load_model_config


def load_tokenizer(path: str) -> Any:
    """A transformers tokenizer from a local directory, with a clear error if absent."""
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer directory not found: {path}")
    if (directory / "config.json").is_file():  # transformers reads it too
        load_model_config(directory)
    try:
        return AutoTokenizer.from_pretrained(directory)
    except (OSError, ValueError, TypeError, ArithmeticError) as e:
        raise ValueError(f"could not load a tokenizer from {path}: {e}") from e


def tokenizer_for(args: EngineArgs) -> Any:
    """The frontend's tokenizer (`tokenizer`, else the model's), None with
    skip_tokenizer_init."""
    return None if args.skip_tokenizer_init else load_tokenizer(args.tokenizer or args.model)


def generation_eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from generation_config.json; vLLM treats those beyond the tokenizer's EOS
    as extra stop tokens (chat models list <|im_end|> there)."""
    path = Path(model_dir) / "generation_config.json"
    if not path.is_file():
        return []
    config: dict[str, Any] = json.loads(path.read_text())
    eos = config.get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(t) for t in eos]
