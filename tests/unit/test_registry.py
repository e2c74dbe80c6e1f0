"""WorkerRegistry: registration, replacement by a new incarnation, heartbeats and expiry."""

import pytest

from services.global_scheduler.registry import (
    IN_TRANSIT_S,
    RECONNECT_S,
    WorkerLoad,
    WorkerRegistry,
    WorkerState,
)
from shared.ids import WorkerId


def state(worker: str, incarnation: str = "a", role: str = "both") -> WorkerState:
    return WorkerState(WorkerId(worker), incarnation, role, f"{worker}:1", "m", 1024, 16, 100)


def test_register_heartbeat_and_remove() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    assert reg.register(state("w1")) is None
    assert reg.heartbeat(WorkerId("w1"), "a", WorkerLoad(num_running=3))
    assert reg.get(WorkerId("w1")).load.num_running == 3  # type: ignore[union-attr]
    assert reg.remove(WorkerId("w1"), "a") is not None
    assert reg.workers() == []


def test_new_incarnation_replaces_and_the_old_stream_cannot_remove_it() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    reg.register(state("w1", "old"))
    replaced = reg.register(state("w1", "new"))
    assert replaced is not None and replaced.incarnation == "old"
    assert not reg.heartbeat(WorkerId("w1"), "old", WorkerLoad())
    assert reg.remove(WorkerId("w1"), "old") is None  # the old stream ending later
    assert [w.incarnation for w in reg.workers()] == ["new"]


def test_expire_drops_only_silent_workers() -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    a, b = state("a"), state("b")
    reg.register(a)
    reg.register(b)
    a.last_seen, b.last_seen = 100.0, 101.0
    assert [w.worker_id for w in reg.expire(now=102.0).expired] == ["a"]
    assert [w.worker_id for w in reg.workers()] == ["b"]
    assert a.dropped == "missed heartbeats for 2.0 s" and b.dropped == ""


