"""A recurrent KV cache group (Gated DeltaNet layers' fixed-size state) in the KV manager: the
pages a request holds step by step (the one a step reads and the one it writes), checkpoints at
block boundaries indexed once written, prefix hits that need one, eviction, the pull and
hand-over of a disaggregated request, and the scheduler's steps cut at block boundaries. Block
size 4 (``make_request``); one full-attention group and one recurrent group unless said.
"""

import pytest

from services.worker.engine.kv_cache.groups import RECURRENT, KVCacheGroup, KVCacheGroups
from services.worker.engine.kv_cache.manager import KVCacheManager
from services.worker.engine.request import Request
from shared.ids import RequestId
from tests.unit.test_kv_groups import BS, cached, decode, evict, held, tokens_request

FULL, REC = 0, 1  # the groups, as ``plan`` orders them


def manager(num_blocks: int = 32, caching: bool = True) -> KVCacheManager:
    return KVCacheManager(num_blocks, BS, caching, KVCacheGroups.plan([RECURRENT, None]))


def pages(kv: KVCacheManager, request_id: str, group: int = REC) -> str:
    """The group's table as a string: ``.`` no page, ``#`` a page."""
    ids = kv.get_block_ids(RequestId(request_id))[group]
    return "".join("." if b == kv.null_block_id else "#" for b in ids)


def step(kv: KVCacheManager, request: Request, num_new: int) -> None:
    assert kv.allocate_slots(request, num_new) is not None
    request.num_computed_tokens += num_new


def test_plan_puts_the_recurrent_layers_after_the_attention() -> None:
    groups = KVCacheGroups.plan([RECURRENT, RECURRENT, RECURRENT, None] * 2)
    assert groups.groups == (
        KVCacheGroup(None, (3, 7)),
        KVCacheGroup(None, (0, 1), recurrent=True),
        KVCacheGroup(None, (2, 4), recurrent=True),
        KVCacheGroup(None, (5, 6), recurrent=True),
    )
    assert groups.describe() == "4 groups of 2 layers: full, recurrent, recurrent, recurrent"
    assert groups.has_recurrent and groups.hybrid
    assert groups.kinds == (None, RECURRENT, RECURRENT, RECURRENT)


@pytest.mark.parametrize(("num_tokens", "needed"), [(1, 1), (4, 1), (5, 2), (4096, 2)])
def test_a_recurrent_group_needs_two_pages_at_most(num_tokens: int, needed: int) -> None:
    group = KVCacheGroup(None, (0,), recurrent=True)
    assert group.blocks_needed(num_tokens, BS) == needed
    assert group.blocks_needed(num_tokens, BS, chunk=64) == needed


# each step: tokens computed → the recurrent group's table after it (the full group holds a
# block for every position)
@pytest.mark.parametrize(
    ("prompt", "steps", "tables"),
    [
        # a 10-token prompt in one step: only the page of the last block; decoding inside it
        # writes that page in place; crossing into block 3 writes a new page (block 2's stays
        # while the step reads it), then the old one goes
        (10, [10, 1, 1, 1, 1], ["..#", "..#", "..#", "..##", "...#"]),
        # chunks ending on boundaries: each step a page of its own, the one before released
        (12, [4, 4, 4, 1], ["#", "##", ".##", "..##"]),
        # a chunk of two blocks from a boundary: reads block 0's page, writes block 2's
        (12, [4, 8], ["#", "#.#"]),
    ],
)
def test_the_pages_a_request_holds_step_by_step(
    prompt: int, steps: list[int], tables: list[str]
) -> None:
    kv = manager()
    request = tokens_request("r", list(range(1, prompt + 1)))
    for num_new, table in zip(steps, tables, strict=True):
        if request.num_computed_tokens >= request.num_tokens:
            request.append_output_token(7)
        step(kv, request, num_new)
        assert pages(kv, "r") == table
        assert pages(kv, "r", FULL) == "#" * len(table)


