"""How data parallelism spreads work: which engine core gets a new request (`Router`),
and how the cores' answers to one utility call combine (`merge_results`, `merge_infos`).

No sockets here: dp_client.py asks these questions and does the talking.

- A new request goes to the least loaded core (waiting + running, as the caller counts
  them). Among cores within `LOAD_SLACK_REQUESTS` / `LOAD_SLACK_FRACTION` of the least
  loaded, the one that already holds the longest prefix of the prompt wins
  (`PrefixIndex`: the prompt block hashes sent to each core, LRU-bounded by that core's
  KV blocks), so that shared prefixes keep hitting one core's cache; exact ties rotate.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import msgspec

from pagellm.enginecore.block_hash import BlockHash, extend_block_hashes
from pagellm.protocol.messages import EngineCoreRequest, EngineInfo, UtilityMethod
from pagellm.protocol.stats import EngineStats, StepTimings
from pagellm.protocol.utility import SIGNATURES, Merge

# Loads this close to the least loaded count as equal, and the cached prefix decides:
# a request more or 10% (of the least load) buys a cache hit.
LOAD_SLACK_REQUESTS = 1
LOAD_SLACK_FRACTION = 0.1


class PrefixIndex:
    """The prompt block hashes sent to one engine core, least recently used first,
    at most `capacity` of them (the core cannot cache more blocks than it has)."""

    def __init__(self, capacity: int) -> None:
        self.capacity = max(1, capacity)
        self._hashes: OrderedDict[BlockHash, None] = OrderedDict()

    def cached_prefix(self, hashes: Sequence[BlockHash]) -> int:
        """How many leading blocks of a prompt the core probably holds."""
        count = 0
        for h in hashes:
            if h not in self._hashes:
                break
            count += 1
        return count

    def add(self, hashes: Sequence[BlockHash]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def __len__(self) -> int:
        return len(self._hashes)


class Router:
    """Which engine core gets a new request (see the module's docstring)."""

    def __init__(self, block_size: int, capacities: Sequence[int],
                 prefix_aware: bool = True) -> None:
        self.block_size = block_size
        self.prefix_aware = prefix_aware
        self.indexes = [PrefixIndex(c) for c in capacities]
        self._turn = 0  # exact ties rotate: one request at a time still uses every core

    def hashes(self, request: EngineCoreRequest) -> list[BlockHash]:
        hashes: list[BlockHash] = []
        if self.prefix_aware:
            extend_block_hashes(hashes, request.prompt_token_ids, self.block_size,
                                request.cache_salt)
        return hashes

    def choose(self, loads: Sequence[int], hashes: Sequence[BlockHash]) -> int:
        least = min(loads)
        slack = max(LOAD_SLACK_REQUESTS, LOAD_SLACK_FRACTION * least)
        n = len(loads)
        candidates = [r for r, load in enumerate(loads)
                      if load <= (least + slack if hashes else least)]
        turn, self._turn = self._turn, (self._turn + 1) % n
        return max(candidates, key=lambda r: (self.indexes[r].cached_prefix(hashes),
                                              -loads[r], -((r - turn) % n)))

    def record(self, rank: int, hashes: Sequence[BlockHash]) -> None:
        self.indexes[rank].add(hashes)


def merge_stats(stats: Sequence[EngineStats]) -> EngineStats:
    """Counts summed; the KV cache usage over all blocks; step timings averaged."""
    n = len(stats)
    total = sum(s.num_total_blocks for s in stats)
    timings = [msgspec.structs.asdict(s.step_timings) for s in stats]
    return EngineStats(
        num_running_reqs=sum(s.num_running_reqs for s in stats),
        num_waiting_reqs=sum(s.num_waiting_reqs for s in stats),
        num_free_blocks=sum(s.num_free_blocks for s in stats),
        num_total_blocks=total,
        kv_cache_usage=sum(s.kv_cache_usage * s.num_total_blocks for s in stats)
        / max(total, 1),
        prefix_cache_queries=sum(s.prefix_cache_queries for s in stats),
        prefix_cache_hits=sum(s.prefix_cache_hits for s in stats),
        num_preemptions=sum(s.num_preemptions for s in stats),
        num_steps=sum(s.num_steps for s in stats),
        step_timings=StepTimings(**{k: sum(t[k] for t in timings) / n
                                    for k in timings[0]}),
        per_engine=list(stats),
        spec_num_drafts=sum(s.spec_num_drafts for s in stats),
        spec_num_draft_tokens=sum(s.spec_num_draft_tokens for s in stats),
        spec_num_accepted_tokens=sum(s.spec_num_accepted_tokens for s in stats),
        spec_accepted_per_pos=[sum(p) for p in zip(*(s.spec_accepted_per_pos
                                                     for s in stats), strict=True)])


def merge_results(method: UtilityMethod, results: list[Any]) -> Any:
    """One utility call's results from every engine core (rank order) as one, as the
    method's row says (protocol/utility.py `SIGNATURES`: `Signature.merge`)."""
    return MERGERS[SIGNATURES[method].merge](results)


MERGERS: dict[Merge, Callable[[list[Any]], Any]] = {
    Merge.NOTHING: lambda results: None,
    Merge.STATS: merge_stats,
    Merge.ALL: all,
    Merge.ANY: any,
    Merge.CONCAT: lambda results: [r for per_core in results for r in per_core],
    Merge.MIN: min,
}


def merge_infos(infos: Sequence[EngineInfo]) -> EngineInfo:
    """The engine facts the frontend validates requests against: the same on every
    core, or the cores do not serve the same model the same way."""
    first = infos[0]
    for rank, info in enumerate(infos):
        for name in ("model", "max_model_len", "vocab_size", "block_size", "max_logprobs",
                     "max_num_seqs", "world_size"):
            if getattr(info, name) != getattr(first, name):
                raise ValueError(f"data-parallel engine cores disagree on {name}: "
                                 f"{getattr(first, name)!r} (rank 0) vs "
                                 f"{getattr(info, name)!r} (rank {rank})")
    return msgspec.structs.replace(first, num_kv_blocks=min(i.num_kv_blocks for i in infos),
                                   data_parallel_size=len(infos))
