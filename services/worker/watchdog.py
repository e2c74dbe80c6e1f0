"""The worker against hangs: a hang must cost seconds, not minutes.

``Watchdog``: the engine core hung. The front (this process) sees every output of the core and
the stats it pushes while it steps (``AsyncLLM.progress`` counts them). While the engine has
work (requests running or waiting in the core, or given to it and not ended) and that count
stands still for longer than ``step_timeout_s``, no step is ending: the core is stopped
(SIGSTOP), its device is wedged, or a collective waits for a peer that will never come. Then

    trip   /health fails (a Kubernetes livenessProbe restarts the pod) and /ready too; new
           calls are refused; the heartbeats end, so every scheduler replica drops the worker
           at once; the requests still here end UNAVAILABLE (the gateways resume them
           elsewhere); an ERROR says which bound tripped and after how long;
           ``baton_worker_live`` 0, ``baton_worker_watchdog_trips_total{reason}`` + 1
    exit   ``exit_grace_s`` later (a quarter of the bound, at most 15 s: time for a probe and a
           scrape to see it) the worker stops with exit code 1 and its engine core killed, so
           that ``baton serve``, which probes nothing, starts a fresh one

An idle engine never trips, however long nothing happens; nor does a stall of the worker's own
event loop (the whole process stopped: ``LoopTicker`` answers for that one), since only time
the watchdog itself ran counts.

The bounds, shortest first: a KV pull's own (5 s handshake, 30 s transfer) and a grammar's
compile timeout (30 s) end those waits with an error for their request alone, well before the
watchdog's default 60 s (a chunked prefill step takes under a second); the tensor-parallel
collectives' ``COLLECTIVE_TIMEOUT`` (120 s) comes after it. A hung collective thus shows up
here first, as a step that does not end; the worker kills its engine core, and the
collective's own bound is what frees a rank process still waiting in it.

``Reincarnation``: the worker itself was stopped (SIGSTOP of the whole process, a paused VM).
Meanwhile the scheduler replicas expired it and the gateways resumed its streams elsewhere;
when it runs again, a replica answers its next heartbeat ``dropped``. The worker ends the
requests still here (nobody reads them), takes a new incarnation and registers it with every
replica, so that no scheduler mixes the old process's work and KV blocks with the new: the
engine re-announces its blocks with each registration (heartbeat.py), filed under the new
incarnation.
"""

import asyncio
import enum
import logging
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from typing import Protocol

from services.worker import metrics
from services.worker.settings import new_incarnation
from shared.protos.baton.v1 import scheduler_pb2

logger = logging.getLogger(__name__)

POLL_S = 0.5  # how often the watchdog looks (an eighth of the bound when that is shorter)
LOOP_LATE_S = 1.0  # a look this much later than due: the worker's own loop stalled
EXIT_GRACE_MAX_S = 15.0
END_REQUESTS_S = 5.0  # how long ending the requests still here may take


@dataclass(frozen=True)
class Activity:
    """What the front knows of its engine now."""

    progress: int  # AsyncLLM.progress: moves whenever the core shows it moved
    running: int  # requests running in the core, as its last pushed stats say
    waiting: int  # requests waiting there (for a KV pull, a grammar, free blocks)
    submitted: int  # requests given to the core whose end the front has not seen

    @property
    def has_work(self) -> bool:
        return self.running > 0 or self.waiting > 0 or self.submitted > 0


class Reason(enum.StrEnum):
    """What the engine was doing when it was found hung (the trips metric's label)."""

    STEP = "step"  # requests were running: a step did not end (core, device or collective)
    WAITING = "waiting"  # requests were waiting, none ran: nothing was scheduled
    INPUT = "input"  # the core had taken none of the requests given to it: it reads nothing


@dataclass(frozen=True)
class Trip:
    """The engine found hung: why, and after how long without progress."""

    reason: Reason
    stalled_s: float
    activity: Activity

    def describe(self, bound_s: float) -> str:
        a, took = self.activity, f"{self.stalled_s:.1f} s (--step-timeout {bound_s:g} s)"
        if self.reason is Reason.STEP:
            return f"no engine step ended in {took} with {a.running} requests running"
        if self.reason is Reason.WAITING:
            return f"{a.waiting} requests waited {took} and none was scheduled"
        return f"the engine core took none of {a.submitted} requests in {took}"


def _reason(a: Activity) -> Reason:
    return Reason.STEP if a.running else Reason.WAITING if a.waiting else Reason.INPUT