def test_a_checkpoint_is_indexed_once_a_later_step_starts() -> None:
    """The page a step writes at a block boundary is found by its hash only from the next
    allocation on: a request admitted in the same step would read it before it is written."""
    kv = manager()
    a = tokens_request("a", list(range(1, 10)))
    b = tokens_request("b", list(range(1, 10)))
    step(kv, a, 8)  # the state after 8 tokens, written this step
    assert kv.get_computed_blocks(b)[1] == 0
    step(kv, a, 1)  # the next step starts at 8: block 1's page is a checkpoint
    hits, num = kv.get_computed_blocks(b)
    assert num == 8
    assert [t is None for t in hits.blocks[REC]] == [True, False]  # only the checkpoint
    assert hits.blocks[REC][1] is cached(kv, a, REC, 1)


def test_a_hit_needs_a_checkpoint_at_its_end() -> None:
    """A prompt computed in one step leaves no checkpoint inside it: no hit, though every
    full-attention block is cached; its repeat, computed to a boundary first, gives one."""
    kv = manager()
    a = tokens_request("a", list(range(1, 11)))
    step(kv, a, 10)
    kv.free(a)
    again = tokens_request("a2", list(range(1, 11)))
    assert kv.get_computed_blocks(again)[1] == 0
    step(kv, again, 8)
    step(kv, again, 2)
    kv.free(again)
    assert kv.get_computed_blocks(tokens_request("a3", list(range(1, 11))))[1] == 8


def test_free_indexes_the_state_it_ends_on_at_a_boundary() -> None:
    kv = manager()
    a = tokens_request("a", list(range(1, 9)))
    step(kv, a, 8)
    kv.free(a)  # computed 8: block 1's page holds the state after them
    longer = tokens_request("b", [*range(1, 9), 50, 51])
    assert kv.get_computed_blocks(longer)[1] == 8


def test_an_evicted_checkpoint_shortens_the_hit() -> None:
    kv = manager()
    a = tokens_request("a", list(range(1, 14)))
    step(kv, a, 4)
    step(kv, a, 8)  # checkpoints at 4 (indexed now) and 12 (written)
    step(kv, a, 1)  # ... 12 indexed
    kv.free(a)
    b = tokens_request("b", list(range(1, 14)))
    assert kv.get_computed_blocks(b)[1] == 12
    evict(kv, cached(kv, a, REC, 2))
    assert kv.get_computed_blocks(b)[1] == 4  # the checkpoint before it
    evict(kv, cached(kv, a, FULL, 0))
    assert kv.get_computed_blocks(b)[1] == 0  # the attention's blocks are needed too


