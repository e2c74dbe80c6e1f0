"""Routing as a pipeline, each stage a pure function of (request, candidate snapshot):

    filters (drop candidates) → scorers (each in [0, 1], weighted) → picker (one winner)

Plugins live in registries keyed by name; a policy is data:

    {"filters": ["role", "healthy", {"name": "capacity", "max_queue": 256}],
     "scorers": [{"name": "prefix", "weight": 2}, {"name": "queue", "weight": 1},
                 {"name": "kv_usage", "weight": 1}],
     "picker": "max"}

Filters
    role       the worker can run the request's leg (decode leg: role decode or both)
    healthy    not draining, not cordoned (its pod is being deleted, or the planner empties it)
    responsive its engine not stalled: with work and no step finished for over
               ``max_stalled_s`` (default 2; a hung engine core answers heartbeats still).
               Soft: when it would leave no candidate, it leaves them all (every worker in
               one long step is slow, not lost)
    capacity   queue depth (running + waiting + just routed) below ``max_queue``
Scorers
    prefix     fraction of the prompt's full blocks the worker already holds, or is about to
               hold (pending entries of requests just routed there: directory.py), those
               counted at ``pending_weight`` (default 1: like held blocks)
    queue      1 − depth / (largest depth among the candidates); 1 for every idle worker
    kv_usage   1 − the worker's fraction of KV blocks in use
    ttft       predicted time to first token, best / this: (prefill backlog + the prompt's
               uncached tokens) ÷ the worker's measured tokens/s (+ KV transfer time, zero for
               a colocated worker). One scorer that prices a prefix hit against a queue in
               seconds, instead of weights tuned by hand; see docs/routing.md for when it wins.
Pending entries (``"pending": {"ttl_s": 10}``)
    every route records its prompt's blocks as pending on the chosen worker (and on the
    prefill worker of a disaggregated request) until KV events confirm them or ``ttl_s``
    passes; ``ttl_s: 0`` records none (routing then waits for KV events, as before they
    existed)
Pickers
    max          highest weighted sum; ties go to the shorter queue, then to an order drawn
                 from a hash of (request id, worker id): replicas that see the same state make
                 the same choice, and equal workers share the load
    round_robin  ignore the scores, take turns (a baseline for benchmarks)
Deciders (the last stage, once the decode worker is picked: where the prompt runs, and why;
``"decider": {"name": "prefix_based", "min_uncached_tokens": 64, "max_prefill_queue": 4}``)
    prefix_based  (the default; ``name`` may be left out) a prefill-pool worker runs the
                  prompt and hands its KV over (NIXL) when the decode worker would compute at
                  least ``min_uncached_tokens`` of it itself (prompt − its prefix hits) and a
                  prefill worker has fewer than ``max_prefill_queue`` requests queued (picked
                  by the same pipeline, for the prefill leg); otherwise the decode worker
                  prefills locally: a saturated prefill pool overflows onto the decode pool
                  instead of queueing without bound. Without a prefill pool, always local.

    RoutingPolicy.route(query, candidates) → RouteDecision(decode, prefill | None, reason)
"""

import dataclasses
import inspect
import itertools
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any, Protocol

import xxhash

from services.global_scheduler.registry import WorkerState

DEFAULT_POLICY: dict[str, Any] = {
    "filters": ["role", "healthy", "responsive", {"name": "capacity", "max_queue": 1024}],
    "scorers": [
        {"name": "prefix", "weight": 2.0},
        {"name": "queue", "weight": 1.0},
        {"name": "kv_usage", "weight": 0.5},
    ],
    "picker": "max",
}


# How long a route's pending entries count without a KV event confirming them: a worker's
# events come every 0.5 s and a prompt's blocks are announced when the step that computes them
# is scheduled, so only a request that waits in a queue longer than this loses its entries.
DEFAULT_PENDING_TTL_S = 10.0


@dataclass(frozen=True)
class RouteQuery:
    model: str
    num_blocks: int  # full blocks in the prompt
    request_id: str = ""  # seeds the tie-break, so replicas agree
    num_prompt_tokens: int = 0
    leg: str = "decode"  # decode | prefill
    exclude: frozenset[str] = frozenset()


@dataclass
class Candidate:
    worker: WorkerState
    matched_blocks: int  # leading blocks it holds or is about to hold (the prefix directory)
    pending_blocks: int = 0  # of those, the ones only pending (not confirmed by KV events)
    scores: dict[str, float] = field(default_factory=dict)
    total: float = 0.0


class NoWorkerError(LookupError):
    """No live worker passes the filters; the message says which filter emptied the set."""


Filter = Callable[[RouteQuery, Candidate], bool]
Scorer = Callable[[RouteQuery, Candidate, list[Candidate]], float]

_LEG_ROLES = {"decode": ("decode", "both"), "prefill": ("prefill", "both")}


def _role(**_: Any) -> Filter:
    return lambda q, c: c.worker.role in _LEG_ROLES[q.leg]


