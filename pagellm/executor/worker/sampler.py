"""Batched sampling: one pass over the step's logits with per-request parameters.

    logits [B, V] (fp32)
      -> raw logprobs (if asked for, logprobs_mode="raw_logprobs")
      -> allowed_token_ids / banned tokens (min_tokens' EOS and stop ids, bad words)
         / logit_bias
      -> repetition, frequency and presence penalties
      -> greedy rows: argmax
      -> random rows: / temperature, top-k, top-p, min-p, then argmax(p / q), q ~ Exp(1)
      -> processed logprobs (if asked for, logprobs_mode="processed_logprobs")

Every stage is a tensor operation over the rows that need it; a stage no row needs is
skipped entirely, so plain requests pay nothing for features they do not use.

A seeded request draws its noise from a generator seeded by (seed, position of the
token being sampled), so its tokens depend on nothing else: not on its batch-mates,
not on preemptions, not on how many steps it took to get there.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagellm.kernels import cpu_ops

_MASK = float("-inf")

# What one step's logits can take at the sampler's peak, per row and vocabulary entry:
# the LM head's output (<= 4 bytes), the fp32 logits (4), the penalties' prompt mask
# and output counts (5), and the working copies of every stage on at once (temperature,
# the top-k/top-p sort's values and int64 order, softmax, the noise, raw logprobs):
# 25 bytes measured with torch's profiler with top-k/top-p alone, 31 with every stage
# (tests/executor/test_sampler.py checks the bound). On the CPU nothing profiles the step at
# start-up, so the engine sizes its memory with this (`step_peak_bytes`).
STEP_BYTES_PER_LOGIT = 44


def step_peak_bytes(rows: int, vocab_size: int) -> int:
    """Bytes the logits of a step sampling `rows` requests can hold at once."""
    return rows * vocab_size * STEP_BYTES_PER_LOGIT


@dataclass
class Penalties:
    """vLLM's penalties for the rows that use them (P of the B rows)."""

    rows: torch.Tensor  # [P] int64
    presence: torch.Tensor  # [P] float32
    frequency: torch.Tensor  # [P] float32
    repetition: torch.Tensor  # [P] float32
    prompt_mask: torch.Tensor  # [P, V] bool: token occurs in the prompt
    output_counts: torch.Tensor  # [P, V] float32: occurrences in the output so far


@dataclass
class SamplingMetadata:
    """Per-row parameters for one step's logits [B, V]. Optional parts are None when no
    row needs them."""

    temperature: torch.Tensor  # [B] float32; 0 marks a greedy row
    all_greedy: bool
    any_greedy: bool
    top_k: torch.Tensor | None = None  # [B] int64, vocab size where off
    top_p: torch.Tensor | None = None  # [B] float32, 1.0 where off
    min_p: torch.Tensor | None = None  # [B] float32, 0.0 where off
    seeds: dict[int, int] | None = None  # row -> generator seed for seeded random rows
    banned: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows [N], token ids [N])
    allowed: tuple[torch.Tensor, torch.Tensor] | None = None  # (rows, ids): only these
    logit_bias: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None  # rows, ids, +
    penalties: Penalties | None = None
    logprob_rows: torch.Tensor | None = None  # [L] rows whose logprobs are returned
    num_logprobs: int = 0  # top-k to return (the largest any of those rows asked for)
    processed_logprobs: bool = False  # logprobs_mode="processed_logprobs"


@dataclass
class LogprobsTensors:
    """For the logprob rows: the sampled token then the top-k, with logprobs."""

    token_ids: torch.Tensor  # [L, 1 + K] int64
    logprobs: torch.Tensor  # [L, 1 + K] float32
    sampled_ranks: torch.Tensor  # [L] int64, 1-based rank of the sampled token


@dataclass
class SamplerOutput:
    sampled: torch.Tensor  # [B] int64
    logprobs: LogprobsTensors | None


class Sampler:
    def __init__(self, device: torch.device, seed: int) -> None:
        self.device = device
        # Noise for unseeded rows; seeded by the engine's seed for reproducible runs.
        self.generator = torch.Generator(device=device).manual_seed(seed)

    def __call__(self, logits: torch.Tensor, meta: SamplingMetadata) -> SamplerOutput:
        """logits: [B, V] -> sampled token ids [B] (on the device), and logprobs."""
        logits = logits.float()
        raw_logprobs = None
        if meta.logprob_rows is not None and not meta.processed_logprobs:
            raw_logprobs = log_probs(logits[meta.logprob_rows])
        logits = apply_token_masks(logits, meta)
        if meta.penalties is not None:
            logits = apply_penalties(logits, meta.penalties)
        greedy = argmax_rows(logits) if meta.any_greedy else None
        if meta.all_greedy:
            assert greedy is not None
            sampled = greedy
        else:
            temperature = torch.where(meta.temperature > 0, meta.temperature, 1.0)
            logits = logits / temperature[:, None]
            if meta.top_k is not None or meta.top_p is not None:
                logits = apply_top_k_top_p(logits, meta.top_k, meta.top_p)
            probs = logits.softmax(dim=-1)
            if meta.min_p is not None:
                probs = apply_min_p(probs, meta.min_p)
            sampled = self._exponential_sample(probs, meta.seeds or {})
            if greedy is not None:
                sampled = torch.where(meta.temperature > 0, sampled, greedy)
        logprobs = None
        if meta.logprob_rows is not None:
            source = raw_logprobs if raw_logprobs is not None \
                else log_probs(logits[meta.logprob_rows])
            logprobs = gather_logprobs(source, sampled[meta.logprob_rows], meta.num_logprobs)
        return SamplerOutput(sampled, logprobs)

    def _exponential_sample(self, probs: torch.Tensor, seeds: dict[int, int]) -> torch.Tensor:
        q = torch.empty_like(probs)
        q.exponential_(generator=self.generator)
        for row, seed in seeds.items():
            generator = torch.Generator(device=probs.device).manual_seed(seed)
            q[row].exponential_(generator=generator)
        return argmax_rows(probs.div_(q))


