"""The KV-cache block pool and manager, without a model: the O(1) free queue, ref counts,
and how many blocks `allocate_slots` adds for a given context length."""

from __future__ import annotations

import pytest

from pagellm.enginecore.block_pool import BlockPool, FreeKVCacheBlockQueue, KVCacheBlock
from pagellm.enginecore.kv_cache_manager import KVCacheManager
from pagellm.enginecore.request import Request
from pagellm.protocol.sampling_params import SamplingParams

# Our code and torch alone: the floors leg skips it (.ci/run).
pytestmark = pytest.mark.own_code


def make_blocks(n: int) -> list[KVCacheBlock]:
    return [KVCacheBlock(i) for i in range(n)]


def ids(blocks) -> list[int]:
    return [block.block_id for block in blocks]


def make_request(request_id: str = "r0", prompt_len: int = 8) -> Request:
    return Request(request_id, list(range(prompt_len)), SamplingParams(max_tokens=16),
                   eos_token_id=None)


def create_manager(num_blocks: int = 8, block_size: int = 4) -> KVCacheManager:
    return KVCacheManager(num_blocks, block_size)


# -- FreeKVCacheBlockQueue --------------------------------------------------------------


def test_free_queue_iterates_blocks_in_insertion_order():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    assert ids(queue) == [0, 1, 2, 3]
    assert queue.num_free_blocks == 4


def test_free_queue_popleft_takes_the_head():
    queue = FreeKVCacheBlockQueue(make_blocks(4))
    assert queue.popleft().block_id == 0
    assert queue.popleft().block_id == 1
    assert ids(queue) == [2, 3]
    assert queue.num_free_blocks == 2


def test_free_queue_popleft_unlinks_the_block():
    queue = FreeKVCacheBlockQueue(make_blocks(2))
    block = queue.popleft()
    assert block.prev_free is None and block.next_free is None


def test_free_queue_append_adds_at_the_tail():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks[:3])
    queue.append(blocks[4])
    queue.append(blocks[3])
    assert ids(queue) == [0, 1, 2, 4, 3]
    assert queue.num_free_blocks == 5


def test_free_queue_remove_from_the_middle_relinks_the_neighbours():
    blocks = make_blocks(5)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[2])
    assert ids(queue) == [0, 1, 3, 4]
    assert queue.num_free_blocks == 4
    assert blocks[1].next_free is blocks[3] and blocks[3].prev_free is blocks[1]
    assert blocks[2].prev_free is None and blocks[2].next_free is None


def test_free_queue_remove_first_and_last_blocks():
    blocks = make_blocks(4)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.remove(blocks[3])
    assert ids(queue) == [1, 2]
    assert queue.num_free_blocks == 2
    assert queue.popleft() is blocks[1]


def test_free_queue_removed_block_can_be_appended_again_at_the_tail():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    queue.remove(blocks[0])
    queue.append(blocks[0])
    assert ids(queue) == [1, 2, 0]
    assert queue.num_free_blocks == 3


def test_free_queue_remove_of_a_block_not_in_the_queue_raises():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks[:2])
    with pytest.raises(ValueError):
        queue.remove(blocks[2])
    assert ids(queue) == [0, 1]
    assert queue.num_free_blocks == 2


def test_free_queue_popleft_on_an_empty_queue_raises_index_error():
    queue = FreeKVCacheBlockQueue(make_blocks(1))
    queue.popleft()
    with pytest.raises(IndexError):
        queue.popleft()
    assert queue.num_free_blocks == 0
    assert ids(queue) == []


def test_free_queue_can_be_emptied_and_refilled():
    blocks = make_blocks(3)
    queue = FreeKVCacheBlockQueue(blocks)
    taken = [queue.popleft() for _ in range(3)]
    for block in reversed(taken):
        queue.append(block)
    assert ids(queue) == [2, 1, 0]
    assert queue.num_free_blocks == 3


# -- BlockPool ---------------------------------------------------------------------------


def test_block_pool_starts_with_every_block_free_in_id_order():
    pool = BlockPool(5)
    assert pool.num_free_blocks == 5
    assert ids(pool.free_queue) == [0, 1, 2, 3, 4]
    assert all(block.ref_cnt == 0 for block in pool.blocks)
    assert pool.usage() == 0.0


def test_block_pool_rejects_zero_blocks():
    with pytest.raises(ValueError):
        BlockPool(0)


def test_get_new_blocks_takes_from_the_head_with_ref_cnt_one():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)
    assert ids(blocks) == [0, 1, 2]
    assert [block.ref_cnt for block in blocks] == [1, 1, 1]
    assert pool.num_free_blocks == 2
    assert ids(pool.free_queue) == [3, 4]