def _healthy(**_: Any) -> Filter:
    return lambda q, c: (
        not c.worker.load.draining and not c.worker.cordoned and c.worker.worker_id not in q.exclude
    )


SOFT_FILTERS = {"responsive"}  # when one would leave no candidate, it leaves them all


def _responsive(max_stalled_s: float = 2.0, **_: Any) -> Filter:
    return lambda q, c: c.worker.load.engine_stalled_s <= max_stalled_s


def _capacity(max_queue: int = 1024, **_: Any) -> Filter:
    return lambda q, c: c.worker.queue_depth < max_queue


def _prefix(pending_weight: float = 1.0, **_: Any) -> Scorer:
    if not 0.0 <= pending_weight <= 1.0:
        raise ValueError("scorer prefix: pending_weight must be in [0, 1]")

    def score(q: RouteQuery, c: Candidate, _all: list[Candidate]) -> float:
        held = c.matched_blocks - (1.0 - pending_weight) * c.pending_blocks
        return held / q.num_blocks if q.num_blocks else 0.0

    return score


def _queue(**_: Any) -> Scorer:
    def score(q: RouteQuery, c: Candidate, all_: list[Candidate]) -> float:
        deepest = max(x.worker.queue_depth for x in all_)
        return 1.0 - c.worker.queue_depth / deepest if deepest else 1.0

    return score


def _kv_usage(**_: Any) -> Scorer:
    return lambda q, c, _all: 1.0 - min(max(c.worker.load.kv_usage, 0.0), 1.0)


def predicted_ttft(q: RouteQuery, c: Candidate, default_tokens_per_s: float) -> float:
    """Seconds until this worker could return the request's first token."""
    load = c.worker.load
    rate = load.tokens_per_s if load.tokens_per_s > 0 else default_tokens_per_s
    uncached = max(q.num_prompt_tokens - c.matched_blocks * c.worker.block_size, 1)
    return (load.pending_prefill_tokens + uncached) / rate


def _ttft(default_tokens_per_s: float = 10_000.0, **_: Any) -> Scorer:
    def score(q: RouteQuery, c: Candidate, all_: list[Candidate]) -> float:
        best = min(predicted_ttft(q, x, default_tokens_per_s) for x in all_)
        return best / predicted_ttft(q, c, default_tokens_per_s)

    return score


FILTERS: dict[str, Callable[..., Filter]] = {
    "role": _role,
    "healthy": _healthy,
    "responsive": _responsive,
    "capacity": _capacity,
}
SCORERS: dict[str, Callable[..., Scorer]] = {
    "prefix": _prefix,
    "queue": _queue,
    "kv_usage": _kv_usage,
    "ttft": _ttft,
}
PICKERS = ("max", "round_robin")


def _spec(item: str | dict[str, Any], kind: str, known: dict[str, Any]) -> tuple[str, dict]:
    spec = {"name": item} if isinstance(item, str) else dict(item)
    name = spec.pop("name", None)
    if name not in known:
        raise ValueError(f"unknown {kind} {name!r}; known: {', '.join(sorted(known))}")
    return name, spec


class RoutingPolicy:
    def __init__(self, policy: dict[str, Any] | None = None):
        unknown = set(policy or {}) - {"filters", "scorers", "picker", "decider", "pending"}
        if unknown:
            raise ValueError(f"unknown routing policy keys: {sorted(unknown)}")
        policy = {**DEFAULT_POLICY, **(policy or {})}  # a key left out keeps its default
        # The role filter is not a preference: a leg never goes to a worker that cannot run it.
        self.filters: list[tuple[str, Filter]] = [("role", _role())]
        for item in policy["filters"]:
            name, kw = _spec(item, "filter", FILTERS)
            if name != "role":
                self.filters.append((name, FILTERS[name](**kw)))
        self.scorers: list[tuple[str, float, Scorer]] = []
        for item in policy["scorers"]:
            name, kw = _spec(item, "scorer", SCORERS)
            weight = float(kw.pop("weight", 1.0))
            if weight < 0:
                raise ValueError(f"scorer {name}: weight must be >= 0")
            self.scorers.append((name, weight, SCORERS[name](**kw)))
        self.picker = policy.get("picker", "max")
        if self.picker not in PICKERS:
            raise ValueError(f"unknown picker {self.picker!r}; known: {', '.join(PICKERS)}")
        self._turn = itertools.count()
        self.decider = make_decider(policy.get("decider", {}))
        pending = dict(policy.get("pending", {}))
        self.pending_ttl_s = float(pending.pop("ttl_s", DEFAULT_PENDING_TTL_S))
        if pending or self.pending_ttl_s < 0:
            raise ValueError("pending takes ttl_s (>= 0 seconds; 0: record no pending entries)")

    def route(self, query: RouteQuery, candidates: list[Candidate]) -> "RouteDecision":
        """The whole pipeline: the decode worker (``pick``), then the decider's choice of
        where the prompt runs. Raises NoWorkerError when no decode worker passes."""
        decode = self.pick(query, candidates)
        return self.decider.decide(query, decode, candidates, self.pick)

    def filter(self, query: RouteQuery, candidates: list[Candidate]) -> list[Candidate]:
        for name, keep in self.filters:
            kept = [c for c in candidates if keep(query, c)]
            if not kept and name in SOFT_FILTERS:
                continue
            if not kept:
                raise NoWorkerError(
                    f"no worker for model {query.model!r} passes the {name!r} filter "
                    f"({len(candidates)} before it)"
                )
            candidates = kept
        return candidates

    def pick(self, query: RouteQuery, candidates: list[Candidate]) -> Candidate:
        """Filter, score and pick; the winner carries its scores (for the route's reason)."""
        if not candidates:
            raise NoWorkerError(f"no live worker serves model {query.model!r}")
        candidates = self.filter(query, candidates)
        if self.picker == "round_robin":
            ordered = sorted(candidates, key=lambda c: c.worker.worker_id)
            return ordered[next(self._turn) % len(ordered)]
        for c in candidates:
            c.scores = {name: scorer(query, c, candidates) for name, _, scorer in self.scorers}
            c.total = sum(w * c.scores[name] for name, w, _ in self.scorers)

        def rank(c: Candidate) -> tuple[float, int, bytes]:
            draw = xxhash.xxh3_64_digest(f"{query.request_id}/{c.worker.worker_id}".encode())
            return (-c.total, c.worker.queue_depth, draw)

        return min(candidates, key=rank)

    @staticmethod
    def reason(c: Candidate) -> str:
        parts = " ".join(f"{k}={v:.2f}" for k, v in c.scores.items())
        return f"{c.worker.worker_id}: {parts} total={c.total:.2f}"


