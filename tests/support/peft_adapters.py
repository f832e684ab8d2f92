"""LoRA adapters written by PEFT itself, and PEFT's merged model as the reference.

`make_adapter` wraps a base checkpoint with PEFT's `get_peft_model`, draws every
lora_A and lora_B weight at random (PEFT's own init zeroes B: an adapter that changes
nothing would test nothing), and saves it with `save_pretrained`: the directory a
trainer hands a server. `merged` loads that directory back with PEFT's `PeftModel` and
merges it into the base weights (`merge_and_unload`): transformers + PEFT computing
what the adapter means, independently of pagellm.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch


def make_adapter(base_dir: Path, out_dir: Path, targets: Sequence[str], r: int, seed: int,
                 alpha: float | None = None, rslora: bool = False, std: float = 0.3
                 ) -> Path:
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    config = LoraConfig(r=r, lora_alpha=2 * r if alpha is None else alpha,
                        target_modules=list(targets), use_rslora=rslora,
                        lora_dropout=0.0)
    model = get_peft_model(base, config)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_" in name:
                p.copy_(std * torch.randn(p.shape, generator=generator))
    model.save_pretrained(out_dir)
    return out_dir


def merged(base_dir: Path, adapter_dir: Path | None) -> Any:
    """PEFT's merge of the adapter into the base model (None: the base model)."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    if adapter_dir is None:
        return base.eval()
    return PeftModel.from_pretrained(base, adapter_dir).merge_and_unload().eval()


def argmax_along(model: Any, prompt_ids: list[int], output_ids: list[int]) -> list[int]:
    """The model's greedy choice after the prompt and each of `output_ids` but the last
    (one forward pass): equal to `output_ids` when they are its greedy continuation."""
    tokens = prompt_ids + output_ids
    with torch.no_grad():
        logits = model(torch.tensor([tokens[:-1]])).logits[0]  # [len - 1, V]
    return logits[len(prompt_ids) - 1:].argmax(-1).tolist()