def test_get_new_blocks_of_zero_returns_nothing():
    pool = BlockPool(2)
    assert pool.get_new_blocks(0) == []
    assert pool.num_free_blocks == 2


def test_get_new_blocks_may_take_every_free_block():
    pool = BlockPool(3)
    assert ids(pool.get_new_blocks(3)) == [0, 1, 2]
    assert pool.num_free_blocks == 0
    assert pool.usage() == 1.0


def test_get_new_blocks_beyond_the_free_count_raises_and_takes_nothing():
    pool = BlockPool(4)
    pool.get_new_blocks(2)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)
    assert pool.num_free_blocks == 2
    assert ids(pool.free_queue) == [2, 3]


def test_free_blocks_returns_blocks_to_the_tail_in_the_order_given():
    pool = BlockPool(5)
    blocks = pool.get_new_blocks(3)  # 0, 1, 2; queue is [3, 4]
    pool.free_blocks([blocks[1], blocks[2], blocks[0]])
    assert ids(pool.free_queue) == [3, 4, 1, 2, 0]
    assert [block.ref_cnt for block in blocks] == [0, 0, 0]
    assert pool.num_free_blocks == 5


def test_freed_blocks_are_reused_after_the_older_free_ones():
    pool = BlockPool(4)
    first = pool.get_new_blocks(2)  # 0, 1
    pool.free_blocks(first)  # queue: 2, 3, 0, 1
    assert ids(pool.get_new_blocks(3)) == [2, 3, 0]


def test_double_free_raises():
    pool = BlockPool(3)
    blocks = pool.get_new_blocks(1)
    pool.free_blocks(blocks)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks(blocks)
    assert pool.num_free_blocks == 3


def test_free_of_a_never_allocated_block_raises():
    pool = BlockPool(3)
    with pytest.raises(ValueError, match="double free"):
        pool.free_blocks([pool.blocks[1]])
    assert ids(pool.free_queue) == [0, 1, 2]


def test_a_shared_block_returns_to_the_queue_only_when_its_last_reference_goes():
    pool = BlockPool(3)
    (block,) = pool.get_new_blocks(1)
    block.ref_cnt += 1  # a second holder, as a prefix-cache hit would add
    pool.free_blocks([block])
    assert block.ref_cnt == 1
    assert pool.num_free_blocks == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 0
    assert ids(pool.free_queue) == [1, 2, 0]


def test_usage_is_the_fraction_of_blocks_held():
    pool = BlockPool(8)
    pool.get_new_blocks(2)
    assert pool.usage() == 0.25
    pool.get_new_blocks(4)
    assert pool.usage() == 0.75


# -- KVCacheManager ----------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_new_tokens", "expected_block_ids"),
    [
        (1, [0]),  # 1 token: one block
        (3, [0]),  # 3 < block_size
        (4, [0]),  # exactly one block full
        (5, [0, 1]),  # one token over a block boundary
        (8, [0, 1]),  # exactly two blocks
        (9, [0, 1, 2]),  # one over two blocks
    ],
)
def test_allocate_slots_for_a_new_request_takes_cdiv_tokens_block_size_blocks(
        num_new_tokens, expected_block_ids):
    manager = create_manager(num_blocks=8, block_size=4)
    request = make_request(prompt_len=num_new_tokens)
    assert manager.allocate_slots(request, num_new_tokens) == expected_block_ids
    assert manager.get_block_ids("r0") == expected_block_ids
    assert manager.num_free_blocks == 8 - len(expected_block_ids)


@pytest.mark.parametrize(
    ("num_computed", "num_new_tokens", "num_added"),
    [
        (3, 1, 0),  # context 4 = exactly one block, already held
        (4, 1, 1),  # context 5 crosses into a second block by one token
        (4, 4, 1),  # context 8 = exactly two blocks
        (4, 5, 2),  # context 9 crosses into a third block by one token
        (4, 0, 0),  # nothing new
    ],
)
def test_allocate_slots_adds_cdiv_context_block_size_minus_held_blocks(
        num_computed, num_new_tokens, num_added):
    manager = create_manager(num_blocks=8, block_size=4)
    request = make_request(prompt_len=num_computed)
    assert manager.allocate_slots(request, num_computed) == [0]  # the prompt: one block
    request.num_computed_tokens = num_computed  # as schedule() does after allocating
    added = manager.allocate_slots(request, num_new_tokens)
    assert added == list(range(1, 1 + num_added))
    assert manager.get_block_ids("r0") == list(range(1 + num_added))
    assert manager.num_blocks_needed(request, num_new_tokens) == 0


