"""Batched sampling: one pass over the step's logits with per-request parameters.

Greedy rows take the argmax of the raw logits. Random rows are scaled by temperature,
masked by min_p / top-k / top-p, and sampled with the exponential trick
(argmax(p / q), q ~ Exp(1)), which needs no multinomial call and no host sync.

A seeded request draws its noise from a generator seeded by (seed, position of the
token being sampled), so its tokens depend on nothing else: not on its batch-mates,
not on preemptions, not on how many steps it took to get there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

_MASK = float("-inf")


@dataclass
class SamplingMetadata:
    """Per-row parameters for one step's logits [B, V]. Optional tensors are None when
    no row needs them, so plain requests pay nothing for features they do not use."""

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None  # [B] int64, vocab size where off
    top_p: torch.Tensor | None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None  # [B] float32, 0.0 where off
    seeds: dict[int, int]  # row -> generator seed for seeded random rows
    banned: list[tuple[int, list[int]]]  # (row, token ids masked this step: EOS before min_tokens)


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Noise for unseeded rows; seeded by the engine's seed for reproducible runs.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
        """logits: [B, V] -> sampled token ids [B] int64 (on the device)."""
        logits = logits.float()
        for row, token_ids in meta.banned:
            logits[row, token_ids] = _MASK
        greedy = logits.argmax(dim=-1) if meta.any_greedy else None
        if meta.all_greedy:
            assert greedy is not None
            return greedy
        temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
        logits = logits / temperature[:, None]
        if meta.top_k is not None or meta.top_p is not None:
            logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
        probs = logits.softmax(dim=-1)
        if meta.min_p is not None:
            probs = apply_min_p(probs, meta.min_p)
        sampled = self._exponential_sample(probs, meta.seeds)
        if greedy is not None:
            sampled = torch.where(meta.temperature > 0, sampled, greedy)
        return sampled

    def _exponential_sample(self, probs: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, seed in seeds.items():
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            q[row].exponential_(generator=generator)
        return probs.div_(q).argmax(dim=-1)


def apply_top_k_top_p(logits: torch.Tensor, top_k: torch.Tensor | None,
                      top_p: torch.Tensor | None) -> torch.Tensor:
    """Mask everything outside each row's top-k and its top-p nucleus.

    logits: [B, V]; top_k: [B] (V = off); top_p: [B] (1.0 = off). One ascending sort
    serves both masks; at least one token (the most likely) always survives.
    """
    sorted_logits, order = logits.sort(dim=-1, descending=False)
    vocab = logits.shape[-1]
    if top_k is not None:
        kth = sorted_logits.gather(-1, (vocab - top_k.clamp(1, vocab)).unsqueeze(-1))  # [B, 1]
        sorted_logits = sorted_logits.masked_fill(sorted_logits < kth, _MASK)
    if top_p is not None:
        cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)
        drop = cumulative <= (1 - top_p).unsqueeze(-1)
        drop[:, -1] = False
        sorted_logits = sorted_logits.masked_fill(drop, _MASK)
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


def apply_min_p(probs: torch.Tensor, min_p: torch.Tensor) -> torch.Tensor:
    """Zero tokens less likely than min_p times the row's most likely token."""
    threshold = probs.amax(dim=-1, keepdim=True) * min_p.unsqueeze(-1)
    return probs.masked_fill(probs < threshold, 0.0)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position): splitmix64's mixer,
    so nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
