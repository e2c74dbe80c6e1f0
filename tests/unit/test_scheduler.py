"""The engine scheduler, driven with a fake model runner: table-driven step traces."""

from typing import Any

import pytest

from services.worker.engine.request import FinishReason, RequestStatus
from services.worker.engine.sched.scheduler import Scheduler
from tests.helpers import EOS, fake_run, make_request, make_scheduler


def trace(sched: Scheduler, steps: int) -> list[dict[str, int]]:
    """num_scheduled_tokens of each step."""
    out = []
    for _ in range(steps):
        so = sched.schedule()
        out.append(dict(so.num_scheduled_tokens))
        sched.update_from_output(so, fake_run(sched, so))
    return out


CASES: list[tuple[str, dict[str, Any], list[tuple[str, int, int]], list[dict[str, int]]]] = [
    # name, scheduler kwargs, requests (id, prompt_len, max_tokens), expected trace
    (
        "decode batches with prefill",
        {"budget": 32},
        [("a", 10, 3), ("b", 6, 2)],
        [{"a": 10, "b": 6}, {"a": 1, "b": 1}, {"a": 1}, {}],
    ),
    (
        "chunked prefill splits a long prompt",
        {"budget": 16},
        [("a", 40, 2)],
        [{"a": 16}, {"a": 16}, {"a": 8}, {"a": 1}, {}],
    ),
    (
        "leftover budget goes to the next prompt's first chunk",
        {"budget": 16},
        [("a", 10, 2), ("b", 20, 1)],
        [{"a": 10, "b": 6}, {"a": 1, "b": 14}, {}],
    ),
    (
        "without chunking a prompt waits for a whole budget",
        {"budget": 16, "chunked": False},
        [("a", 10, 2), ("b", 12, 1)],
        [{"a": 10}, {"a": 1, "b": 12}, {}],
    ),
    (
        "max_num_seqs caps running requests",
        {"max_num_seqs": 1},
        [("a", 4, 2), ("b", 4, 1)],
        [{"a": 4}, {"a": 1}, {"b": 4}, {}],
    ),
]


@pytest.mark.parametrize(("name", "kwargs", "reqs", "expected"), CASES, ids=[c[0] for c in CASES])
def test_step_traces(
    name: str,
    kwargs: dict[str, Any],
    reqs: list[tuple[str, int, int]],
    expected: list[dict[str, int]],
) -> None:
    sched = make_scheduler(**kwargs)
    for rid, prompt_len, max_tokens in reqs:
        # distinct first tokens so prompts share no prefix
        sched.add_request(
            make_request(rid, prompt_len, max_tokens, first_token=100 * (ord(rid) - 96))
        )
    assert trace(sched, len(expected)) == expected
    assert not sched.has_requests()
    assert sched.kv.num_free_blocks == sched.kv.pool.num_blocks


@pytest.mark.parametrize(("caching", "recomputed"), [(False, 13), (True, 9)])
def test_preemption_recomputes_and_everything_finishes(caching: bool, recomputed: int) -> None:
    # 6 blocks of 4 tokens. a and b take 3 each for their prompts; a's growth preempts b (the
    # later one) after b sampled one token. b then recomputes prompt + that token (13), less
    # whatever prefix the cache still holds (one block survives a's growth when caching).
    sched = make_scheduler(num_blocks=6, budget=64, caching=caching)
    sched.add_request(make_request("a", 12, max_tokens=6, first_token=100))
    sched.add_request(make_request("b", 12, max_tokens=6, first_token=200))
    steps = trace(sched, 14)
    assert steps[:2] == [{"a": 12, "b": 12}, {"a": 1}]
    assert {"b": recomputed} in steps
    assert sched.stats().num_preemptions == 1
    assert not sched.has_requests()
    assert sched.kv.num_free_blocks == 6


def test_preempted_request_resumes_with_its_whole_block_table() -> None:
    sched = make_scheduler(num_blocks=6, budget=64)
    sched.add_request(make_request("a", 12, max_tokens=6, first_token=100))
    sched.add_request(make_request("b", 12, max_tokens=6, first_token=200))
    resumed = []
    for _ in range(30):
        so = sched.schedule()
        resumed += [c for c in so.cached_reqs if c.resumed_from_preemption]
        sched.update_from_output(so, fake_run(sched, so))
    assert resumed and all(len(c.new_block_ids[0]) >= 3 for c in resumed)


def test_prefix_hit_schedules_only_new_tokens() -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 13, max_tokens=1))
    trace(sched, 2)
    sched.add_request(make_request("b", 13, max_tokens=1))  # same prompt
    [step] = trace(sched, 1)
    assert step == {"b": 1}  # 12 tokens (3 blocks) cached, the last one recomputed
    assert sched.stats().prefix_hit_tokens == 12


def test_abort_frees_waiting_and_running_requests() -> None:
    sched = make_scheduler(max_num_seqs=1)
    sched.add_request(make_request("a", 8, max_tokens=100))
    sched.add_request(make_request("b", 8, max_tokens=100, first_token=50))
    trace(sched, 2)
    assert [r.request_id for r in sched.running] == ["a"]
    sched.finish_requests(["a", "b", "unknown"], RequestStatus.FINISHED_ABORTED)
    assert not sched.has_requests() and sched.kv.num_free_blocks == 64
    assert sched.schedule().finished_req_ids == {"a", "b"}