class Reason(StrEnum):
    """Why the decider chose as it did (the ``reason`` label of the decisions metric)."""

    NO_PREFILL_POOL = "no_prefill_pool"  # no worker of role prefill: local
    SHORT_PROMPT = "short_prompt"  # too few uncached tokens to pay for a transfer: local
    POOL_BUSY = "pool_busy"  # every prefill worker is full, draining or excluded: local
    LONG_PROMPT = "long_prompt"  # disaggregated


@dataclass(frozen=True)
class RouteDecision:
    decode: Candidate  # runs the decode leg (and the prompt, when prefill is None)
    prefill: Candidate | None  # runs the prompt and hands its KV over; None: local prefill
    reason: Reason


Picker = Callable[[RouteQuery, list[Candidate]], Candidate]  # RoutingPolicy.pick


class Decider(Protocol):
    def decide(
        self, query: RouteQuery, decode: Candidate, candidates: list[Candidate], pick: Picker
    ) -> RouteDecision:
        """Given the picked decode worker and every live candidate of the model. Pure: it
        reads the snapshot and changes nothing but the scores ``pick`` writes."""
        ...


class PrefixBasedDecider:
    def __init__(self, min_uncached_tokens: int = 64, max_prefill_queue: int = 4):
        if min_uncached_tokens < 0 or max_prefill_queue < 1:
            raise ValueError(
                "decider prefix_based takes min_uncached_tokens (>= 0) and max_prefill_queue (>= 1)"
            )
        self.min_uncached_tokens = min_uncached_tokens
        self.max_prefill_queue = max_prefill_queue

    def decide(
        self, query: RouteQuery, decode: Candidate, candidates: list[Candidate], pick: Picker
    ) -> RouteDecision:
        pool = [c for c in candidates if c.worker.role == "prefill"]
        if not pool:
            return RouteDecision(decode, None, Reason.NO_PREFILL_POOL)
        uncached = query.num_prompt_tokens - decode.matched_blocks * decode.worker.block_size
        if uncached < self.min_uncached_tokens:
            return RouteDecision(decode, None, Reason.SHORT_PROMPT)
        room = [Candidate(c.worker, c.matched_blocks) for c in pool
                if c.worker.queue_depth < self.max_prefill_queue]  # fmt: skip
        try:
            prefill = pick(dataclasses.replace(query, leg="prefill"), room)
        except NoWorkerError:
            return RouteDecision(decode, None, Reason.POOL_BUSY)
        return RouteDecision(decode, prefill, Reason.LONG_PROMPT)


DECIDERS: dict[str, Callable[..., Decider]] = {"prefix_based": PrefixBasedDecider}


def make_decider(spec: dict[str, Any]) -> Decider:
    """The policy's ``decider`` entry: its ``name`` (default prefix_based) and settings."""
    kw = dict(spec)
    name = kw.pop("name", "prefix_based")
    if name not in DECIDERS:
        raise ValueError(f"unknown decider {name!r}; known: {', '.join(sorted(DECIDERS))}")
    accepted = set(inspect.signature(DECIDERS[name]).parameters)
    if set(kw) - accepted:
        raise ValueError(
            f"decider takes only {name}'s settings ({', '.join(sorted(accepted))}); unknown "
            f"settings {sorted(set(kw) - accepted)}"
        )
    return DECIDERS[name](**kw)
