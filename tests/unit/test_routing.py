"""The routing pipeline: filters, scorers, picker, and policies given as data."""

import pytest

from services.global_scheduler.registry import WorkerState
from services.global_scheduler.routing import (
    Candidate,
    NoWorkerError,
    RouteQuery,
    RoutingPolicy,
)
from tests.helpers import worker

Q = RouteQuery("m", num_blocks=10)


def test_prefix_match_wins_over_a_small_load_difference() -> None:
    policy = RoutingPolicy()
    a, b = Candidate(worker("a", running=2), 8), Candidate(worker("b", running=1), 0)
    best = policy.pick(Q, [a, b])
    assert best.worker.worker_id == "a"
    assert "prefix=0.80" in policy.reason(best)


def test_without_prefixes_the_shorter_queue_wins() -> None:
    best = RoutingPolicy().pick(Q, [Candidate(worker("a", running=5), 0),
                                    Candidate(worker("b", running=1), 0)])  # fmt: skip
    assert best.worker.worker_id == "b"


def test_equal_workers_share_the_load_and_replicas_agree() -> None:
    workers = [worker("a"), worker("b"), worker("c")]
    a, b = RoutingPolicy(), RoutingPolicy()  # two scheduler replicas
    picks = []
    for i in range(300):
        q = RouteQuery("m", 10, request_id=f"req-{i}")
        pick = a.pick(q, [Candidate(w, 0) for w in workers]).worker.worker_id
        assert b.pick(q, [Candidate(w, 0) for w in workers]).worker.worker_id == pick
        picks.append(pick)
    assert all(picks.count(w) > 60 for w in "abc")


def test_round_robin_ignores_scores() -> None:
    policy = RoutingPolicy({"filters": ["role"], "picker": "round_robin"})
    workers = [worker("a"), worker("b")]
    picks = [policy.pick(Q, [Candidate(workers[0], 10), Candidate(workers[1], 0)]).worker.worker_id
             for _ in range(4)]  # fmt: skip
    assert picks == ["a", "b", "a", "b"]


def test_ttft_scorer_prices_a_prefix_hit_against_a_backlog() -> None:
    policy = RoutingPolicy({"scorers": [{"name": "ttft"}]})
    q = RouteQuery("m", num_blocks=60, num_prompt_tokens=960)
    holder, idle = worker("holder"), worker("idle")
    holder.load.tokens_per_s = idle.load.tokens_per_s = 10_000.0
    # The holder has 50 of 60 blocks cached; its backlog of 2,000 tokens costs more than the
    # 800 tokens it saves: the idle worker answers first (0.096 s vs 0.216 s).
    holder.load.pending_prefill_tokens = 2_000
    assert policy.pick(q, [Candidate(holder, 50), Candidate(idle, 0)]).worker.worker_id == "idle"
    holder.load.pending_prefill_tokens = 500  # now the hit wins (0.066 s vs 0.096 s)
    assert policy.pick(q, [Candidate(holder, 50), Candidate(idle, 0)]).worker.worker_id == "holder"


def test_filters_role_draining_capacity_and_exclusions() -> None:
    policy = RoutingPolicy({"filters": ["role", "healthy", {"name": "capacity", "max_queue": 4}]})
    cands = [
        Candidate(worker("prefill-only", role="prefill"), 10),
        Candidate(worker("draining", draining=True), 10),
        Candidate(worker("full", running=4), 10),
        Candidate(worker("excluded"), 10),
        Candidate(worker("ok", role="decode"), 0),
    ]
    q = RouteQuery("m", 10, exclude=frozenset({"excluded"}))
    assert policy.pick(q, cands).worker.worker_id == "ok"