# (what happens, the worker's last heartbeat, the sweeps: (now, expired?, stalled?)); the
# timeout is 1.5 s, so a sweep more than 0.75 s after the previous one finds the scheduler
# itself stalled; the first sweep has no previous one
STALLS = [
    ("on time: the silent worker goes", 99.0,
     [(100.0, False, False), (100.25, False, False), (100.75, True, False)]),
    ("a gap just under the stall bound is an ordinary sweep", 99.0,
     [(100.0, False, False), (100.7, True, False)]),
    ("stopped 10 s: a worker heard just before stays, and goes once silent as long again",
     99.9, [(100.0, False, False), (110.0, False, True), (110.5, False, False),
            (111.0, False, False), (111.5, True, False)]),
    ("stopped 10 s: a worker already silent 1 s goes 0.75 s after the stall, not at once",
     99.0, [(100.0, False, False), (110.0, False, True), (110.25, False, False),
            (110.5, False, False), (110.75, True, False)]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("last_seen", "sweeps"), [c[1:] for c in STALLS], ids=[c[0] for c in STALLS]
)
def test_a_scheduler_that_stalled_expires_nobody_on_its_late_sweep(
    last_seen: float, sweeps: list[tuple[float, bool, bool]]
) -> None:
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    w = state("w")
    reg.register(w)
    w.last_seen = last_seen
    previous = 0.0
    for now, expired, stalled in sweeps:
        expiry = reg.expire(now=now)
        assert [x.worker_id for x in expiry.expired] == (["w"] if expired else []), now
        assert expiry.stalled_s == (pytest.approx(now - previous) if stalled else 0.0), now
        previous = now
    assert reg.workers() == []


# (what happens, the sweeps before (their times), when the stream ends, clean?, removed?);
# the timeout is 1.5 s, so the scheduler counts as stalled more than 0.75 s after a sweep and
# for 1.5 s after a sweep that found a stall
STREAM_ENDS = [
    ("a clean end removes at once", [100.0], 100.1, True, True),
    ("a break while the scheduler runs removes at once", [100.0, 100.25], 100.3, False, True),
    ("a break seen before the late sweep: the scheduler is stalled", [100.0], 110.0, False,
     False),
    ("a break seen just after the late sweep", [100.0, 110.0], 110.01, False, False),
    ("a break 1.5 s after that sweep (sweeps on time since) still counts as the stall's",
     [100.0, 110.0, 110.5, 111.0, 111.5], 111.5, False, False),
    ("a break later than that removes at once", [100.0, 110.0, 110.5, 111.0, 111.5], 111.6,
     False, True),
    ("a goodbye right after a stall still removes", [100.0, 110.0], 110.01, True, True),
    ("no sweep yet: nothing has stalled", [], 100.0, False, True),
]  # fmt: skip


@pytest.mark.parametrize(
    ("sweeps", "end", "clean", "removed"), [c[1:] for c in STREAM_ENDS],
    ids=[c[0] for c in STREAM_ENDS],
)  # fmt: skip
def test_a_stream_that_broke_for_the_schedulers_own_stall_keeps_its_worker(
    sweeps: list[float], end: float, clean: bool, removed: bool
) -> None:
    """The scheduler's stall made its workers' pings go unanswered, so their transports
    closed: the breaks it sees on waking are its own doing, and the workers are reconnecting
    (the stall that made CI's request find no worker for a few milliseconds)."""
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    w = state("w")
    reg.register(w)
    for now in sweeps:
        w.last_seen = now  # heard at every sweep: only the stream's end can remove it
        reg.expire(now=now)
    assert reg.stream_ended(w, clean, now=end) is removed
    assert reg.workers() == ([] if removed else [w])


def test_a_worker_kept_for_a_stall_that_never_comes_back_is_removed_unannounced() -> None:
    """Detached (its stream broke in the stall), it has the heartbeat timeout and RECONNECT_S
    to register again; then the sweep removes it as one whose stream ended, not as a hung
    worker (``expired``: the gateways are told)."""
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    w, other = state("w"), state("other")
    for s in (w, other):
        reg.register(s)
        s.last_seen = 100.0
    reg.expire(now=100.0)
    assert not reg.stream_ended(w, clean=False, now=110.0) and w.detached
    assert reg.expire(now=110.0).stalled_s == 10.0  # both credited to 110
    now, removed = 110.0, []
    while now < 110.0 + 1.5 + RECONNECT_S + 0.5:
        now += 0.25
        other.last_seen = now
        expiry = reg.expire(now=now)
        assert expiry.expired == []
        removed += [(now, w.worker_id) for w in expiry.detached]
    assert removed == [(110.0 + 1.5 + RECONNECT_S + 0.25, "w")]  # the first sweep past both
    assert reg.workers() == [other]


def test_an_old_stream_ending_leaves_its_successor_of_the_same_incarnation() -> None:
    """A worker whose stream broke registers again as it was (same incarnation); when the old
    stream's end is processed after that, the new entry stays."""
    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    old, new = state("w"), state("w")
    reg.register(old)
    reg.register(new)
    assert not reg.stream_ended(old, clean=True)
    assert reg.workers() == [new]
    assert reg.stream_ended(new, clean=True) and reg.workers() == []


def test_queue_depth_counts_what_was_just_routed() -> None:
    w = state("w")
    w.load = WorkerLoad(num_running=2, num_waiting=1)
    for i in range(4):
        w.routed(f"r{i}")
    assert w.queue_depth == 7
    reg = WorkerRegistry(1.5)
    reg.register(w)
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_running=5))
    assert w.queue_depth == 5  # a worker that does not count receipts: the load includes them


def test_only_requests_the_worker_has_not_received_stay_in_transit() -> None:
    """Short requests routed and finished between two heartbeats are not queued there: the
    heartbeat's receipt count retires them (they used to count until the next heartbeat, so
    a burst of quick sequential requests made a worker look several deep)."""
    reg = WorkerRegistry(1.5)
    w = state("w")
    reg.register(w)
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_received=10))
    for i in range(7):
        w.routed(f"r{i}")
    assert w.queue_depth == 7
    # it received 5 of them, all done by now; 2 are still on their way
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_received=15))
    assert w.in_transit == 2 and w.queue_depth == 2
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_received=17, num_running=2))
    assert w.in_transit == 0 and w.queue_depth == 2


