"""Tokenizer loading (the generation defaults that travel with a model are
generation_config.py's)."""

from __future__ import annotations

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