@pytest.mark.parametrize(
    ("params", "tokens", "reason", "n_out"),
    [
        ({}, [5, EOS, 6], FinishReason.STOP, 2),
        ({"ignore_eos": True}, [5, EOS, 6, 7], FinishReason.LENGTH, 4),
        ({"min_tokens": 3}, [EOS, EOS, EOS], FinishReason.STOP, 3),
        ({"stop_token_ids": [9]}, [5, 9, 6], FinishReason.STOP, 2),
        ({}, [5, 6, 7, 8], FinishReason.LENGTH, 4),
    ],
)
def test_finish_reasons(
    params: dict[str, Any], tokens: list[int], reason: FinishReason, n_out: int
) -> None:
    sched = make_scheduler()
    sched.add_request(make_request("a", 4, max_tokens=4, **params))
    finish = None
    for token in tokens:
        so = sched.schedule()
        for out in sched.update_from_output(so, fake_run(sched, so, token)):
            finish = out.finish_reason
        if finish is not None:
            break
    assert finish == reason
    assert not sched.has_requests()


def test_async_scheduling_schedules_a_step_ahead_of_the_tokens() -> None:
    """Step N+1 is scheduled before N's token is known: the request decodes on a placeholder,
    stops being scheduled once its last token is in flight, and ends when that token lands."""
    sched = make_scheduler(budget=32)
    sched.add_request(make_request("a", 6, max_tokens=3))
    s1 = sched.schedule()
    r1 = fake_run(sched, s1)
    s2 = sched.schedule()  # s1 has not reported yet
    r2 = fake_run(sched, s2)
    assert s1.num_scheduled_tokens == {"a": 6} and s2.num_scheduled_tokens == {"a": 1}
    [out] = sched.update_from_output(s1, r1)
    assert out.new_token_ids == [7] and out.finish_reason is None
    s3 = sched.schedule()
    r3 = fake_run(sched, s3)
    assert s3.num_scheduled_tokens == {"a": 1}  # its third and last token
    sched.update_from_output(s2, r2)
    assert sched.schedule().num_scheduled_tokens == {}  # 2 known + 1 in flight = max_tokens
    [last] = sched.update_from_output(s3, r3)
    assert last.finish_reason == FinishReason.LENGTH and not sched.has_requests()
    assert sched.kv.num_free_blocks == 64


def test_async_scheduling_drops_the_token_after_a_stop() -> None:
    sched = make_scheduler(budget=32)
    sched.add_request(make_request("a", 5, max_tokens=10))
    s1 = sched.schedule()
    r1 = fake_run(sched, s1, token=EOS)
    s2 = sched.schedule()
    r2 = fake_run(sched, s2)
    assert s2.num_scheduled_tokens == {"a": 1}
    [out] = sched.update_from_output(s1, r1)
    assert out.finish_reason == FinishReason.STOP
    assert sched.update_from_output(s2, r2) == []  # computed in vain, reported to nobody
    assert sched.kv.num_free_blocks == 64
    assert sched.schedule().finished_req_ids == {"a"}  # the runner drops its state


def test_async_scheduling_preempted_with_a_token_in_flight() -> None:
    """A request preempted while its token is in flight gets the token while waiting, and is
    not re-admitted before it lands."""
    sched = make_scheduler(num_blocks=4, budget=32)  # 16 tokens of KV
    sched.add_request(make_request("a", 7, max_tokens=6))
    sched.add_request(make_request("b", 7, max_tokens=6))
    pending, tokens, reasons = [], {"a": 0, "b": 0}, {}
    for _ in range(40):
        so = sched.schedule()
        pending.append((so, fake_run(sched, so)))
        if len(pending) == 2:
            so_done, run_done = pending.pop(0)
            for out in sched.update_from_output(so_done, run_done):
                tokens[out.request_id] += len(out.new_token_ids)
                reasons[out.request_id] = out.finish_reason
        if not sched.has_requests():
            break
    assert tokens == {"a": 6, "b": 6}
    assert reasons == {"a": FinishReason.LENGTH, "b": FinishReason.LENGTH}
    assert sched.stats().num_preemptions > 0
    assert sched.kv.num_free_blocks == 4


class RefusingGrammar:
    """A request's grammar (structured/manager.RequestGrammar) that refuses every token."""

    def __init__(self, completed: bool):
        self.matcher, self.error, self.completed, self.terminated = object(), None, completed, False
        self.refused: list[int] = []

    def ready(self, output_token_ids: list[int]) -> bool:
        return True

    def accept(self, token: int) -> bool:
        self.refused.append(token)
        return False


@pytest.mark.parametrize(("completed", "reason"), [(True, "stop"), (False, "error")])
def test_a_token_its_grammar_refuses_is_dropped(completed: bool, reason: str) -> None:
    """Sampled from a row the mask left empty: a whole grammar whose stop token min_tokens bans
    ends there (stop); any other refusal is an error. The token is never reported."""
    sched = make_scheduler()
    request = make_request("r", 10, max_tokens=8, min_tokens=4)
    request.grammar = RefusingGrammar(completed)  # type: ignore[assignment]
    sched.add_request(request)
    so = sched.schedule()
    [out] = sched.update_from_output(so, fake_run(sched, so))
    assert out.finish_reason == reason and out.new_token_ids == [] and out.new_logprobs is None
    assert request.output_token_ids == [] and not sched.has_requests()
    assert (out.error is None) == completed