def test_decoding_holds_at_most_two_pages() -> None:
    kv = manager()
    request = tokens_request("r", list(range(1, 6)))
    step(kv, request, 5)
    for _ in range(40):
        decode(kv, request, 1)
        assert held(kv, request, REC) <= 2
    assert held(kv, request, FULL) == -(-request.num_computed_tokens // BS)


def test_a_pull_holds_the_end_state_page_and_hand_over_sends_only_it() -> None:
    """The decode side of a 10-token prompt allocates the full group's three blocks and the
    recurrent group's page of the state after token 10; the prefill side's hand-over keeps
    only that page of its recurrent table (the checkpoint behind it is released)."""
    prefill, decode_side = manager(), manager()
    ids = list(range(1, 11))
    p = tokens_request("p", ids)
    step(prefill, p, 8)
    step(prefill, p, 2)
    sent = prefill.hand_over(p, 10)
    null = prefill.null_block_id
    assert [b == null for b in sent[REC]] == [True, True, False]
    assert null not in sent[FULL]
    d = tokens_request("d", ids)
    assert decode_side.allocate_slots(d, 0, None, index=False, num_external=10) is not None
    assert pages(decode_side, "d") == "..#" and pages(decode_side, "d", FULL) == "###"


# (start, tokens to compute, the request's tokens) → what the step computes
@pytest.mark.parametrize(
    ("start", "num_new", "num_tokens", "computed"),
    [
        (0, 10, 10, 8),  # the prompt: to its last boundary, the tail next
        (8, 2, 10, 2),  # the tail
        (0, 8, 8, 4),  # a prompt of whole blocks: to the boundary before its last token
        (4, 4, 8, 4),
        (0, 6, 20, 4),  # a chunk inside the prompt: to the last boundary it crosses
        (0, 8, 20, 8),
        (5, 6, 20, 3),  # (from mid-block: to the next boundary)
        (5, 2, 20, 2),  # crosses none: as asked
        (9, 1, 10, 1),  # a decode step
    ],
)
def test_steps_stop_at_block_boundaries(
    start: int, num_new: int, num_tokens: int, computed: int
) -> None:
    request = tokens_request("r", list(range(1, num_tokens + 1)))
    assert manager().checkpoint_aligned(request, start, num_new) == computed
    plain = KVCacheManager(32, BS, True, KVCacheGroups.plan([None]))
    assert plain.checkpoint_aligned(request, start, num_new) == num_new
    assert manager(caching=False).checkpoint_aligned(request, start, num_new) == num_new


def _cache_prompt_in_one_step(kv: KVCacheManager, ids: list[int]) -> None:
    """``ids`` computed by a request whose one step leaves a checkpoint only at the last
    boundary before its last token, then freed."""
    a = tokens_request("cached", ids)
    step(kv, a, kv.checkpoint_aligned(a, 0, len(ids)))
    step(kv, a, len(ids) - a.num_computed_tokens)
    kv.free(a)


# a 13-token prompt cached (checkpoint at 12 only) whose first two blocks a request shares:
# (start, tokens to compute, the request's tokens) → what the request's step computes
@pytest.mark.parametrize(
    ("start", "num_new", "num_tokens", "computed"),
    [
        (0, 13, 13, 8),  # to the end of the shared blocks, not to its own last boundary (12)
        (0, 20, 20, 8),
        (5, 15, 20, 3),  # from mid-block: to the end of the shared blocks
        (0, 6, 20, 4),  # a chunk that stops inside the shared blocks: its own boundary
        (0, 8, 20, 8),  # ... or at their end
        (8, 12, 20, 8),  # from the end of the shared blocks: as if none were cached
    ],
)
def test_steps_stop_where_a_cached_prefix_ends(
    start: int, num_new: int, num_tokens: int, computed: int
) -> None:
    kv = manager()
    _cache_prompt_in_one_step(kv, list(range(1, 14)))
    request = tokens_request("r", [*range(1, 9), *range(70, 70 + num_tokens - 8)])
    assert kv.checkpoint_aligned(request, start, num_new) == computed


def test_a_shared_prefix_hits_from_its_second_sharer_on() -> None:
    """A prompt computed in one step leaves no state inside the prefix it shares with the
    next: that one hits nothing, but its step stops where the shared blocks end, so the one
    after it hits them. A repeat of the whole prompt still stops at its own boundary."""
    kv = manager()
    _cache_prompt_in_one_step(kv, list(range(1, 14)))
    hits = []
    for n in range(3):
        b = tokens_request(f"b{n}", [*range(1, 9), *range(70 + 10 * n, 75 + 10 * n)])
        blocks, num_hit = kv.get_computed_blocks(b)
        hits.append(num_hit)
        num = kv.checkpoint_aligned(b, num_hit, b.num_tokens - num_hit)
        assert kv.allocate_slots(b, num, blocks) is not None  # as the scheduler admits it
        b.num_computed_tokens = num_hit + num
        step(kv, b, b.num_tokens - b.num_computed_tokens)
        kv.free(b)
    assert hits == [0, 8, 8]
    again = tokens_request("c", list(range(1, 14)))
    assert kv.get_computed_blocks(again)[1] == 12
    assert kv.checkpoint_aligned(again, 0, 13) == 12  # (as if it took no hit)


def test_no_step_stops_where_a_checkpoint_is_held_already() -> None:
    """A request that takes no hit (it asks for its prompt's logprobs) over a prefix cached
    with its checkpoint at the end: its step goes on to its own boundary."""
    kv = manager()
    _cache_prompt_in_one_step(kv, list(range(1, 14)))  # checkpoint at 12
    request = tokens_request("r", [*range(1, 14), *range(70, 80)])
    assert kv.checkpoint_aligned(request, 0, 23) == 20