def test_allocate_slots_grows_one_block_per_block_size_decode_tokens():
    manager = create_manager(num_blocks=8, block_size=4)
    request = make_request(prompt_len=6)
    assert manager.allocate_slots(request, 6) == [0, 1]
    request.num_computed_tokens = 6
    added = []
    for _ in range(6):  # decode contexts 7, 8, 9, 10, 11, 12
        added.append(manager.allocate_slots(request, 1))
        request.num_computed_tokens += 1
    assert added == [[], [], [2], [], [], []]
    assert manager.get_block_ids("r0") == [0, 1, 2]


def test_num_blocks_needed_counts_only_blocks_not_yet_held():
    manager = create_manager(num_blocks=8, block_size=4)
    request = make_request(prompt_len=10)
    assert manager.num_blocks_needed(request, 10) == 3
    manager.allocate_slots(request, 5)
    assert manager.num_blocks_needed(request, 10) == 1  # holds 2 of cdiv(10, 4) = 3


def test_requests_get_disjoint_blocks_in_free_queue_order():
    manager = create_manager(num_blocks=8, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert manager.allocate_slots(a, 5) == [0, 1]
    assert manager.allocate_slots(b, 4) == [2]
    a.num_computed_tokens = 5
    assert manager.allocate_slots(a, 4) == [3]  # context 9
    assert manager.get_block_ids("a") == [0, 1, 3]
    assert manager.get_block_ids("b") == [2]


def test_allocate_slots_may_use_the_last_free_block():
    manager = create_manager(num_blocks=3, block_size=4)
    request = make_request(prompt_len=12)
    assert manager.allocate_slots(request, 12) == [0, 1, 2]
    assert manager.num_free_blocks == 0


def test_allocate_slots_returns_none_and_changes_nothing_when_short_of_blocks():
    manager = create_manager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    assert manager.allocate_slots(a, 8) == [0, 1]
    b_blocks_before = manager.allocate_slots(b, 4)
    assert b_blocks_before == [2]
    b.num_computed_tokens = 4
    assert manager.allocate_slots(b, 9) is None  # context 13 needs 4 blocks, holds 1, 1 free
    assert manager.get_block_ids("b") == [2]
    assert manager.num_free_blocks == 1
    assert ids(manager.block_pool.free_queue) == [3]


def test_allocate_slots_for_a_new_request_that_does_not_fit_records_nothing():
    manager = create_manager(num_blocks=2, block_size=4)
    request = make_request(prompt_len=9)
    assert manager.allocate_slots(request, 9) is None
    assert manager.get_block_ids("r0") == []
    assert "r0" not in manager.req_to_blocks
    assert manager.num_free_blocks == 2


def test_free_returns_a_requests_blocks_to_the_queue_tail_in_reverse():
    manager = create_manager(num_blocks=6, block_size=4)
    a, b = make_request("a"), make_request("b")
    manager.allocate_slots(a, 12)  # 0, 1, 2
    manager.allocate_slots(b, 4)  # 3; free queue: 4, 5
    manager.free(a)
    assert ids(manager.block_pool.free_queue) == [4, 5, 2, 1, 0]
    assert manager.get_block_ids("a") == []
    assert manager.get_block_ids("b") == [3]


def test_free_of_every_request_brings_usage_back_to_zero():
    manager = create_manager(num_blocks=4, block_size=4)
    a, b = make_request("a"), make_request("b")
    manager.allocate_slots(a, 5)
    manager.allocate_slots(b, 8)
    assert manager.usage() == 1.0
    manager.free(b)
    assert manager.usage() == 0.5
    manager.free(a)
    assert manager.usage() == 0.0
    assert manager.num_free_blocks == manager.num_total_blocks == 4
    assert manager.req_to_blocks == {}


def test_free_of_a_request_holding_no_blocks_changes_nothing():
    manager = create_manager(num_blocks=4, block_size=4)
    manager.free(make_request("never-allocated"))
    assert manager.num_free_blocks == 4
    assert ids(manager.block_pool.free_queue) == [0, 1, 2, 3]


def test_freed_blocks_can_be_allocated_again():
    manager = create_manager(num_blocks=2, block_size=4)
    a, b = make_request("a"), make_request("b")
    manager.allocate_slots(a, 8)  # 0, 1
    manager.free(a)  # queue: 1, 0
    assert manager.allocate_slots(b, 8) == [1, 0]
    assert [block.ref_cnt for block in manager.block_pool.blocks] == [1, 1]
