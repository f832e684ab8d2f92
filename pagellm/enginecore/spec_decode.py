"""Speculative decoding's proposals in the scheduler (pure Python, no torch).

Two proposers with one interface (`Proposer`): `NgramProposer` finds proposals itself,
`DraftModelProposer` hands out those the draft model made in the last step.

Before a running request's decode step, `NgramProposer` looks its last n tokens up
earlier in its own tokens (prompt and output), for n from prompt_lookup_max down to
prompt_lookup_min, and proposes the up to k tokens that followed the latest earlier
occurrence. Text that repeats its input (an edit, a summary quoting its source, code
with small changes) is then mostly predicted by itself.

The scheduler schedules the proposals after the request's last token (1 + k tokens);
the model runner samples every one of those positions as it would have sampled them
one step at a time, and keeps the proposals up to the first one the sample disagrees
with, plus that sample (executor/worker/model_runner.py). The scheduler takes the
rejected positions back from `num_computed_tokens`: their KV slots are written over
by the next step.

The search runs in C: the tokens as 4-byte integers, the pattern found by
`bytearray.rfind` (a match at an offset that is no multiple of 4 straddles two tokens
and is skipped). The bytes stay on the request (`Request.token_bytes`), extended by the
new tokens each step: 13 us a proposal at 4k tokens, 100 us at 32k (from 85 and 730
when rebuilt each step; `python -m timeit`-style loop, 2-core EPYC).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from array import array

from pagellm.enginecore.request import Request
from pagellm.protocol.speculative import SpeculativeConfig

# On the CPU a step is bound by compute from a few requests on, and verifying proposals
# that are rejected costs throughput: with no disable_by_batch_size given, a CPU engine
# proposes nothing in steps with more running requests than this. Measured with
# benchmarks/spec_decode.py (SmolLM2-135M, 2 cores, k = 4; BENCHMARKS.md): n-gram
# proposals gave 1.48x at 4 requests at once, 1.13x at 8, 1.04x at 16 (within the
# machine's noise: hence 8), 0.80x at 64.
CPU_DISABLE_BY_BATCH_SIZE = 8


class Proposer(ABC):
    """What the scheduler asks of a proposer: `propose(request)` before a decode step;
    `lookahead`, the KV slots past its step a request needs (the draft model writes
    its proposals' keys there after the step); `drafts_in_runner`, whether the runner
    makes the proposals (then the scheduler says which steps: `propose_drafts`)."""

    lookahead = 0
    drafts_in_runner = False

    def __init__(self, config: SpeculativeConfig, device_type: str = "cuda") -> None:
        """`device_type`: the engine's; on the CPU a config without
        disable_by_batch_size takes CPU_DISABLE_BY_BATCH_SIZE (on CUDA, as in vLLM,
        proposals go on at every batch size)."""
        self.k = config.num_speculative_tokens
        self.disable_by_batch_size = config.disable_by_batch_size
        if self.disable_by_batch_size is None and device_type == "cpu":
            self.disable_by_batch_size = CPU_DISABLE_BY_BATCH_SIZE

    def room(self, request: Request) -> int:
        """How many tokens to propose at most: k, and never more than the request's
        max_tokens leaves room for (the verification emits the accepted ones and one
        more)."""
        return min(self.k, request.max_tokens - len(request.output_token_ids) - 1)

    @abstractmethod
    def propose(self, request: Request) -> list[int]:
        """Up to `room` tokens to verify after the request's last one (maybe none)."""


class NgramProposer(Proposer):
    def __init__(self, config: SpeculativeConfig, device_type: str = "cuda") -> None:
        super().__init__(config, device_type)
        self.min_n = config.prompt_lookup_min
        self.max_n = config.prompt_lookup_max

    def propose(self, request: Request) -> list[int]:
        k = self.room(request)
        if k <= 0:
            return []
        # The request's tokens as bytes, extended by the tokens since its last proposal
        # (its tokens only ever grow): the search is then the step's only O(length) work.
        data = request.token_bytes
        if data is None:
            data = request.token_bytes = bytearray(array("i", request.prompt_token_ids))
        have = len(data) // 4 - len(request.prompt_token_ids)
        if have < len(request.output_token_ids):
            data += array("i", request.output_token_ids[have:])
        return ngram_lookup(data, self.min_n, self.max_n, k)


class DraftModelProposer(Proposer):
    """The draft model runs in the workers (executor/worker/draft_model.py): after a step
    that asked (`SchedulerOutput.propose_drafts`), the runner returns each sampling
    request's next k tokens as the draft model predicts them (`draft_token_ids`), which
    the scheduler keeps on the request (`spec_token_ids`) for its next decode step. The
    draft writes their keys and values past the step's tokens: `lookahead` slots."""

    drafts_in_runner = True

    def __init__(self, config: SpeculativeConfig, device_type: str = "cuda") -> None:
        super().__init__(config, device_type)
        self.lookahead = self.k

    def propose(self, request: Request) -> list[int]:
        return request.spec_token_ids[:max(self.room(request), 0)]


def make_proposer(config: SpeculativeConfig, device_type: str) -> Proposer:
    proposer = DraftModelProposer if config.method == "draft_model" else NgramProposer
    return proposer(config, device_type)


def propose_ngram(prompt: list[int], output: list[int], min_n: int, max_n: int, k: int
                  ) -> list[int]:
    """The k tokens that followed the latest earlier occurrence of the sequence's last
    n tokens, for the largest n in [min_n, max_n] that occurs earlier (fewer than k
    where that occurrence is near the end); [] when none does."""
    tokens = array("i", prompt)
    tokens.extend(output)
    return ngram_lookup(tokens.tobytes(), min_n, max_n, k)


def ngram_lookup(data: bytes | bytearray, min_n: int, max_n: int, k: int) -> list[int]:
    """`propose_ngram` over the tokens as native 4-byte ints (`data`)."""
    length = len(data) // 4
    for n in range(min(max_n, length - 1), min_n - 1, -1):
        pattern = data[(length - n) * 4:]
        end = (length - 1) * 4  # an occurrence must end before the last token
        while True:
            at = data.rfind(pattern, 0, end)
            if at < 0 or at % 4 == 0:
                break
            end = at + len(pattern) - 1  # straddles tokens: look further back
        if at >= 0:
            start = at + n * 4
            return memoryview(data)[start:start + k * 4].cast("i").tolist()
    return []


class SpecDecodingStats:
    """Cumulative counts, as vLLM's `vllm:spec_decode_*` metrics: verification runs
    (`num_drafts`), tokens proposed and accepted, and accepted per position (position i
    counts runs whose first i + 1 proposals were all accepted)."""

    def __init__(self, k: int) -> None:
        self.num_drafts = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0
        self.accepted_per_pos = [0] * k

    def observe(self, proposed: int, accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += proposed
        self.num_accepted_tokens += accepted
        for i in range(accepted):
            self.accepted_per_pos[i] += 1

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens \
            else 0.0