class Watchdog:
    """Looks at the engine's ``activity`` every ``poll_s`` until it finds it hung (``look``),
    then trips and exits (``run``). ``step_timeout_s`` 0: it never looks. ``clock`` and
    ``sleep`` are time's (a test gives its own)."""

    def __init__(
        self,
        activity: Callable[[], Activity],
        step_timeout_s: float,
        clock: Callable[[], float] = time.monotonic,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ):
        self.activity = activity
        self.step_timeout_s = step_timeout_s
        self.poll_s = min(POLL_S, step_timeout_s / 8)
        self.exit_grace_s = min(step_timeout_s / 4, EXIT_GRACE_MAX_S)
        self.clock, self.sleep = clock, sleep
        self.tripped: Trip | None = None
        self.stalled_s = 0.0  # at the last look: with work and no progress for this long
        self._looked_at = self._since = clock()  # the last look; the last progress (or idle)
        self._progress: int | None = None
        self._had_work = False  # at the last look
        metrics.LIVE.set(1)

    def check(self) -> tuple[bool, str]:
        """/health's part: (live, why). The probe server's thread calls it (one read)."""
        trip = self.tripped
        if trip is None:
            return True, "the engine progresses or idles"
        return False, f"the engine is hung: {trip.describe(self.step_timeout_s)}"

    def look(self) -> Trip | None:
        """One look: a ``Trip`` once the engine has had work and shown no progress for longer
        than the bound, counted from the first look that saw the work, over time this loop ran
        (a look that comes late restarts the clock)."""
        now, seen = self.clock(), self.activity()
        late = now - self._looked_at > self.poll_s + LOOP_LATE_S
        self._looked_at = now
        if late or not (seen.has_work and self._had_work) or seen.progress != self._progress:
            self._progress, self._since = seen.progress, now
        self._had_work = seen.has_work
        stalled = self.stalled_s = now - self._since
        metrics.ENGINE_STALLED.set(stalled)
        return Trip(_reason(seen), stalled, seen) if stalled > self.step_timeout_s else None

    async def run(
        self, on_trip: Callable[[Trip], Awaitable[None]], on_exit: Callable[[Trip], None]
    ) -> None:
        """Look until the engine is hung; then trip (``on_trip``: leave the schedulers, end
        the requests) and, ``exit_grace_s`` later, exit (``on_exit``)."""
        if not self.step_timeout_s:
            return
        while (trip := self.look()) is None:
            await self.sleep(self.poll_s)
        self.tripped = trip
        metrics.LIVE.set(0)
        metrics.WATCHDOG_TRIPS.labels(reason=trip.reason).inc()
        logger.error("watchdog: %s: the engine is hung; the worker is not live, leaves the "
                     "schedulers and exits in %.1f s", trip.describe(self.step_timeout_s),
                     self.exit_grace_s)  # fmt: skip
        await on_trip(trip)
        await self.sleep(self.exit_grace_s)
        on_exit(trip)


class Registers(Protocol):
    def reregister(self, registration: scheduler_pb2.WorkerRegistration) -> None:
        """Register ``registration`` anew (``heartbeat.Heartbeat``: on a new stream)."""


class Reincarnation:
    """The worker's current registration, and what it does when a scheduler replica says it
    had dropped it (see the module's docstring). ``end_requests`` ends every request in
    flight, resumably; ``beats`` are the heartbeats (read anew at each use)."""

    def __init__(
        self,
        registration: scheduler_pb2.WorkerRegistration,
        end_requests: Callable[[], Awaitable[None]],
        beats: Iterable[Registers],
    ):
        self.registration = registration  # what every heartbeat registers with
        self._end_requests = end_requests
        self._beats = beats

    async def dropped(self, replica: str, registered: scheduler_pb2.WorkerRegistration) -> None:
        """``replica`` answered ``dropped`` on the stream that registered ``registered``. Once
        per incarnation: a notice about an older one (another replica's) changes nothing."""
        if registered.incarnation != self.registration.incarnation:
            return
        old, new = self.registration, scheduler_pb2.WorkerRegistration()
        new.CopyFrom(old)
        new.incarnation = new_incarnation()
        self.registration = new
        metrics.REINCARNATIONS.inc()
        logger.warning("the global scheduler at %s had dropped this worker (its heartbeats had "
                       "stopped: was the process stopped?) and its requests were moved: ending "
                       "those still here, registering again as incarnation %s (was %s)",
                       replica, new.incarnation, old.incarnation)  # fmt: skip
        try:
            await asyncio.wait_for(self._end_requests(), END_REQUESTS_S)
        except TimeoutError:
            logger.warning("the requests still here did not end within %.0f s", END_REQUESTS_S)
        finally:  # (whatever happened to them: no heartbeat may keep the old incarnation)
            for beat in self._beats:
                beat.reregister(new)
