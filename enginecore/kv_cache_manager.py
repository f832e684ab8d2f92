"""Per-request block tables on top of the block pool.

The scheduler asks questions here (can this request grow by N tokens?) and decides;
it never edits blocks itself.
"""

from __future__ import annotations

from enginecore.block_pool import BlockPool, KVCacheBlock
from enginecore.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.block_pool = BlockPool(num_blocks)
        self.req_to_blocks: dict[str, list[KVCacheBlock]] = {}

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_total_blocks(self) -> int:
        return self.block_pool.num_blocks

    def usage(self) -> float:
        return self.block_pool.usage()

    def num_blocks_needed(self, request: Request, num_new_tokens: int) -> int:
        """Blocks the request must add to hold `num_new_tokens` more computed tokens."""
        held = len(self.req_to_blocks.get(request.request_id, ()))
        total = -(-(request.num_computed_tokens + num_new_tokens) // self.block_size)
        return max(0, total - held)

    def allocate_slots(self, request: Request, num_new_tokens: int) -> list[int] | None:
        """Grow the request's block table to fit `num_new_tokens` more tokens.

        Returns the ids of the blocks added (possibly none), or None, changing nothing,
        when there are not enough free blocks.
        """
        needed = self.num_blocks_needed(request, num_new_tokens)
        if needed == 0:  # the common decode step: room left in the last block
            return []
        if needed > self.block_pool.num_free_blocks:
            return None
        new_blocks = self.block_pool.get_new_blocks(needed)
        self.req_to_blocks.setdefault(request.request_id, []).extend(new_blocks)
        return [block.block_id for block in new_blocks]

    def free(self, request: Request) -> None:
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.block_pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, ())]
