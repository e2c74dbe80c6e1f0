"""The worker's watchdog on a fake clock and a fake engine: it trips only when the engine has
work and shows no progress past the bound (not idle, not while progress goes on, not over a
stall of the worker's own loop); a trip fails /health, leaves the schedulers and exits after
the grace. And a dropped worker's new incarnation, taken once for all its replicas."""

import asyncio
import json
import urllib.error
import urllib.request

import pytest
from prometheus_client import REGISTRY

from services.worker.watchdog import POLL_S, Activity, Reason, Reincarnation, Trip, Watchdog
from shared.probes import start_probe_server
from shared.protos.baton.v1 import scheduler_pb2
from tests import helpers

BOUND_S = 4.0  # --step-timeout
IDLE = Activity(progress=7, running=0, waiting=0, submitted=0)
RUNNING = Activity(progress=7, running=2, waiting=1, submitted=3)


class Clock(helpers.Clock):
    """Time that passes only when slept through (at once)."""

    async def sleep(self, seconds: float) -> None:
        self.now += seconds
        await asyncio.sleep(0)


class Engine:
    """What the front sees of its engine; ``moving``: progress with every look."""

    def __init__(self, seen: Activity, moving: bool = False) -> None:
        self.seen, self.moving = seen, moving

    def __call__(self) -> Activity:
        if self.moving:
            p = self.seen.progress + 1
            self.seen = Activity(p, self.seen.running, self.seen.waiting, self.seen.submitted)
        return self.seen


def first_trip(engine: Engine, for_s: float) -> tuple[float | None, Trip | None]:
    """Look every poll for ``for_s`` (fake) seconds: when it first tripped (since the start)."""
    clock = Clock()
    dog = Watchdog(engine, BOUND_S, clock, clock.sleep)
    start = clock.now
    while clock.now - start <= for_s:
        trip = dog.look()
        if trip is not None:
            return clock.now - start, trip
        clock.now += dog.poll_s
    return None, None


@pytest.mark.parametrize(
    ("engine", "reason"),
    [
        (Engine(IDLE), None),  # nothing to do: never
        (Engine(RUNNING, moving=True), None),  # every look sees progress: never
        (Engine(RUNNING), Reason.STEP),
        (Engine(Activity(7, running=0, waiting=2, submitted=2)), Reason.WAITING),
        # its stats, from before the request came, say idle: the front's count says otherwise
        (Engine(Activity(7, running=0, waiting=0, submitted=1)), Reason.INPUT),
    ],
    ids=["idle", "progressing", "step", "waiting", "input"],
)
def test_trips_only_with_work_and_no_progress_past_the_bound(
    engine: Engine, reason: Reason | None
) -> None:
    took, trip = first_trip(engine, 25 * BOUND_S)
    if reason is None:
        assert trip is None
        return
    assert trip is not None and took is not None
    assert trip.reason is reason and trip.stalled_s > BOUND_S
    assert BOUND_S < took <= BOUND_S + POLL_S  # not before the bound, within a look after it
    assert f"--step-timeout {BOUND_S:g} s" in trip.describe(BOUND_S)


def test_work_that_starts_after_a_long_idle_gets_the_whole_bound() -> None:
    clock, engine = Clock(), Engine(IDLE)
    dog = Watchdog(engine, BOUND_S, clock, clock.sleep)
    for _ in range(100):  # idle for 100 looks, the count standing still
        assert dog.look() is None
        clock.now += dog.poll_s
    engine.seen = Activity(IDLE.progress, running=1, waiting=0, submitted=1)
    start = clock.now
    while dog.look() is None:
        clock.now += dog.poll_s
    assert clock.now - start > BOUND_S


def test_a_stall_of_the_workers_own_loop_restarts_the_clock() -> None:
    """The whole worker stopped (SIGSTOP) with work in its engine: when it runs again, the
    engine's outputs of that time are still to be read. Its first look is late: no trip."""
    clock, engine = Clock(), Engine(RUNNING)
    dog = Watchdog(engine, BOUND_S, clock, clock.sleep)
    assert dog.look() is None
    clock.now += 10 * BOUND_S  # the loop did not run
    assert dog.look() is None
    clock.now += dog.poll_s
    start = clock.now - dog.poll_s  # the bound starts over, from the late look
    while dog.look() is None:
        clock.now += dog.poll_s
    assert clock.now - start > BOUND_S


