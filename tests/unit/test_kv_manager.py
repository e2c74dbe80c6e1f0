"""KVCacheManager: prefix lookup, allocation (all or nothing), freeing."""

from services.worker.engine.kv_cache.manager import KVCacheManager
from tests.helpers import make_request


def test_allocation_covers_the_tokens() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True)
    req = make_request("a", prompt_len=10)
    blocks = kv.allocate_slots(req, 10)
    assert blocks is not None and len(blocks) == 3  # ceil(10 / 4)
    req.num_computed_tokens = 10
    assert len(kv.allocate_slots(req, 2) or []) == 0  # slots 10, 11 fit in block 3
    req.num_computed_tokens = 12
    assert len(kv.allocate_slots(req, 1) or []) == 1


def test_failed_allocation_changes_nothing() -> None:
    kv = KVCacheManager(2, 4, enable_caching=True)
    req = make_request("a", prompt_len=12)
    assert kv.allocate_slots(req, 12) is None
    assert kv.num_free_blocks == 2 and kv.get_block_ids(req.request_id) == []


def test_prefix_hit_excludes_the_last_prompt_token() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True)
    a = make_request("a", prompt_len=8)
    kv.allocate_slots(a, 8)
    same = make_request("b", prompt_len=8)  # identical prompt: 2 full blocks cached
    hits, num = kv.get_computed_blocks(same)
    assert num == 4 and len(hits) == 1  # block 2 holds the last token: recomputed
    longer = make_request("c", prompt_len=11)
    assert kv.get_computed_blocks(longer)[1] == 8


def test_shared_blocks_are_refcounted_and_all_freed() -> None:
    kv = KVCacheManager(16, 4, enable_caching=True)
    a, b = make_request("a", prompt_len=9), make_request("b", prompt_len=9)
    kv.allocate_slots(a, 9)
    hits, num = kv.get_computed_blocks(b)
    kv.allocate_slots(b, 9 - num, hits)
    assert kv.get_block_ids(a.request_id)[:2] == kv.get_block_ids(b.request_id)[:2]
    assert kv.num_free_blocks == 16 - 3 - 1
    kv.free(a)
    kv.free(b)
    assert kv.num_free_blocks == 16


def test_free_cached_hits_count_against_capacity() -> None:
    kv = KVCacheManager(3, 4, enable_caching=True)
    a = make_request("a", prompt_len=8)
    kv.allocate_slots(a, 8)
    kv.free(a)  # both blocks free but cached
    b = make_request("b", prompt_len=13)  # hits 2 blocks, needs 2 more: only 1 really free
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    assert kv.allocate_slots(b, 13 - num, hits) is None
    assert kv.num_free_blocks == 3
