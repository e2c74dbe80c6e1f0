"""KV cache groups: the plan of a model's layers into groups, and the KV manager's block tables
per group over one pool — windows releasing what their next token cannot read, prefix hits
that every group agrees on, the pull and hand-over of a disaggregated request's KV, and the
KV events (group 0 only). Block size 4 throughout (``make_request``); windows of a few blocks.
"""

import pytest

from services.worker.engine.kv_cache.block_pool import KVCacheBlock
from services.worker.engine.kv_cache.groups import KVCacheGroup, KVCacheGroups
from services.worker.engine.kv_cache.manager import KVCacheManager
from services.worker.engine.params import SamplingParams
from services.worker.engine.request import Request
from shared.ids import RequestId
from shared.kv_events import BlockRemoved, BlockStored
from tests.helpers import EOS, make_request

BS = 4
GPT_OSS = [128 if i % 2 == 0 else None for i in range(24)]  # sliding, full, sliding, ...
GEMMA3 = [None if (i + 1) % 6 == 0 else 1024 for i in range(48)]  # every 6th layer full


def tokens_request(rid: str, tokens: list[int]) -> Request:
    return Request(RequestId(rid), tokens, SamplingParams(max_tokens=4), (EOS,), BS, 256)


def manager(num_blocks: int, *windows: int | None, caching: bool = True) -> KVCacheManager:
    """One group per window given (one layer each), full attention first as ``plan`` orders."""
    return KVCacheManager(num_blocks, BS, caching, KVCacheGroups.plan(list(windows)))


def held(kv: KVCacheManager, request: Request, group: int) -> int:
    return sum(b != kv.null_block_id for b in kv.get_block_ids(request.request_id)[group])


def decode(kv: KVCacheManager, request: Request, steps: int) -> None:
    """Sample a token, then make room to compute it; ``steps`` times."""
    for _ in range(steps):
        request.append_output_token(7)
        num_new = request.num_tokens - request.num_computed_tokens
        assert kv.allocate_slots(request, num_new) is not None
        request.num_computed_tokens = request.num_tokens


def prefill(kv: KVCacheManager, request: Request) -> None:
    assert kv.allocate_slots(request, request.num_tokens) is not None
    request.num_computed_tokens = request.num_tokens


def evict(kv: KVCacheManager, *targets: KVCacheBlock) -> None:
    """Evict exactly ``targets`` (free, cached): every other free block goes behind them."""
    others = [b for b in kv.pool.blocks if b.ref_cnt == 0 and all(b is not t for t in targets)]
    kv.pool.touch(others)
    kv.pool.free_blocks(others)
    taken = kv.pool.get_new_blocks(len(targets))
    assert {b.block_id for b in taken} == {t.block_id for t in targets}
    kv.pool.free_blocks(taken)


def cached(kv: KVCacheManager, request: Request, group: int, index: int) -> KVCacheBlock:
    block = kv.pool.get_cached_block(request.block_hashes[index], group)
    assert block is not None
    return block


# ---- the plan ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("windows", "page", "groups"),
    [
        (GPT_OSS, 12, [(None, list(range(1, 24, 2))), (128, list(range(0, 24, 2)))]),
        (
            GEMMA3,
            8,
            [(None, list(range(5, 48, 6)))]
            + [(1024, [i for i in range(48) if (i + 1) % 6][k : k + 8]) for k in range(0, 40, 8)],
        ),
        ([None] * 32, 32, [(None, list(range(32)))]),
        (
            [4] * 7 + [None] * 2,
            2,
            [(None, [7, 8]), (4, [0, 1]), (4, [2, 3]), (4, [4, 5]), (4, [6])],
        ),
    ],
    ids=["gpt-oss-20b", "gemma-3-12b", "dense", "uneven"],
)
def test_plan(
    windows: list[int | None], page: int, groups: list[tuple[int | None, list[int]]]
) -> None:
    plan = KVCacheGroups.plan(windows)
    assert plan.page_layers == page
    assert [(g.window, list(g.layers)) for g in plan.groups] == groups
    assert plan.hybrid == (len(set(windows)) > 1)
    for g, group in enumerate(plan.groups):
        for slot, layer in enumerate(group.layers):
            assert plan.place(layer) == (g, slot)


