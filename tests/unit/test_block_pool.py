"""BlockPool: ref counts, LRU free queue, the hash index, and the KV events it emits."""

import pytest

from services.worker.engine.kv_cache.block_pool import BlockPool
from shared.block_hash import hash_blocks
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored

HASHES = hash_blocks(list(range(64)), 16)  # four distinct chained hashes


def test_allocate_and_free_restore_the_free_count() -> None:
    pool = BlockPool(8, 16, enable_caching=True)
    blocks = pool.get_new_blocks(5)
    assert pool.num_free_blocks == 3 and all(b.ref_cnt == 1 for b in blocks)
    pool.free_blocks(blocks)
    assert pool.num_free_blocks == 8


def test_cannot_take_more_than_free() -> None:
    pool = BlockPool(2, 16, enable_caching=True)
    with pytest.raises(ValueError):
        pool.get_new_blocks(3)


def test_double_free_is_an_error() -> None:
    pool = BlockPool(2, 16, enable_caching=True)
    [b] = pool.get_new_blocks(1)
    pool.free_blocks([b])
    with pytest.raises(RuntimeError):
        pool.free_blocks([b])


def test_lru_order_free_blocks_are_reused_oldest_first() -> None:
    pool = BlockPool(4, 16, enable_caching=True)
    a, _b, c, _d = pool.get_new_blocks(4)
    pool.free_blocks([c, a])  # c freed first → reused first
    assert [x.block_id for x in pool.get_new_blocks(2)] == [c.block_id, a.block_id]


def test_cached_block_survives_free_until_evicted() -> None:
    pool = BlockPool(2, 16, enable_caching=True)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], HASHES, 0, 2)
    pool.free_blocks([b, a])
    assert pool.get_cached_block(HASHES[0]) is a  # still findable while free
    pool.touch([a])  # a prefix hit takes it back out of the free queue
    assert pool.num_free_blocks == 1 and a.ref_cnt == 1
    [reused] = pool.get_new_blocks(1)  # evicts b's hash
    assert reused is b and pool.get_cached_block(HASHES[1]) is None


def test_events_stored_removed_cleared() -> None:
    pool = BlockPool(2, 16, enable_caching=True)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2)
    assert pool.take_events() == [BlockStored([HASHES[0], HASHES[1]], None, 16)]
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(1)
    assert pool.take_events() == [BlockRemoved([HASHES[1]])]
    pool.free_blocks([pool.blocks[1]])
    assert pool.reset_prefix_cache()
    assert pool.take_events() == [AllBlocksCleared()]
    assert pool.take_events() == []


def test_duplicate_hash_leaves_second_block_unindexed() -> None:
    pool = BlockPool(4, 16, enable_caching=True)
    first, second = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(first, HASHES, 0, 1)
    pool.cache_full_blocks(second, HASHES, 0, 1)
    assert pool.get_cached_block(HASHES[0]) is first[0] and second[0].block_hash is None
    assert len(pool.take_events()) == 1


def test_reset_refused_while_blocks_are_held() -> None:
    pool = BlockPool(2, 16, enable_caching=True)
    pool.get_new_blocks(1)
    assert not pool.reset_prefix_cache()


def test_caching_disabled_indexes_nothing() -> None:
    pool = BlockPool(2, 16, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, HASHES, 0, 2)
    assert pool.get_cached_block(HASHES[0]) is None and pool.take_events() == []


def test_announce_all_replays_the_exact_index() -> None:
    pool = BlockPool(3, 16, enable_caching=True)
    blocks = pool.get_new_blocks(3)
    pool.cache_full_blocks(blocks, HASHES, 0, 3)
    pool.free_blocks(reversed(blocks))
    pool.get_new_blocks(1)  # evicts HASHES[2]
    pool.take_events()
    pool.announce_all()
    assert pool.take_events() == [
        AllBlocksCleared(),
        BlockStored([HASHES[0], HASHES[1]], None, 16),
    ]


def test_each_group_has_its_own_index_and_only_group_0_is_announced() -> None:
    pool = BlockPool(4, 16, enable_caching=True, num_groups=2)
    full, window = pool.get_new_blocks(1), pool.get_new_blocks(1)
    pool.cache_full_blocks(full, HASHES, 0, 1)
    pool.cache_full_blocks(window, HASHES, 0, 1, group=1)  # same hash, another group's block
    assert pool.get_cached_block(HASHES[0]) is full[0]
    assert pool.get_cached_block(HASHES[0], group=1) is window[0]
    assert pool.num_cached_blocks == 1  # what the prefix directory knows of
    assert pool.take_events() == [BlockStored([HASHES[0]], None, 16)]
    pool.free_blocks(window + full)
    pool.get_new_blocks(3)  # the two never-used blocks, then the window block: evicted silently
    assert pool.get_cached_block(HASHES[0], group=1) is None
    assert pool.get_cached_block(HASHES[0]) is full[0] and pool.take_events() == []
    pool.announce_all()
    assert pool.take_events() == [AllBlocksCleared(), BlockStored([HASHES[0]], None, 16)]
    pool.get_new_blocks(1)  # now group 0's block: its removal is announced
    assert pool.take_events() == [BlockRemoved([HASHES[0]])]


def test_none_entries_are_skipped_and_split_the_stored_chain() -> None:
    pool = BlockPool(4, 16, enable_caching=True)
    a, c = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, None, c], HASHES, 0, 3)
    assert pool.get_cached_block(HASHES[1]) is None and pool.get_cached_block(HASHES[2]) is c
    assert pool.take_events() == [
        BlockStored([HASHES[0]], None, 16),
        BlockStored([HASHES[2]], HASHES[1], 16),
    ]


def test_reset_forgets_every_group() -> None:
    pool = BlockPool(2, 16, enable_caching=True, num_groups=2)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], HASHES, 0, 1)
    pool.cache_full_blocks([b], HASHES, 0, 1, group=1)
    pool.free_blocks([a, b])
    assert pool.reset_prefix_cache()
    assert pool.get_cached_block(HASHES[0]) is None
    assert pool.get_cached_block(HASHES[0], group=1) is None and b.block_hash is None
