"""KVCacheManager with one full-attention group (a model without windows): prefix lookup,
allocation (all or nothing), freeing. The hybrid groups are tests/unit/test_kv_groups.py's."""

from services.worker.engine.kv_cache.manager import KVCacheManager
from shared.ids import RequestId
from shared.kv_events import BlockStored
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
    assert kv.num_free_blocks == 2 and kv.get_block_ids(req.request_id) == ([],)


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
    assert kv.get_block_ids(a.request_id)[0][:2] == kv.get_block_ids(b.request_id)[0][:2]
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


def test_default_is_one_full_group_with_a_null_id_past_the_pool() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    assert kv.groups.windows == (None,) and kv.null_block_id == 8
    assert kv.get_block_ids(RequestId("unknown")) == ([],)


def test_block_ids_are_one_table_in_allocation_order() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    req = make_request("a", prompt_len=6)
    blocks = kv.allocate_slots(req, 6)
    assert blocks is not None and blocks.block_ids() == ([0, 1],)
    req.num_computed_tokens = 6
    assert kv.allocate_slots(req, 2) is not None  # fills block 1: nothing new
    req.num_computed_tokens = 8
    step = kv.allocate_slots(req, 1)
    assert step is not None and step.block_ids() == ([2],)
    assert kv.get_block_ids(req.request_id) == ([0, 1, 2],)


def test_decode_inside_a_block_is_the_shared_empty_result() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    req = make_request("a", prompt_len=5)
    kv.allocate_slots(req, 5)
    req.num_computed_tokens = 5
    first, second = kv.allocate_slots(req, 1), kv.allocate_slots(req, 1)
    assert first is second and first is not None and first.block_ids() == ([],)


def test_indexing_a_full_block_emits_one_event_chain() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    req = make_request("a", prompt_len=9)
    kv.allocate_slots(req, 9)
    assert kv.take_events() == [BlockStored(req.block_hashes[:2], None, 4)]
    for token in (7, 8, 9):
        req.append_output_token(token)
    req.num_computed_tokens = 9
    kv.allocate_slots(req, 3)  # block 2 fills up this step: indexed now, after its parent
    assert kv.take_events() == [BlockStored([req.block_hashes[2]], req.block_hashes[1], 4)]


def test_pull_leaves_blocks_unindexed_until_index_blocks() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    req = make_request("a", prompt_len=8)
    assert kv.allocate_slots(req, 0, index=False, num_external=8) is not None
    assert kv.get_block_ids(req.request_id) == ([0, 1],)  # full attention: every block
    other = make_request("b", prompt_len=9)
    assert kv.get_computed_blocks(other)[1] == 0
    kv.index_blocks(req, 8)
    assert kv.get_computed_blocks(other)[1] == 8


def test_free_order_evicts_the_tail_first() -> None:
    kv = KVCacheManager(3, 4, enable_caching=True)
    req = make_request("a", prompt_len=12)
    kv.allocate_slots(req, 12)
    kv.free(req)
    kv.allocate_slots(make_request("x", prompt_len=4, first_token=100), 4)  # evicts block 2
    assert kv.get_computed_blocks(make_request("b", prompt_len=13))[1] == 8


def test_hand_over_without_windows_keeps_everything() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    req = make_request("a", prompt_len=10)
    kv.allocate_slots(req, 10)
    assert kv.hand_over(req, 10) == ([0, 1, 2],) and kv.num_free_blocks == 5
    kv.free(req)
    assert kv.num_free_blocks == 8


def test_prompt_logprobs_get_no_hit() -> None:
    kv = KVCacheManager(8, 4, enable_caching=True)
    kv.allocate_slots(make_request("a", prompt_len=9), 9)
    hits, num = kv.get_computed_blocks(make_request("b", prompt_len=9, prompt_logprobs=1))
    assert num == 0 and hits.block_ids() == ([],)