def test_plan_describes_itself_and_refuses_no_layers() -> None:
    assert KVCacheGroups.plan(GPT_OSS).describe() == "2 groups of 12 layers: full, window 128"
    assert KVCacheGroups.plan([None] * 4).describe() == "1 group of 4 layers: full"
    with pytest.raises(ValueError):
        KVCacheGroups.plan([])


@pytest.mark.parametrize(
    ("window", "num_tokens", "needed"),
    [
        (None, 10, 3),  # every block
        (8, 100, 3),  # 8 positions ending anywhere touch at most 3 blocks of 4
        (9, 100, 3),
        (5, 100, 2),
        (4, 100, 2),  # ends mid-block: 2 blocks
        (1, 100, 1),  # only its own position
        (8, 5, 2),  # a short request: what it has
    ],
)
def test_blocks_needed(window: int | None, num_tokens: int, needed: int) -> None:
    assert KVCacheGroup(window, (0,)).blocks_needed(num_tokens, BS) == needed


def test_blocks_per_request_sums_the_groups() -> None:
    assert KVCacheGroups.plan([None, 8, 8]).blocks_per_request(100, BS) == 25 + 3 + 3


@pytest.mark.parametrize(
    ("window", "chunk", "needed"),
    [
        (8, 1, 3),  # decoding: as above
        (8, 6, 4),  # a chunk of 6 from c reads c - 7 … c + 5: 13 positions, 4 blocks of 4
        (8, 64, 19),  # ⌈70 / 4⌉ + 1
        (8, 1000, 25),  # no more than the request's blocks
        (None, 64, 25),
    ],
)
def test_a_prefill_chunk_holds_the_window_under_it(
    window: int | None, chunk: int, needed: int
) -> None:
    """What the worker sizes its cache by (one request of max_model_len at its largest step):
    a windowed group holds the chunk's blocks and the window's before it."""
    assert KVCacheGroup(window, (0,)).blocks_needed(100, BS, chunk) == needed


@pytest.mark.parametrize("chunk", [1, 3, 6, 13])
def test_chunked_prefill_stays_within_the_sized_bound(chunk: int) -> None:
    """Every step of a 100-token prompt prefilled ``chunk`` tokens at a time, then decoded:
    each group holds no more than ``blocks_needed(…, chunk)`` says, and a cache of exactly
    ``blocks_per_request`` blocks is enough (no allocation fails)."""
    groups = KVCacheGroups.plan([8, None, 5, None])
    bound = groups.blocks_per_request(110, BS, chunk)
    kv = KVCacheManager(bound, BS, False, groups)
    req = make_request("a", prompt_len=100)
    while req.num_computed_tokens < 100:
        n = min(chunk, 100 - req.num_computed_tokens)
        assert kv.allocate_slots(req, n) is not None
        for g, group in enumerate(groups.groups):
            assert held(kv, req, g) <= group.blocks_needed(110, BS, chunk)
        req.num_computed_tokens += n
    for _ in range(9):
        decode(kv, req, 1)