async def test_a_trip_fails_health_leaves_the_schedulers_and_exits_after_the_grace() -> None:
    clock = Clock()
    dog = Watchdog(Engine(RUNNING), BOUND_S, clock, clock.sleep)
    port = start_probe_server("127.0.0.1", 0, lambda: (True, "ready"), dog.check)
    trips_before = trips("step")
    assert health(port) == (200, "the engine progresses or idles")
    assert sample("baton_worker_live") == 1
    events: list[tuple[str, float]] = []

    async def on_trip(trip: Trip) -> None:
        # by now the worker is not live: /health (the livenessProbe) says why
        status, detail = await asyncio.to_thread(health, port)
        assert status == 503 and "no engine step ended" in detail and "step-timeout" in detail
        events.append(("trip", clock.now))

    def on_exit(trip: Trip) -> None:
        events.append(("exit", clock.now))

    start = clock.now
    await asyncio.wait_for(dog.run(on_trip, on_exit), 5)
    assert [e for e, _ in events] == ["trip", "exit"]
    (_, tripped), (_, exited) = events
    assert BOUND_S < tripped - start <= BOUND_S + POLL_S
    assert exited - tripped == pytest.approx(dog.exit_grace_s) and dog.exit_grace_s == BOUND_S / 4
    assert dog.tripped is not None and dog.tripped.reason is Reason.STEP
    assert sample("baton_worker_live") == 0
    assert trips("step") == trips_before + 1
    assert sample("baton_worker_engine_stalled_seconds") > BOUND_S


async def test_a_step_timeout_of_0_never_trips() -> None:
    clock = Clock()
    dog = Watchdog(Engine(RUNNING), 0, clock, clock.sleep)
    called: list[Trip] = []

    async def on_trip(trip: Trip) -> None:
        called.append(trip)

    await asyncio.wait_for(dog.run(on_trip, called.append), 1)  # returns at once
    assert called == [] and dog.check()[0]


def test_the_grace_is_bounded() -> None:
    assert Watchdog(Engine(IDLE), 600.0).exit_grace_s == 15.0
    assert Watchdog(Engine(IDLE), 60.0).poll_s == POLL_S


class Beat:
    def __init__(self) -> None:
        self.registered: list[str] = []

    def reregister(self, registration: scheduler_pb2.WorkerRegistration) -> None:
        self.registered.append(registration.incarnation)


async def test_a_dropped_worker_takes_one_new_incarnation_for_every_replica() -> None:
    first = scheduler_pb2.WorkerRegistration(worker_id="w0", incarnation="old", model="m")
    ended = 0

    async def end_requests() -> None:
        nonlocal ended
        ended += 1

    beats = [Beat(), Beat()]
    incarnations = Reincarnation(first, end_requests, beats)
    reincarnations = sample("baton_worker_reincarnations_total")
    await incarnations.dropped("scheduler-a:1", first)
    new = incarnations.registration
    assert new.incarnation not in ("", "old") and new.worker_id == "w0" and new.model == "m"
    assert ended == 1
    assert [b.registered for b in beats] == [[new.incarnation], [new.incarnation]]
    # the other replica had dropped the old incarnation too: already done, nothing changes
    await incarnations.dropped("scheduler-b:1", first)
    assert incarnations.registration is new and ended == 1
    assert [b.registered for b in beats] == [[new.incarnation], [new.incarnation]]
    assert sample("baton_worker_reincarnations_total") == reincarnations + 1


def health(port: int) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as resp:
            return resp.status, json.loads(resp.read())["detail"]
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())["detail"]


def sample(name: str, labels: dict[str, str] | None = None) -> float:
    return REGISTRY.get_sample_value(name, labels or {}) or 0.0


def trips(reason: str) -> float:
    return sample("baton_worker_watchdog_trips_total", {"reason": reason})
