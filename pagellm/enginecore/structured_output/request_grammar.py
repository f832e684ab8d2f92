"""`RequestGrammar`: one request's place in its grammar, as the scheduler sees it (plain
Python, no torch: the scheduler advances it with every sampled token)."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from pagellm.enginecore.structured_output.backends import Matcher


class RequestGrammar:
    """A request's matcher, and whether its reasoning (if the engine has a reasoning
    parser) has ended: until then the grammar neither masks nor advances. Plain
    Python: the scheduler calls `advance` for every sampled token."""

    __slots__ = ("dead_end", "in_reasoning", "matcher", "num_accepted", "reasoning_end",
                 "recent", "terminated")

    def __init__(self, matcher: Matcher, reasoning_end: tuple[int, ...] = (),
                 in_reasoning: bool = False) -> None:
        """`reasoning_end`: the token ids that end the reasoning (one for a think tag,
        several for Harmony's `<|channel|>final<|message|>`)."""
        self.matcher = matcher
        self.reasoning_end = reasoning_end
        self.recent: tuple[int, ...] = ()  # the last len(reasoning_end) reasoning tokens
        self.in_reasoning = in_reasoning
        self.terminated = False
        self.dead_end = False  # the last mask allowed nothing
        self.num_accepted = 0

    @property
    def needs_mask(self) -> bool:
        return not self.in_reasoning and not self.terminated

    def advance(self, token_id: int) -> str | None:
        """Take the sampled token; an error message if the grammar refuses it."""
        if self.in_reasoning:
            self.recent = (*self.recent, token_id)[-len(self.reasoning_end):]
            self.in_reasoning = self.recent != self.reasoning_end
            return None
        if self.terminated:
            return None
        if self.dead_end:
            return (f"the grammar admits no token after {self.num_accepted} constrained "
                    f"tokens (an unsatisfiable constraint)")
        if not self.matcher.accept(token_id):
            return (f"token {token_id} is not allowed by the grammar after "
                    f"{self.num_accepted} constrained tokens (the request's own bans, "
                    f"e.g. min_tokens or bad_words, left it no allowed token)")
        self.num_accepted += 1
        self.terminated = self.matcher.is_terminated()
        return None

    @property
    def takes_proposals(self) -> bool:
        """Speculative decoding's proposals can be checked and masked: the grammar
        applies now (a reasoning block's end inside a run would switch it on mid-run,
        after positions sampled without a mask)."""
        return self.needs_mask and not self.dead_end

    def valid_proposals(self, token_ids: list[int]) -> list[int]:
        """The longest prefix of proposed tokens the grammar allows, short of one that
        completes it (a completing token comes as a sample: the request ends there, and
        no bitmask row is asked for past the grammar's end). The matcher is left as it
        was."""
        matcher = self.matcher
        allowed = token_ids[:matcher.validate(token_ids)]
        taken = valid = 0
        for token_id in allowed:
            matcher.accept(token_id)
            taken += 1
            if matcher.is_terminated():
                break
            valid = taken
        if taken:
            matcher.rollback(taken)
        return allowed[:valid]