# ---- allocation -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "windows",
    [[8, None] * 2, [8] * 5 + [None], [6, None], [5, 9, None]],
    ids=["gpt-oss-like", "gemma-like", "mid-block window", "two windows"],
)
def test_decoding_holds_a_bounded_window(windows: list[int | None]) -> None:
    kv = KVCacheManager(128, BS, True, KVCacheGroups.plan(windows))
    req = make_request("a", prompt_len=10)
    prefill(kv, req)
    for _ in range(40):
        decode(kv, req, 1)
        ids = kv.get_block_ids(req.request_id)
        assert {len(t) for t in ids} == {-(-req.num_tokens // BS)}  # all tables as long
        for g, group in enumerate(kv.groups.groups):
            assert held(kv, req, g) <= group.blocks_needed(req.num_tokens + 1, BS)
            if group.window is not None:  # nothing the next token reads is released
                first = max(0, (req.num_computed_tokens - group.window + 1) // BS)
                assert all(b != kv.null_block_id for b in ids[g][first:])
        total_held = sum(held(kv, req, g) for g in range(kv.groups.num_groups))
        assert kv.num_free_blocks == 128 - total_held
    kv.free(req)
    assert kv.num_free_blocks == 128


def test_released_blocks_go_back_to_the_pool_and_stay_findable() -> None:
    kv = manager(32, None, 8)
    req = make_request("a", prompt_len=16)
    prefill(kv, req)
    w0, w1 = cached(kv, req, 1, 0), cached(kv, req, 1, 1)
    assert kv.num_free_blocks == 32 - 8
    decode(kv, req, 1)  # computes position 16: reads 9..16, so blocks 0 and 1 go
    assert kv.get_block_ids(req.request_id)[1][:2] == [kv.null_block_id] * 2
    assert w0.ref_cnt == w1.ref_cnt == 0 and kv.num_free_blocks == 32 - 8 - 2 + 2
    assert cached(kv, req, 1, 0) is w0  # free, but a later request may still hit it


def test_a_window_ending_mid_block_releases_on_a_decode_inside_a_block() -> None:
    kv = manager(32, None, 6)
    req = make_request("a", prompt_len=9)
    prefill(kv, req)  # position 9 reads 4..9: block 0 is behind the window
    before = kv.num_free_blocks
    req.append_output_token(7)
    blocks = kv.allocate_slots(req, 1)
    assert blocks is not None and blocks.block_ids() == ([], [])  # no new block in any group
    assert kv.num_free_blocks == before + 1
    assert kv.get_block_ids(req.request_id)[1][0] == kv.null_block_id
    req.num_computed_tokens = 10
    req.append_output_token(7)
    assert kv.allocate_slots(req, 1) is kv.allocate_slots(req, 1)  # hot path: nothing to do


def test_chunked_prefill_across_the_window() -> None:
    kv = manager(32, None, 8)
    req = make_request("a", prompt_len=20)
    for chunk, tables in [
        (8, ([0, 1], [2, 3])),
        (8, ([0, 1, 4, 5], [2, 3, 6, 7])),  # from 8: reads 1..15, block 0 still needed
        (4, ([0, 1, 4, 5, 8], [32, 32, 6, 7, 9])),  # from 16: reads 9..19
    ]:
        blocks = kv.allocate_slots(req, chunk)
        assert blocks is not None and len(blocks.block_ids()[0]) == len(blocks.block_ids()[1])
        req.num_computed_tokens += chunk
        assert kv.get_block_ids(req.request_id) == tables
    assert kv.num_free_blocks == 32 - 5 - 3


def test_failed_allocation_changes_nothing() -> None:
    kv = manager(5, None, 8)
    fresh = make_request("a", prompt_len=12)  # 3 blocks in each group: 6 > 5
    assert kv.allocate_slots(fresh, 12) is None
    assert kv.num_free_blocks == 5 and kv.get_block_ids(fresh.request_id) == ([], [])

    kv = manager(8, None, 8)
    a, b = make_request("a", prompt_len=12), make_request("b", prompt_len=4, first_token=50)
    prefill(kv, a)
    prefill(kv, b)  # the pool is full
    before = kv.get_block_ids(a.request_id)
    a.append_output_token(7)
    # from 12 the window drops block 0 (one block back), but both groups need a block 3
    assert kv.allocate_slots(a, 1) is None
    assert kv.get_block_ids(a.request_id) == before and kv.num_free_blocks == 0
    assert cached(kv, a, 1, 0).ref_cnt == 1  # not released either


def test_blocks_released_behind_the_window_count_as_supply() -> None:
    kv = manager(7, None, 8)
    a = make_request("a", prompt_len=12)
    prefill(kv, a)  # 6 of 7 used
    a.append_output_token(7)
    blocks = kv.allocate_slots(a, 1)  # needs 2, has 1 free + 1 released
    assert blocks is not None and kv.num_free_blocks == 0
    assert kv.get_block_ids(a.request_id)[1][0] == kv.null_block_id


# ---- prefix hits ------------------------------------------------------------------------------


def test_a_hit_longer_than_the_window_takes_only_the_window() -> None:
    kv = manager(32, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    b = make_request("b", prompt_len=30)  # a's 24 tokens and more
    hits, num = kv.get_computed_blocks(b)
    assert num == 24
    full, window = hits.blocks
    assert full == [cached(kv, a, 0, i) for i in range(6)]
    assert window == [None] * 4 + [cached(kv, a, 1, 4), cached(kv, a, 1, 5)]  # reads 17..23
    assert hits.block_ids()[1][:4] == [kv.null_block_id] * 4
    assert kv.allocate_slots(b, 30 - num, hits) is not None
    assert all(cached(kv, a, 1, i).ref_cnt == 0 for i in range(4))  # not taken
    assert all(cached(kv, a, 1, i).ref_cnt == 1 for i in (4, 5))
    assert held(kv, b, 0) == 8 and held(kv, b, 1) == 4
    kv.free(b)
    assert kv.num_free_blocks == 32


def test_a_hit_ending_mid_block_is_capped_to_full_blocks() -> None:
    kv = manager(32, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    b = tokens_request("b", a.prompt_token_ids[:10] + [999] * 6)  # differs from position 10
    hits, num = kv.get_computed_blocks(b)
    assert num == 8 and [len(t) for t in hits.blocks] == [2, 2]
    assert hits.blocks[1] == [cached(kv, a, 1, 0), cached(kv, a, 1, 1)]  # reads 1..7


def test_a_hit_is_limited_by_a_windowed_group_whose_window_was_evicted() -> None:
    kv = manager(32, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    evict(kv, cached(kv, a, 1, 4))  # the full group keeps all six blocks
    b = make_request("b", prompt_len=25)
    hits, num = kv.get_computed_blocks(b)
    # 6 blocks would read blocks 4 and 5, 5 blocks 3 and 4: 4 blocks (reads 9..15) is the longest
    assert num == 16
    assert hits.blocks[1] == [None, None, cached(kv, a, 1, 2), cached(kv, a, 1, 3)]


def test_a_longer_hit_may_survive_where_a_shorter_one_does_not() -> None:
    kv = manager(32, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    evict(kv, cached(kv, a, 1, 1))
    assert kv.get_computed_blocks(make_request("b", prompt_len=25))[1] == 24
    # 3 blocks would read blocks 1 and 2; 1 block reads block 0 alone
    assert kv.get_computed_blocks(make_request("c", prompt_len=13))[1] == 4


def test_the_windowed_groups_agree_on_one_hit() -> None:
    kv = manager(64, None, 4, 8)  # window 4 reads one block back, window 8 two
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    evict(kv, cached(kv, a, 2, 4), cached(kv, a, 1, 3))
    # window 8 cuts 6 to 4; then window 4 cuts 4 to 3; then window 8 agrees (blocks 1, 2)
    hits, num = kv.get_computed_blocks(make_request("b", prompt_len=25))
    assert num == 12 and [len(t) for t in hits.blocks] == [3, 3, 3]
    assert hits.blocks[1] == [None, None, cached(kv, a, 1, 2)]


def test_eviction_of_a_full_block_limits_the_hit() -> None:
    kv = manager(32, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    evict(kv, cached(kv, a, 0, 4))
    hits, num = kv.get_computed_blocks(make_request("b", prompt_len=25))
    assert num == 16 and hits.blocks[1][2:] == [cached(kv, a, 1, 2), cached(kv, a, 1, 3)]


def test_no_hit_without_caching() -> None:
    kv = manager(32, None, 8, caching=False)
    prefill(kv, make_request("a", prompt_len=24))
    hits, num = kv.get_computed_blocks(make_request("b", prompt_len=25))
    assert num == 0 and hits.block_ids() == ([], [])


# ---- disaggregated requests -------------------------------------------------------------------


def test_a_pull_holds_only_the_prompts_last_window() -> None:
    kv = manager(32, None, 8)
    req = make_request("a", prompt_len=20)
    assert kv.allocate_slots(req, 0, index=False, num_external=20) is not None
    null = kv.null_block_id
    # the first decoded position, 20, reads 13..20: blocks 3 and 4 of the prompt (and 5, next)
    assert kv.get_block_ids(req.request_id) == ([0, 1, 2, 3, 4], [null, null, null, 5, 6])
    assert kv.take_events() == []  # nothing indexed before the pull lands
    kv.index_blocks(req, 20)
    assert kv.take_events() == [BlockStored(req.block_hashes[:5], None, BS)]
    assert kv.pool.get_cached_block(req.block_hashes[4], 1) is not None
    req.num_computed_tokens = 20
    decode(kv, req, 1)  # position 20 starts block 5: one more in each group, none released
    assert kv.get_block_ids(req.request_id) == ([0, 1, 2, 3, 4, 7], [null, null, null, 5, 6, 8])


def test_a_pull_after_local_hits_skips_the_hits_behind_the_window() -> None:
    kv = manager(32, None, 8)
    p = make_request("p", prompt_len=12)
    prefill(kv, p)
    kv.free(p)
    req = make_request("a", prompt_len=20)
    req.append_output_token(7)  # a decode leg arrives with its first token
    hits, num = kv.get_computed_blocks(req)
    assert num == 12
    assert kv.allocate_slots(req, 0, hits, index=False, num_external=20 - num) is not None
    null = kv.null_block_id
    full, window = kv.get_block_ids(req.request_id)
    assert full[:3] == hits.block_ids()[0] and len(full) == 5
    assert window[:3] == [null] * 3 and null not in window[3:]
    assert all(cached(kv, p, 1, i).ref_cnt == 0 for i in range(3))  # the window's hits: unused


def test_hand_over_releases_what_the_decode_side_does_not_need() -> None:
    kv = manager(32, None, 8)
    req = make_request("a", prompt_len=20)
    prefill(kv, req)
    released = [cached(kv, req, 1, i) for i in range(3)]
    null = kv.null_block_id
    assert kv.hand_over(req, 20) == ([0, 1, 2, 3, 4], [null, null, null, 8, 9])
    assert kv.num_free_blocks == 32 - 7 and all(b.ref_cnt == 0 for b in released)
    assert kv.pool.get_cached_block(req.block_hashes[0], 1) is released[0]
    kv.free(req)  # the lease ends
    assert kv.num_free_blocks == 32


# ---- freeing and events -----------------------------------------------------------------------


def test_free_returns_every_block_tail_first_across_groups() -> None:
    kv = manager(12, None, 8)
    a = make_request("a", prompt_len=24)
    prefill(kv, a)
    kv.free(a)
    assert kv.num_free_blocks == 12
    # the tail position goes first in both groups: what stays is a prefix everywhere
    kv.allocate_slots(make_request("x", prompt_len=4, first_token=100), 4)
    assert kv.get_computed_blocks(make_request("b", prompt_len=25))[1] == 20
    assert kv.pool.get_cached_block(a.block_hashes[5], 1) is None


def test_events_are_group_0s_only() -> None:
    kv = manager(8, None, 8)
    a = make_request("a", prompt_len=8)
    prefill(kv, a)
    assert kv.take_events() == [BlockStored(a.block_hashes[:2], None, BS)]
    assert kv.pool.num_cached_blocks == 2
    decode(kv, a, 9)  # indexes in both groups; reuses released window blocks, evicting them
    events = kv.take_events()
    assert all(isinstance(e, BlockStored) for e in events)
    assert [h for e in events if isinstance(e, BlockStored) for h in e.block_hashes] == (
        a.block_hashes[2:4]
    )
    kv.free(a)
    assert kv.allocate_slots(make_request("x", prompt_len=16, first_token=100), 16)  # takes all 8
    removed = [h for e in kv.take_events() if isinstance(e, BlockRemoved) for h in e.block_hashes]
    assert sorted(removed) == sorted(a.block_hashes[:4])  # once each: group 1's are silent
