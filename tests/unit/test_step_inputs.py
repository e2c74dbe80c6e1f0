"""The model runner's per-step inputs: row order, the decode rows' launch order, and each KV
cache group's slots and block table."""

from services.worker.engine.params import SamplingParams
from services.worker.engine.sched.output import CachedRequestData, SchedulerOutput
from services.worker.engine.worker.input_batch import CachedRequestState
from services.worker.engine.worker.step_inputs import build_step_inputs

BS = 4


def state(rid: str, tokens: int, computed: int) -> CachedRequestState:
    blocks = list(range(100 * len(rid), 100 * len(rid) + -(-(tokens + 1) // BS)))
    return CachedRequestState(
        req_id=rid, token_ids=list(range(tokens)), num_prompt_tokens=tokens,
        params=SamplingParams(), eos_token_ids=(), block_ids=[blocks], num_computed_tokens=computed,
    )  # fmt: skip


def test_decode_rows_go_last_and_are_ordered_longest_context_first() -> None:
    # (request, tokens known, tokens computed, tokens scheduled this step)
    plan = [("a", 12, 11, 1), ("bb", 30, 0, 8), ("ccc", 40, 39, 1), ("dddd", 7, 6, 1),
            ("eeeee", 9, 0, 9), ("ffffff", 40, 39, 1)]  # fmt: skip
    requests = {rid: state(rid, known, done) for rid, known, done, _ in plan}
    sched = SchedulerOutput(
        cached_reqs=[CachedRequestData(rid, ([],), done, False) for rid, _, done, _ in plan],
        num_scheduled_tokens={rid: n for rid, _, _, n in plan},
    )
    inputs = build_step_inputs(sched, requests, BS)
    assert inputs.req_ids == ["bb", "eeeee", "a", "ccc", "dddd", "ffffff"]
    assert inputs.seq_lens == [8, 9, 12, 40, 7, 40]
    # offsets from the first decode row ("a"): ccc and ffffff (40, ties in batch order), a, dddd
    assert inputs.decode_order.tolist() == [1, 3, 0, 2]


def test_a_step_without_decode_rows_has_an_empty_order() -> None:
    requests = {"a": state("a", 10, 0)}
    sched = SchedulerOutput(
        cached_reqs=[CachedRequestData("a", ([],), 0, False)], num_scheduled_tokens={"a": 10}
    )
    assert build_step_inputs(sched, requests, BS).decode_order.tolist() == []


def test_every_group_has_its_slots_and_table() -> None:
    """A request in two KV cache groups (full: blocks 10, 11, 12; windowed: 7 before the
    window is the null block 99, then 20, 21): a 3-token chunk from position 5 and a decode
    row, each token's slot in each group's own blocks."""
    a = state("a", 9, 5)
    a.block_ids = [[10, 11, 12], [99, 20, 21]]
    b = state("b", 6, 5)
    b.block_ids = [[30, 31], [40, 41]]
    sched = SchedulerOutput(
        cached_reqs=[CachedRequestData(r, ([], []), n, False) for r, n in (("a", 5), ("b", 5))],
        num_scheduled_tokens={"a": 3, "b": 1},
    )
    inputs = build_step_inputs(sched, {"a": a, "b": b}, BS)
    # positions 5, 6, 7 (block 1, offsets 1..3) and 5 (block 1, offset 1)
    assert inputs.slot_mapping.tolist() == [[45, 46, 47, 125], [81, 82, 83, 165]]
    assert inputs.block_table.tolist() == [[[10, 11, 12], [30, 31, 0]],
                                           [[99, 20, 21], [40, 41, 0]]]  # fmt: skip