def argmax_rows(x: torch.Tensor) -> torch.Tensor:
    """x [rows, vocab] -> [rows] int64: each row's first maximal index, as argmax
    (ties, -inf rows and NaN alike). fp32 on the CPU: pagellm's C++ op where it builds
    (csrc/cpu_sampling.cpp; torch's max(dim) compares one element at a time: 0.6 ms of a
    48-request decode step on 2 cores); else through max's kernel: argmax's CPU kernel
    reads at a third of its speed (48 x 151936 fp32: 4.8 ms against 1.7)."""
    if x.device.type == "cpu" and x.dtype == torch.float32 and x.dim() == 2 \
            and x.shape[1] > 0 and x.stride(1) == 1 and cpu_ops.available():
        return cpu_ops.load().argmax_rows(x)
    return x.max(dim=-1).indices


def apply_token_masks(logits: torch.Tensor, meta: SamplingMetadata) -> torch.Tensor:
    """allowed_token_ids, banned tokens and logit_bias: index operations, no loops."""
    if meta.allowed is not None:
        rows, ids = meta.allowed
        keep = torch.zeros_like(logits, dtype=torch.bool)
        keep[rows, ids] = True
        restricted = torch.zeros(logits.shape[0], dtype=torch.bool, device=logits.device)
        restricted[rows] = True
        logits = logits.masked_fill(restricted[:, None] & ~keep, _MASK)
    if meta.banned is not None:
        rows, ids = meta.banned
        logits[rows, ids] = _MASK
    if meta.logit_bias is not None:
        rows, ids, values = meta.logit_bias
        logits.index_put_((rows, ids), values, accumulate=True)
    return logits


def apply_penalties(logits: torch.Tensor, p: Penalties) -> torch.Tensor:
    """vLLM's (and transformers') rules: a token seen in the prompt or output has its
    logit divided by repetition_penalty if positive, multiplied if not; the output's
    counts then subtract frequency_penalty per occurrence and presence_penalty once."""
    rows = logits[p.rows]  # [P, V]
    output_mask = p.output_counts > 0
    seen = p.prompt_mask | output_mask
    repetition = torch.where(seen, p.repetition[:, None], 1.0)
    rows = torch.where(rows > 0, rows / repetition, rows * repetition)
    rows = rows - p.frequency[:, None] * p.output_counts
    rows = rows - p.presence[:, None] * output_mask
    logits[p.rows] = rows
    return logits


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


def log_probs(logits: torch.Tensor) -> torch.Tensor:
    """logits [L, V] fp32 -> log-probabilities whose normalizer is summed in fp64, not
    by `log_softmax`.

    Why: torch's CPU `log_softmax` sums a row's exponentials in a few vector lanes, each
    adding thousands of terms one after another in fp32; once a lane holds a large term,
    the many small ones after it round away, so the normalizer comes out low and every
    log-probability high, by the same amount. Over a 49k vocabulary with a trained
    model's peaked rows that is +1e-6 to +2e-5 per token: a trainer that normalizes
    accurately (TRL's chunked LM head, its `selective_log_softmax`) then sees
    exp(sum(logp_trainer - logp_engine)) below 1 in every sample. Summing the fp32
    exponentials in fp64 leaves no bias (3e-10; a cascaded fp32 `sum` still leaves 7e-8)
    for about twice `log_softmax`'s time, spent only on the rows that asked for
    logprobs. The max is subtracted first and the log-sum last, as `log_softmax` does:
    `logits - logsumexp` would round the normalizer at the logits' magnitude (+-2e-6
    at 30).

    A masked entry (-inf) stays -inf; a row with nothing finite is NaN, as before. One
    [L, V] temporary beside the result (the exponentials) while the sum runs."""
    shifted = logits - logits.amax(dim=-1, keepdim=True)
    log_sum = shifted.exp().sum(dim=-1, keepdim=True, dtype=torch.float64).log_()
    return shifted.sub_(log_sum.to(shifted.dtype))


def gather_logprobs(logprobs: torch.Tensor, chosen: torch.Tensor, k: int) -> LogprobsTensors:
    """logprobs: [L, V]; chosen: [L] -> the chosen token and the top-k, with the chosen
    token's 1-based rank (ties ranked in its favour)."""
    k = min(k, logprobs.shape[-1])
    chosen_lp = logprobs.gather(-1, chosen[:, None])  # [L, 1]
    ranks = (logprobs > chosen_lp).sum(dim=-1) + 1
    top_lp, top_ids = logprobs.topk(k, dim=-1) if k else (logprobs[:, :0],
                                                          chosen[:, None][:, :0])
    return LogprobsTensors(torch.cat([chosen[:, None], top_ids], dim=-1),
                           torch.cat([chosen_lp, top_lp], dim=-1), ranks)


def mix_seed(seed: int, position: int) -> int:
    """A 63-bit generator seed from (request seed, token position): splitmix64's mixer,
    so nearby seeds and positions give unrelated streams."""
    z = (seed * 0x9E3779B97F4A7C15 + position + 1) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return (z ^ (z >> 31)) & 0x7FFFFFFFFFFFFFFF
