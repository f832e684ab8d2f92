"""Per-request block tables on top of the block pool.

The scheduler asks questions here (can this request grow by N tokens?) and decides;
it never edits blocks itself.
"""

from __future__ import annotations

from pagellm.enginecore.block_pool import BlockPool, KVCacheBlock
from pagellm.enginecore.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks made findable
        self.prefix_cache_queries = 0  # tokens looked up at admission, cumulative
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        """Share of blocks held by requests (cached but free blocks do not count)."""
        return self.block_pool.usage()

    def get_computed_blocks(self, request: Request) -> list[KVCacheBlock]:
        """The longest run of the request's full blocks found in the prefix cache.

        Never the whole request: its last token is always computed, for its logits. None
        for a request that wants prompt logprobs: every prompt position must be computed.
        """
        if (not self.enable_prefix_caching
                or request.sampling_params.prompt_logprobs is not None):
            return []
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits

    def num_blocks_needed(self, request: Request, num_new_tokens: int,
                          num_hit_blocks: int = 0) -> int:
        """Fresh blocks the request must add to hold `num_new_tokens` more computed
        tokens, after taking `num_hit_blocks` prefix-cache hits."""
        held = len(self.req_to_blocks.get(request.request_id, ())) + num_hit_blocks
        computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None
                       ) -> list[int] | None:
        """Grow the request's block table to fit `num_new_tokens` more tokens, after
        taking `new_computed_blocks` (prefix-cache hits, at admission) as its first
        blocks. Full blocks this step computes become findable by their hashes.

        Returns the ids of the fresh blocks added, or None, changing nothing, when
        there are not enough free blocks.
        """
        end = request.num_computed_tokens + num_new_tokens
        request_id = request.request_id
        hits = new_computed_blocks or []
        held = self.req_to_blocks.get(request_id, [])
        needed = self.num_blocks_needed(request, num_new_tokens, len(hits))
        evictable_hits = sum(1 for block in hits if block.ref_cnt == 0) if hits else 0
        if needed + evictable_hits > self.block_pool.num_free_blocks:
            return None
        if new_computed_blocks is not None:  # admission: count the lookup
            self.prefix_cache_queries += request.num_tokens if self.enable_prefix_caching \
                else 0
            self.prefix_cache_hits += len(hits) * self.block_size
        if hits:
            self.block_pool.touch(hits)
        new_blocks = self.block_pool.get_new_blocks(needed) if needed else []
        held = self.req_to_blocks.setdefault(request_id, held)
        held += hits
        held += new_blocks
        capacity = len(held) * self.block_size
        if self.enable_prefix_caching and request.block_size is not None:  # hashed
            num_cached = self._cache_full_blocks(
                request, held, (end + len(hits) * self.block_size) // self.block_size)
            # Up to this end, a later call would neither add a block nor fill one.
            capacity = min(capacity, (num_cached + 1) * self.block_size - 1)
        request.kv_fits = capacity
        return [block.block_id for block in new_blocks]

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_full: int) -> int:
        """Make the request's full, computed blocks findable; returns how many are."""
        start = self.num_cached_blocks.get(request.request_id, 0)
        end = min(num_full, len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        num_cached = self.num_cached_blocks[request.request_id] = max(start, end)
        return num_cached

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Return the request's blocks; with keep_cached=False their hashes are
        forgotten first (their content cannot be trusted)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        request.kv_fits = -1
        if not keep_cached:
            self.block_pool.uncache(blocks)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def forget_cached(self) -> None:
        self.block_pool.forget_cached()

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
