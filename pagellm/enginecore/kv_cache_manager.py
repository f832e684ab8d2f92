"""Per-request block tables on top of the block pool.

The scheduler asks questions here (can this request grow by N tokens?) and decides;
it never edits blocks itself.

Sliding window (`sliding_window=W`, when every attention layer slides): a query at
position p sees the keys p - W < j <= p, so once a request's next step computes from
position s, a block whose last position is <= s - W is never read by it again. Each
allocation returns such leading blocks to the pool (keeping their hashes: other requests
still find them until evicted) and leaves `null_block` in their place, so that entry k
of the list still holds positions [k * bs, (k + 1) * bs):

    W = 8, bs = 4, the step computes from s = 14 (its first query sees keys 7..14)
    positions   0..3    4..7    8..11   12..15
    blocks     [null]  [ b4 ]  [ b9 ]  [ b2 ]     block 0 ends at 3 <= 14 - 8: released

A request thus holds about ceil(W / bs) + 1 blocks plus the chunk it computes, however
long it grows. Released blocks are always a prefix of the list: `num_skipped_blocks`
counts them, and everything else (free, preemption, caching) uses only the rest.
"""

from __future__ import annotations

from pagellm.enginecore.block_pool import BlockPool, KVCacheBlock
from pagellm.enginecore.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int,
                 enable_prefix_caching: bool = True, sliding_window: int | None = None
                 ) -> None:
        """`sliding_window`: the window when every attention layer slides (the model
        spec's `kv_window`); None keeps every block a request computed until it ends."""
        if sliding_window is not None and sliding_window < 1:
            raise ValueError(f"sliding_window must be >= 1, got {sliding_window}")
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks)
        # Stands in for released blocks: id 0 is a real index into the cache, which is all
        # the worker's block table needs at positions the attention never reads. It is not
        # one of the pool's blocks (never in the free queue, ref count 0): freeing or
        # touching it by mistake fails loudly instead of corrupting the counts.
        self.null_block = KVCacheBlock(0)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}
        self.num_cached_blocks: dict[str, int] = {}  # per request: blocks made findable
        # Per request, with a window: its leading blocks released (now `null_block`);
        # absent for 0, so without a window the dict stays empty.
        self.num_skipped_blocks: dict[str, int] = {}
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
        tokens, after taking `num_hit_blocks` prefix-cache hits.

        Only the chunk's blocks: every position before it is held already, or stands
        for a hit, or (with a window) for a released block. The blocks a window releases
        in the same `allocate_slots` call count there as free, so a long request needs
        about ceil(W / bs) + 1 live blocks plus its chunk, not its whole length."""
        held = len(self.req_to_blocks.get(request.request_id, ())) + num_hit_blocks
        computed = request.num_computed_tokens + num_hit_blocks * self.block_size
        total = -(-(computed + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVCacheBlock] | None = None,
                       num_lookahead_tokens: int = 0) -> list[int] | None:
        """Grow the request's block table to fit `num_new_tokens` more tokens, after
        taking `new_computed_blocks` (prefix-cache hits, at admission) as its first
        blocks, and `num_lookahead_tokens` slots past them (a draft model's proposals,
        written after the step: never hashed, as nothing computed them yet). Full blocks
        this step computes become findable by their hashes.

        With a window, blocks that no query from this step's first position on can see
        go back to the pool first, and are counted as free for this step's blocks:
        released now, at the start of the step, and not after it, because this step's
        own queries still read the window before its first position (a block released
        for the next step could be handed to another request within this one). Hits
        already outside the window at admission are released at once (their compute is
        still saved).

        Returns the ids of the fresh blocks added (always at the end of the list, so the
        worker appends them), or None, changing nothing, when there are not enough free
        blocks.
        """
        request_id = request.request_id
        hits = new_computed_blocks or []
        held = self.req_to_blocks.get(request_id, [])
        start = request.num_computed_tokens + len(hits) * self.block_size
        end = start + num_new_tokens
        needed = self.num_blocks_needed(request, num_new_tokens + num_lookahead_tokens,
                                        len(hits))
        done = self.num_skipped_blocks.get(request_id, 0)
        skip = max(done, self._num_skippable(start))
        # A running request's blocks that just fell out of the window, or at admission
        # (nothing held yet) the hits that are already out of it.
        stale = held[done:skip]
        stale_hits = hits[:skip - len(held)] if skip > len(held) else []
        live_hits = hits[len(stale_hits):] if stale_hits else hits
        released = sum(1 for block in stale if block.ref_cnt == 1) if stale else 0
        evictable_hits = sum(1 for block in live_hits if block.ref_cnt == 0) \
            if live_hits else 0
        if needed + evictable_hits > self.block_pool.num_free_blocks + released:
            return None
        if new_computed_blocks is not None:  # admission: count the lookup
            self.prefix_cache_queries += request.num_tokens if self.enable_prefix_caching \
                else 0
            self.prefix_cache_hits += len(hits) * self.block_size
        if live_hits:
            self.block_pool.touch(live_hits)
        if stale_hits:  # held for an instant: to the free queue's tail, as a freed block
            self.block_pool.touch(stale_hits)
            self.block_pool.free_blocks(reversed(stale_hits))
        if stale:  # in reverse, as `free` does: the chain's first blocks are evicted last
            self.block_pool.free_blocks(reversed(stale))
            held[done:skip] = [self.null_block] * len(stale)
        new_blocks = self.block_pool.get_new_blocks(needed) if needed else []
        held = self.req_to_blocks.setdefault(request_id, held)
        if stale_hits:
            held += [self.null_block] * len(stale_hits)
        held += live_hits
        held += new_blocks
        if skip:
            self.num_skipped_blocks[request_id] = skip
        capacity = len(held) * self.block_size
        if self.enable_prefix_caching and request.block_size is not None:  # hashed
            num_cached = self._cache_full_blocks(request, held, end // self.block_size,
                                                 skip)
            # Up to this end, a later call would neither add a block nor fill one.
            capacity = min(capacity, (num_cached + 1) * self.block_size - 1)
        request.kv_fits = capacity
        return [block.block_id for block in new_blocks]

    def _num_skippable(self, start: int) -> int:
        """Leading blocks no query at `start` or later can see: those ending at or before
        start - W (0 without a window)."""
        if self.sliding_window is None:
            return 0
        return max(0, (start - self.sliding_window + 1) // self.block_size)

    def _cache_full_blocks(self, request: Request, blocks: list[KVCacheBlock],
                           num_full: int, num_skipped: int) -> int:
        """Make the request's full, computed blocks findable; returns how many are.
        The first `num_skipped` are placeholders: released blocks, cached before they
        were released, or hits, cached already."""
        start = max(self.num_cached_blocks.get(request.request_id, 0), num_skipped)
        end = min(num_full, len(request.block_hashes))
        for i in range(start, end):
            self.block_pool.cache_block(blocks[i], request.block_hashes[i])
        num_cached = self.num_cached_blocks[request.request_id] = max(start, end)
        return num_cached

    def free(self, request: Request, keep_cached: bool = True) -> None:
        """Return the request's blocks; with keep_cached=False their hashes are
        forgotten first (their content cannot be trusted). Blocks a window released
        already are not its to return: another request may hold them by now (and their
        content, computed in an earlier step, is sound)."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        num_skipped = self.num_skipped_blocks.pop(request.request_id, 0)
        if num_skipped:
            blocks = blocks[num_skipped:]
        request.kv_fits = -1
        if not keep_cached:
            self.block_pool.uncache(blocks)
        self.block_pool.free_blocks(reversed(blocks))

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()

    def forget_cached(self) -> None:
        self.block_pool.forget_cached()

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table, for a new or resumed request's
        `NewRequestData`; a released position gives `null_block`'s id (0), a valid index
        the attention never reads there."""
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
