"""Fixed-size KV-cache blocks and the pool that hands them out, with the prefix cache.

The pool never touches tensors: a block is an index into the executor's paged KV
cache. Free blocks sit in a doubly linked queue so that taking one, returning one and
pulling one out of the middle (a prefix-cache hit on a freed block) are all O(1).

    head <-> b7 <-> b2 <-> b9 <-> tail      popleft() takes b7; append() adds before tail

A full block may carry a hash (enginecore/block_hash.py) and be found by it. When its
last holder frees it, it keeps hash and content and joins the free queue's tail; it is
evicted (its hash forgotten) only when popped from the head for a fresh allocation, so
the least recently freed cached blocks go first (LRU).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator

from pagellm.enginecore.block_hash import BlockHash


class KVCacheBlock:
    """One block of `block_size` token slots, shared by `ref_cnt` requests."""

    __slots__ = ("block_hash", "block_id", "next_free", "prev_free", "ref_cnt")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set while it is in the prefix cache
        self.prev_free: KVCacheBlock | None = None
        self.next_free: KVCacheBlock | None = None

    def __repr__(self) -> str:
        return f"KVCacheBlock(id={self.block_id}, ref_cnt={self.ref_cnt})"


class FreeKVCacheBlockQueue:
    """Doubly linked list of free blocks with sentinels at both ends."""

    def __init__(self, blocks: Iterable[KVCacheBlock]) -> None:
        self._head = KVCacheBlock(-1)
        self._tail = KVCacheBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self.num_free_blocks = 0
        for block in blocks:
            self.append(block)

    def popleft(self) -> KVCacheBlock:
        block = self._head.next_free
        if block is self._tail or block is None:
            raise IndexError("no free KV-cache blocks")
        self.remove(block)
        return block

    def append(self, block: KVCacheBlock) -> None:
        last = self._tail.prev_free
        if last is None or block.prev_free is not None or block.next_free is not None:
            raise ValueError(f"{block} is already in the free queue")
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def remove(self, block: KVCacheBlock) -> None:
        prev, nxt = block.prev_free, block.next_free
        if prev is None or nxt is None:
            raise ValueError(f"{block} is not in the free queue")
        prev.next_free = nxt
        nxt.prev_free = prev
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def __iter__(self) -> Iterator[KVCacheBlock]:  # for tests and debugging
        block = self._head.next_free
        while block is not None and block is not self._tail:
            yield block
            block = block.next_free


class BlockPool:
    """All KV-cache blocks; hands out free ones and takes them back by ref count."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self.free_queue = FreeKVCacheBlockQueue(self.blocks)
        self.cached: dict[BlockHash, KVCacheBlock] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.free_queue.num_free_blocks

    def get_new_blocks(self, num_blocks: int) -> list[KVCacheBlock]:
        if num_blocks < 0:
            raise ValueError(f"asked for a negative number of blocks: {num_blocks}")
        if num_blocks > self.num_free_blocks:
            raise ValueError(f"asked for {num_blocks} blocks, {self.num_free_blocks} free")
        blocks = [self.free_queue.popleft() for _ in range(num_blocks)]
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def get_cached_block(self, block_hash: BlockHash) -> KVCacheBlock | None:
        return self.cached.get(block_hash)

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Take a reference on prefix-cache hits, pulling free ones out of the queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_queue.remove(block)
            block.ref_cnt += 1

    def cache_block(self, block: KVCacheBlock, block_hash: BlockHash) -> None:
        """Make a full, held block findable by its hash (first block with a hash wins)."""
        if block.block_hash is None and block_hash not in self.cached:
            block.block_hash = block_hash
            self.cached[block_hash] = block

    def reset_prefix_cache(self) -> bool:
        """Forget every cached block; refused (False) while any block is held, since a
        running request would cache blocks again (vLLM's rule)."""
        if self.num_free_blocks != self.num_blocks:
            return False
        self.forget_cached()
        return True

    def forget_cached(self) -> None:
        """Make every block unfindable, held ones included (new weights: no KV computed
        before them may be reused; held blocks still serve the requests holding them)."""
        for block in self.cached.values():
            block.block_hash = None
        self.cached.clear()

    def uncache(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Make blocks unfindable (a failed step may have left them half written)."""
        for block in blocks:
            self._evict(block)

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is not None:
            if self.cached.get(block.block_hash) is block:
                del self.cached[block.block_hash]
            block.block_hash = None

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each block; blocks nobody holds go back to the queue.

        Callers pass a request's blocks in reverse so that its tail blocks, the least
        likely to be shared, are reused first.
        """
        blocks = list(blocks)
        held: dict[int, int] = {}
        for block in blocks:  # check all first: a bad call must change nothing
            held[block.block_id] = held.get(block.block_id, 0) + 1
            if held[block.block_id] > block.ref_cnt:
                raise ValueError(f"double free of {block}")
        for block in blocks:
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_queue.append(block)

    def usage(self) -> float:
        """Fraction of blocks held by requests."""
        return 1.0 - self.num_free_blocks / self.num_blocks