def test_a_stalled_engine_gets_nothing_new() -> None:
    """A worker whose engine has had work and finished no step for over ``max_stalled_s``
    (a hung engine core: its service still answers heartbeats) is left out, even when it
    holds the prompt's blocks; one stalled for less is not."""
    hung, other = worker("hung"), worker("other", running=3)
    hung.load.engine_stalled_s = 2.5
    policy = RoutingPolicy()
    assert policy.pick(Q, [Candidate(hung, 10), Candidate(other, 0)]).worker.worker_id == "other"
    hung.load.engine_stalled_s = 1.0
    assert policy.pick(Q, [Candidate(hung, 10), Candidate(other, 0)]).worker.worker_id == "hung"
    strict = RoutingPolicy({"filters": ["role", {"name": "responsive", "max_stalled_s": 0.5}]})
    assert strict.pick(Q, [Candidate(hung, 10), Candidate(other, 0)]).worker.worker_id == "other"
    other.load.engine_stalled_s = 3.0  # every worker in a long step: slow, not lost
    assert policy.pick(Q, [Candidate(hung, 10), Candidate(other, 0)]).worker.worker_id == "hung"


def test_no_candidate_names_the_filter() -> None:
    policy = RoutingPolicy()
    with pytest.raises(NoWorkerError, match="'healthy'"):
        policy.pick(Q, [Candidate(worker("a", draining=True), 0)])
    with pytest.raises(NoWorkerError, match="no live worker"):
        policy.pick(Q, [])


def test_weights_are_data() -> None:
    kv_only = RoutingPolicy({"scorers": [{"name": "kv_usage", "weight": 1}]})
    a, b = Candidate(worker("a", kv=0.9), 10), Candidate(worker("b", kv=0.1), 0)
    assert kv_only.pick(Q, [a, b]).worker.worker_id == "b"
    prefix_only = RoutingPolicy({"scorers": [{"name": "prefix", "weight": 3}]})
    best = prefix_only.pick(Q, [a, b])
    assert best.worker.worker_id == "a" and best.total == pytest.approx(3.0)


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        (
            {"filters": ["nope"]},
            "unknown filter 'nope'; known: capacity, healthy, responsive, role",
        ),
        ({"picker": "random"}, "known: max, round_robin"),
        ({"scorers": [{"name": "magic"}]}, "unknown scorer"),
        ({"picker": "random"}, "unknown picker"),
        ({"scorers": [{"name": "queue", "weight": -1}]}, "weight"),
        ({"filter": []}, "unknown routing policy keys"),
        ({"decider": {"max_prefill_queue": 0}}, "max_prefill_queue"),
        ({"decider": {"threshold": 3}}, "decider takes"),
    ],
)
def test_bad_policies_are_clear_errors(policy: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RoutingPolicy(policy)


def test_the_decider_sends_long_prompts_to_a_prefill_worker_with_room() -> None:
    """Short prompts (or mostly cached ones) prefill on the decode worker; long ones go to the
    prefill pool, until every prefill worker holds ``max_prefill_queue`` requests: then the
    overflow prefills locally instead of queueing without bound."""
    policy = RoutingPolicy({"decider": {"min_uncached_tokens": 64, "max_prefill_queue": 2}})
    decode, p0, p1 = worker("d", "decode"), worker("p0", "prefill"), worker("p1", "prefill")
    workers = [decode, p0, p1]

    def decide(prompt_tokens: int, hit_blocks: int = 0) -> WorkerState | None:
        q = RouteQuery("m", -(-prompt_tokens // 16), request_id="r",
                       num_prompt_tokens=prompt_tokens)  # fmt: skip
        candidates = [Candidate(w, 0) for w in workers]
        chosen = policy.decider.decide(q, Candidate(decode, hit_blocks), candidates, policy.pick)
        return None if chosen.prefill is None else chosen.prefill.worker

    assert decide(40) is None  # short
    assert decide(400, hit_blocks=22) is None  # 400 - 352 cached = 48 uncached: short
    assert decide(400) in (p0, p1)
    p0.load.num_waiting = 2  # full
    assert decide(400) is p1
    p1.routed("x")  # full too: the decode worker prefills it
    p1.routed("y")
    assert decide(400) is None
    p0.load.num_waiting = 1
    assert decide(400) is p0