def test_a_route_never_delivered_stops_counting() -> None:
    """A routed request the worker never receives (its client left first) does not count
    for ever: after IN_TRANSIT_S it is dropped."""
    w = state("w")
    w.routed("a")
    w.routed("b")
    assert w.in_transit == 2
    w.routes["a"].at -= IN_TRANSIT_S + 0.1  # routed that long ago
    assert w.in_transit == 1


def test_a_finished_request_stops_counting_at_once() -> None:
    """The gateway's finished notice (with its next Route call) retires a route before any
    heartbeat; the receipt count then still lines up with the routes in order."""
    reg = WorkerRegistry(1.5)
    w = state("w")
    reg.register(w)
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_received=1))
    for rid in ("a", "b", "c"):
        w.routed(rid)
    w.finished("a")
    w.finished("unknown")  # routed elsewhere: ignored
    assert w.in_transit == 2
    reg.heartbeat(WorkerId("w"), "a", WorkerLoad(num_received=3, num_running=1))  # got a, b
    assert list(w.routes) == ["c"] and w.queue_depth == 2


def test_cordon_outlives_a_reregistration_and_routing_skips_it() -> None:
    """Pod discovery cordons a pod being deleted; its worker reconnecting (a new incarnation)
    is still cordoned; the healthy filter routes around it; only the same reason frees it."""
    from services.global_scheduler.routing import Candidate, RouteQuery, RoutingPolicy

    reg = WorkerRegistry(heartbeat_timeout_s=1.5)
    reg.register(state("w1"))
    reg.register(state("w2"))
    assert reg.cordon(WorkerId("w1"), "pod-deleting")
    reg.register(state("w1", "b"))  # it reconnects
    assert reg.get(WorkerId("w1")).cordoned  # type: ignore[union-attr]
    policy = RoutingPolicy()
    for _ in range(20):
        decision = policy.route(RouteQuery("m", 0), [Candidate(w, 0) for w in reg.workers()])
        assert decision.decode.worker.worker_id == "w2"
    assert not reg.uncordon(WorkerId("w1"), "planner")  # not the planner's to free
    assert reg.uncordon(WorkerId("w1"), "pod-deleting")
    assert not reg.get(WorkerId("w1")).cordoned and reg.cordoned() == {}  # type: ignore[union-attr]


def test_a_registration_is_bounded_at_the_edge() -> None:
    from services.global_scheduler.convert import MAX_DESCRIPTION, registration, worker_state
    from shared.protos.baton.v1 import common_pb2, scheduler_pb2

    reg = scheduler_pb2.WorkerRegistration(
        worker_id="w", incarnation="i", role=common_pb2.WORKER_ROLE_BOTH, address="h:1",
        model="m", block_size=16, quantization="fp8 (channel weights, token acts)",
        kv_cache_dtype="float8_e4m3fn", tensor_parallel_size=2,
    )  # fmt: skip
    back = registration(worker_state(reg))  # what ListWorkers hands the gateway
    assert (back.quantization, back.kv_cache_dtype, back.tensor_parallel_size) == (
        reg.quantization, reg.kv_cache_dtype, 2,
    )  # fmt: skip
    for field, value in (("quantization", "x" * (MAX_DESCRIPTION + 1)),
                         ("kv_cache_dtype", "x" * (MAX_DESCRIPTION + 1)),
                         ("tensor_parallel_size", 5000)):  # fmt: skip
        bad = scheduler_pb2.WorkerRegistration()
        bad.CopyFrom(reg)
        setattr(bad, field, value)
        with pytest.raises(ValueError, match=r"at most|<="):
            worker_state(bad)
