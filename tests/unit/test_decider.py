"""The P/D decider, the routing pipeline's last stage: where the prompt runs, and why."""

import pytest

from services.global_scheduler.routing import (
    Candidate,
    NoWorkerError,
    Reason,
    RouteQuery,
    RoutingPolicy,
)
from tests.helpers import worker

BLOCK = 16  # tokens per block (test_routing.worker)


def decide(
    policy: RoutingPolicy, prompt_tokens: int, candidates: list[Candidate]
) -> tuple[str, str | None, Reason]:
    q = RouteQuery("m", prompt_tokens // BLOCK, request_id="r", num_prompt_tokens=prompt_tokens)
    d = policy.route(q, candidates)
    return d.decode.worker.worker_id, d.prefill.worker.worker_id if d.prefill else None, d.reason


CASES = [
    # name, policy decider, prompt tokens, [(id, role, running, matched blocks)], decision
    ("no prefill pool: local", {}, 1000, [("d", "decode", 0, 0), ("b", "both", 3, 0)],
     ("d", None, Reason.NO_PREFILL_POOL)),
    ("long uncached prompt: disaggregated", {}, 1000,
     [("d", "decode", 0, 0), ("p", "prefill", 0, 0)], ("d", "p", Reason.LONG_PROMPT)),
    ("short prompt: local", {}, 63, [("d", "decode", 0, 0), ("p", "prefill", 0, 0)],
     ("d", None, Reason.SHORT_PROMPT)),
    ("threshold is inclusive", {}, 64, [("d", "decode", 0, 0), ("p", "prefill", 0, 0)],
     ("d", "p", Reason.LONG_PROMPT)),
    ("a decode-side prefix hit makes it short", {}, 1000,
     [("d", "decode", 0, 60), ("p", "prefill", 0, 0)], ("d", None, Reason.SHORT_PROMPT)),
    ("every prefill worker full: local", {}, 1000,
     [("d", "decode", 0, 0), ("p", "prefill", 4, 0), ("q", "prefill", 9, 0)],
     ("d", None, Reason.POOL_BUSY)),
    ("the prefill leg takes the one with room", {}, 1000,
     [("d", "decode", 0, 0), ("p", "prefill", 4, 0), ("q", "prefill", 3, 0)],
     ("d", "q", Reason.LONG_PROMPT)),
    ("the prefill leg prefers its prefix", {}, 1000,
     [("d", "decode", 0, 0), ("p", "prefill", 1, 0), ("q", "prefill", 1, 50)],
     ("d", "q", Reason.LONG_PROMPT)),
    ("settings are data", {"min_uncached_tokens": 2000, "max_prefill_queue": 1}, 1000,
     [("d", "decode", 0, 0), ("p", "prefill", 0, 0)], ("d", None, Reason.SHORT_PROMPT)),
    ("named explicitly", {"name": "prefix_based", "min_uncached_tokens": 0}, 16,
     [("d", "decode", 0, 0), ("p", "prefill", 0, 0)], ("d", "p", Reason.LONG_PROMPT)),
]  # fmt: skip


@pytest.mark.parametrize(("name", "spec", "tokens", "workers", "want"), CASES,
                         ids=[c[0] for c in CASES])  # fmt: skip
def test_decisions(name: str, spec: dict, tokens: int, workers: list, want: tuple) -> None:
    policy = RoutingPolicy({"decider": spec})
    candidates = [Candidate(worker(w, role, running), m) for w, role, running, m in workers]
    assert decide(policy, tokens, candidates) == want


def test_a_prefill_worker_is_never_the_decode_worker() -> None:
    policy = RoutingPolicy()
    with pytest.raises(NoWorkerError):
        policy.route(
            RouteQuery("m", 10, num_prompt_tokens=160), [Candidate(worker("p", "prefill"), 0)]
        )


def test_draining_prefill_worker_is_not_picked() -> None:
    candidates = [
        Candidate(worker("d", "decode"), 0),
        Candidate(worker("p", "prefill", draining=True), 0),
    ]
    assert decide(RoutingPolicy(), 1000, candidates) == ("d", None, Reason.POOL_BUSY)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"name": "nope"}, "unknown decider 'nope'; known: prefix_based"),
        ({"min_uncached_tokens": -1}, "min_uncached_tokens (>= 0)"),
        ({"max_prefill_queue": 0}, "max_prefill_queue"),
        ({"bogus": 1}, "unknown settings ['bogus']"),
        ({"name": "prefix_based", "threshold": 3}, "max_prefill_queue, min_uncached_tokens"),
    ],
)
def test_bad_decider_settings_are_refused(spec: dict, message: str) -> None:
    with pytest.raises(
        ValueError,
        match=message.replace("(", r"\(")
        .replace(")", r"\)")
        .replace("[", r"\[")
        .replace("]", r"\]"),
    ):
        RoutingPolicy({"decider": spec})
