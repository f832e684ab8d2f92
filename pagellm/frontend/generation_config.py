"""What a model's generation_config.json says, read in one place: its extra EOS ids, and
its default sampling parameters (vLLM's `generation_config` option): what a request
that leaves a field unset samples with.

Chat models ship their recommended sampling in generation_config.json (Qwen2.5's
temperature 0.7, top_p 0.8, top_k 20, repetition_penalty 1.05); vLLM applies the
fields below as defaults, and so does pagellm: `LLM.generate` without sampling params,
`LLM.get_default_sampling_params()`, and every server request for each field it does
not set. `max_new_tokens` caps max_tokens. `generation_config="vllm"` turns it off.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from pagellm.protocol.sampling_params import SamplingParams
from pagellm.protocol.validation import read_json_object

# generation_config.json's name -> SamplingParams' (vLLM's list).
FIELDS = {"temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p",
          "repetition_penalty": "repetition_penalty", "max_new_tokens": "max_tokens"}
MAX_FILE_BYTES = 1 << 20  # Hugging Face's are under 1 KB


def read_generation_config(directory: str | Path) -> dict[str, Any] | None:
    """The directory's generation_config.json as a dict, None if it has none; a file
    that is too large, not JSON or not an object is a ValueError naming it."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return None
    return read_json_object(path, MAX_FILE_BYTES)


def generation_eos_token_ids(model_dir: str) -> list[int]:
    """EOS ids from the model's generation_config.json (whatever `generation_config`
    says: it chooses sampling defaults only); vLLM treats those beyond the tokenizer's
    EOS as extra stop tokens (chat models list <|im_end|> there)."""
    eos = (read_generation_config(model_dir) or {}).get("eos_token_id")
    if eos is None:
        return []
    return [eos] if isinstance(eos, int) else [int(t) for t in eos]


def default_sampling_fields(model_dir: str, setting: str) -> dict[str, Any]:
    """SamplingParams field -> default value, from `setting`: "auto" (the model
    directory's generation_config.json, if it has one), "vllm" (none) or a directory
    that must hold one. A value SamplingParams refuses is a ValueError naming the file."""
    if setting == "vllm":
        return {}
    directory = model_dir if setting == "auto" else setting
    config = read_generation_config(directory)
    if config is None:
        if setting == "auto":
            return {}
        raise ValueError(f"generation_config={setting!r}: no generation_config.json there")
    fields = {ours: config[theirs] for theirs, ours in FIELDS.items()
              if config.get(theirs) is not None}
    try:
        SamplingParams(**fields)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{Path(directory) / 'generation_config.json'}: {e}") from None
    return fields
