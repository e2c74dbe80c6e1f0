"""Routing that does not wait for KV events: each route records its prompt's blocks as pending
on the workers it chose, so a request right behind it over the same prefix follows it."""

import pytest
from prometheus_client import REGISTRY

from services.global_scheduler.directory import InMemoryDirectory, Match
from services.global_scheduler.registry import WorkerLoad, WorkerRegistry, WorkerState
from services.global_scheduler.routing import Candidate, RouteQuery, RoutingPolicy
from services.global_scheduler.server import SchedulerServicer
from shared.block_hash import hash_blocks
from shared.ids import WorkerId
from shared.kv_events import BlockStored, KVEventBatch
from shared.protos.baton.v1 import scheduler_pb2
from tests.helpers import worker

HASHES = hash_blocks(list(range(16 * 64)), 16)  # a 1,024-token prompt's 64 blocks


def cluster(roles: list[str], policy: dict | None = None) -> SchedulerServicer:
    registry = WorkerRegistry(60.0)
    for i, role in enumerate(roles):
        w = WorkerState(WorkerId(f"w{i}"), "i", role, f"w{i}:1", "m", 4096, 16, 1000)
        w.load = WorkerLoad()
        registry.register(w)
    return SchedulerServicer(registry, InMemoryDirectory(), RoutingPolicy(policy))


async def route(s: SchedulerServicer, i: int) -> scheduler_pb2.RouteResponse:
    """Request i over the prompt, the previous one finished (as a gateway reports it)."""
    return await s.route(
        scheduler_pb2.RouteRequest(
            request_id=f"r{i}", model="m", block_hashes=HASHES, num_prompt_tokens=1024,
            finished_request_ids=[f"r{i - 1}"] if i else [],
        )
    )  # fmt: skip


def predicted(source: str) -> float:
    value = REGISTRY.get_sample_value(
        "baton_scheduler_predicted_prefix_hit_tokens_total", {"source": source}
    )
    return value or 0.0


@pytest.mark.parametrize("workers", [2, 4])
async def test_back_to_back_requests_follow_the_first(workers: int) -> None:
    s = cluster(["both"] * workers)
    before = predicted("pending")
    first = await route(s, 0)
    for i in range(1, 8):  # no KV event has arrived: only the pending entries know
        again = await route(s, i)
        assert again.decode.worker_id == first.decode.worker_id
        assert again.decode.matched_blocks == 64
    assert predicted("pending") - before == 7 * 1024


async def test_without_pending_entries_they_scatter() -> None:
    """The policy's ``pending: {ttl_s: 0}``: what routing did before (the control)."""
    s = cluster(["both"] * 4, {"pending": {"ttl_s": 0}})
    chosen = {(await route(s, i)).decode.worker_id for i in range(8)}
    assert len(chosen) > 1


async def test_disaggregated_records_both_legs() -> None:
    s = cluster(["prefill", "decode", "decode"], {"decider": {"min_uncached_tokens": 64}})
    first = await route(s, 0)
    assert first.HasField("prefill")
    live = {WorkerId(f"w{i}"): "i" for i in range(3)}
    matches = await s.directory.longest_prefix(HASHES, live)
    assert matches[WorkerId(first.decode.worker_id)] == Match(0, 64)
    assert matches[WorkerId(first.prefill.worker_id)] == Match(0, 64)
    second = await route(s, 1)  # the decode worker is about to hold it all: local, same one
    assert second.decode.worker_id == first.decode.worker_id
    assert not second.HasField("prefill")


async def test_kv_events_confirm_pending_entries() -> None:
    s = cluster(["both", "both"])
    first = await route(s, 0)
    w = WorkerId(first.decode.worker_id)
    await s.directory.apply(w, "i", KVEventBatch(1, [BlockStored(HASHES, None, 16)]))
    assert (await s.directory.longest_prefix(HASHES, {w: "i"}))[w] == Match(64, 0)


def test_pending_blocks_count_at_their_weight() -> None:
    q = RouteQuery("m", num_blocks=10)
    held, pending = Candidate(worker("a"), 8), Candidate(worker("b"), 8, pending_blocks=8)
    full = RoutingPolicy()  # pending counts like held
    assert full.pick(q, [held]).scores["prefix"] == full.pick(q, [pending]).scores["prefix"]
    half = RoutingPolicy({"scorers": [{"name": "prefix", "pending_weight": 0.5}]})
    assert half.pick(q, [pending]).scores["prefix"] == pytest.approx(0.4)
    assert half.pick(q, [held, pending]).worker.worker_id == "a"


@pytest.mark.parametrize(
    ("policy", "match"),
    [
        ({"pending": {"ttl_s": -1}}, "pending takes ttl_s"),
        ({"pending": {"ttl": 3}}, "pending takes ttl_s"),
        ({"scorers": [{"name": "prefix", "pending_weight": 2}]}, "pending_weight"),
    ],
)
def test_bad_pending_settings_are_refused(policy: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        RoutingPolicy(policy)
