"""The live set of workers, fed by heartbeat streams. Pure bookkeeping (no I/O): the server
calls it, the routing pipeline reads ``candidates``.

A worker is identified by ``worker_id``; each process start brings a new ``incarnation``. A
registration with a new incarnation replaces the old entry (the old process is gone), and the
end of an old stream cannot remove its successor.

A worker silent past ``heartbeat_timeout_s`` is expired, but only for silence the scheduler
was there to hear: a sweep that comes long after the previous one (the scheduler itself was
SIGSTOPped, or its loop blocked) expires nobody and credits every worker with the gap; the
heartbeats queued meanwhile arrive once it runs again.

The same holds for a heartbeat stream that breaks while the scheduler is stalled or just after
(``stream_ended``): the workers' gRPC pings went unanswered during the stall, so their
transports closed and they are reconnecting. Such a worker stays registered, ``detached``:
its new stream's registration replaces the entry; if none comes within the heartbeat timeout
and ``RECONNECT_S``, the sweep removes it as a stream's end would have (no gateway is told: it
was not found hung). A stream that ends with the worker's goodbye (``leaving``), or breaks
while the scheduler runs, removes it at once.
"""

import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from shared.ids import WorkerId


@dataclass
class WorkerLoad:
    num_running: int = 0
    num_waiting: int = 0
    kv_usage: float = 0.0
    num_in_flight: int = 0
    draining: bool = False
    pending_prefill_tokens: int = 0  # prompt tokens admitted, not yet computed
    tokens_per_s: float = 0.0  # measured model throughput; 0 until measured
    num_received: int = 0  # Prefill/Generate calls the worker has received since it started
    prefix_hit_tokens: int = 0  # prompt tokens its engine served from its prefix cache, ditto
    engine_stalled_s: float = 0.0  # its engine has had work and finished no step this long


# How long a worker whose stream broke in the scheduler's stall may take to register again
# beyond the heartbeat timeout: its reconnection backoff (at most 1 s) and its registration's
# wait for its engine's blocks (at most 1 s; services/worker/heartbeat.py)
RECONNECT_S = 2.0

# A route the worker has not reported receiving after this long was never sent (the client
# left first, or the gateway failed): it stops counting.
IN_TRANSIT_S = 5.0


@dataclass
class Route:
    at: float  # time.monotonic() when routed
    finished: bool = False  # the gateway said it is over


@dataclass
class WorkerState:
    worker_id: WorkerId
    incarnation: str
    role: str  # prefill | decode | both
    address: str  # host:port of its Worker service
    model: str
    max_model_len: int
    block_size: int
    num_kv_blocks: int
    vocab_size: int = 0  # token ids must be below it (0: not reported)
    kv_side_channel: str = ""  # P/D: its KV side channel (tcp://host:port), "" without
    quantization: str = ""  # what its FP8 layers are ("" for none)
    kv_cache_dtype: str = ""
    tensor_parallel_size: int = 1
    load: WorkerLoad = field(default_factory=WorkerLoad)
    last_seen: float = field(default_factory=time.monotonic)
    num_routed: int = 0  # requests routed to it since it registered
    # no new routes (its pod is being deleted, or the planner is emptying it to scale down);
    # it stays registered: what runs there finishes and its KV can still be pulled
    cordoned: bool = False
    # Requests routed here that the worker had not received at its last heartbeat, oldest
    # first: its reported load cannot show them yet.
    routes: OrderedDict[str, Route] = field(default_factory=OrderedDict)
    dropped: str = ""  # why ``expire`` dropped it, e.g. "missed heartbeats for 1.6 s"
    # its stream broke during the scheduler's stall and it has not registered again since
    detached: bool = False
    _unfinished: int = 0  # routes not marked finished (queue_depth runs for every candidate)

    @property
    def queue_depth(self) -> int:
        """Requests ahead of a new one: the engine's queue plus what is on its way there."""
        return self.load.num_running + self.load.num_waiting + self.in_transit

    @property
    def in_transit(self) -> int:
        """Routed since the last heartbeat showed them, not finished, not older than
        IN_TRANSIT_S."""
        cutoff = time.monotonic() - IN_TRANSIT_S
        while self.routes and next(iter(self.routes.values())).at < cutoff:
            self._drop_oldest()
        return self._unfinished

    def routed(self, request_id: str) -> None:
        old = self.routes.pop(request_id, None)
        self._unfinished += old is None or old.finished
        self.routes[request_id] = Route(time.monotonic())
        self.num_routed += 1

    def finished(self, request_id: str) -> None:
        """The gateway says the request is over: no longer ahead of anyone. Its entry stays
        (finished) until a heartbeat's receipt count retires it, so that count keeps lining up
        with the routes in order."""
        route = self.routes.get(request_id)
        if route is not None and not route.finished:
            route.finished = True
            self._unfinished -= 1

    def heard(self, load: WorkerLoad, now: float) -> None:
        """A heartbeat: the requests it received since the last one are in its load now (or
        over), so as many of the oldest routes leave the in-transit set. A worker that does
        not count receipts (0) shows everything routed before its heartbeat."""
        received = load.num_received - self.load.num_received
        if load.num_received == 0 or received < 0:
            self.routes.clear()
            self._unfinished = 0
        else:
            for _ in range(min(received, len(self.routes))):
                self._drop_oldest()
        self.load, self.last_seen = load, now

    def _drop_oldest(self) -> None:
        _, route = self.routes.popitem(last=False)
        self._unfinished -= not route.finished


@dataclass
class Expiry:
    """What one ``WorkerRegistry.expire`` did."""

    expired: list[WorkerState]  # dropped: silent past the heartbeat timeout
    # > 0: the scheduler itself was stalled (this many seconds since the previous sweep), so
    # the silence was its own: nobody expired and every worker was credited with the gap
    stalled_s: float = 0.0
    # removed too, not hung: detached workers (their stream broke in a stall) never back
    detached: list[WorkerState] = field(default_factory=list)


class WorkerRegistry:
    def __init__(
        self,
        heartbeat_timeout_s: float,
        stall_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.clock = clock  # the times of heartbeats, sweeps and stream ends
        # a gap between two sweeps longer than this: the scheduler stalled, not its workers
        # (default half the timeout: a worker heard just before such a stall is not dropped
        # when its heartbeats, queued meanwhile, are read only after the sweep)
        self.stall_s = heartbeat_timeout_s / 2 if stall_s is None else stall_s
        self._last_sweep: float | None = None
        self._stall_ended: float | None = None  # when the last sweep found a stall
        self._workers: dict[WorkerId, WorkerState] = {}
        # worker id → why it takes no new routes; kept across re-registrations (a pod being
        # deleted whose worker reconnects is still being deleted)
        self._cordoned: dict[WorkerId, str] = {}

    def register(self, state: WorkerState) -> WorkerState | None:
        """Add a worker; returns the entry it replaced (an older incarnation), if any."""
        old = self._workers.get(state.worker_id)
        state.cordoned = state.worker_id in self._cordoned
        state.last_seen = self.clock()
        self._workers[state.worker_id] = state
        return old

    def cordon(self, worker_id: WorkerId, why: str) -> bool:
        """No new routes to this worker (registered now or later); True if that is news."""
        new = worker_id not in self._cordoned
        self._cordoned[worker_id] = why
        if (state := self._workers.get(worker_id)) is not None:
            state.cordoned = True
        return new

    def uncordon(self, worker_id: WorkerId, why: str | None = None) -> bool:
        """Routes again, unless it was cordoned for another reason than ``why`` (None: any)."""
        if worker_id not in self._cordoned or why not in (None, self._cordoned[worker_id]):
            return False
        del self._cordoned[worker_id]
        if (state := self._workers.get(worker_id)) is not None:
            state.cordoned = False
        return True

    def cordoned(self) -> dict[WorkerId, str]:
        return dict(self._cordoned)

    def heartbeat(self, worker_id: WorkerId, incarnation: str, load: WorkerLoad) -> bool:
        state = self.get(worker_id, incarnation)
        if state is None:
            return False
        state.heard(load, self.clock())
        return True

    def remove(self, worker_id: WorkerId, incarnation: str) -> WorkerState | None:
        """Remove a worker if it is still this incarnation."""
        state = self.get(worker_id, incarnation)
        if state is not None:
            del self._workers[worker_id]
        return state

    def stream_ended(self, state: WorkerState, clean: bool, now: float | None = None) -> bool:
        """``state``'s heartbeat stream ended (``clean``: with the worker's goodbye); True if
        that removed it. An entry that is no longer ``state`` (the worker registered again on
        a new stream, with this incarnation or another) is left alone, and so is a broken
        stream's worker while the scheduler is stalled or within a heartbeat timeout of a
        stall: it stays, ``detached`` (see the module's docstring)."""
        if self._workers.get(state.worker_id) is not state:
            return False
        if not clean and self.stalled(now):
            state.detached = True
            return False
        del self._workers[state.worker_id]
        return True

    def stalled(self, now: float | None = None) -> bool:
        """Whether the scheduler is stalled (no sweep for longer than ``stall_s``) or the last
        stall a sweep found ended within ``heartbeat_timeout_s``."""
        now = self.clock() if now is None else now
        if self._last_sweep is not None and now - self._last_sweep > self.stall_s:
            return True
        return self._stall_ended is not None and now - self._stall_ended <= self.heartbeat_timeout_s

    def expire(self, now: float | None = None) -> Expiry:
        """Remove the workers whose last heartbeat is older than the timeout; called once per
        sweep. After a stall (longer than ``stall_s`` since the previous call) nobody expires
        and every worker is credited with the gap."""
        now = self.clock() if now is None else now
        gap = 0.0 if self._last_sweep is None else now - self._last_sweep
        self._last_sweep = now
        if gap > self.stall_s:
            self._stall_ended = now
            for w in self._workers.values():
                w.last_seen = min(w.last_seen + gap, now)
            return Expiry([], stalled_s=gap)
        timeout = self.heartbeat_timeout_s
        dead = [w for w in self._workers.values()
                if now - w.last_seen > timeout + (RECONNECT_S if w.detached else 0.0)]  # fmt: skip
        for w in dead:
            del self._workers[w.worker_id]
            w.dropped = f"missed heartbeats for {now - w.last_seen:.1f} s"
        return Expiry([w for w in dead if not w.detached], detached=[w for w in dead if w.detached])

    def get(self, worker_id: WorkerId, incarnation: str | None = None) -> WorkerState | None:
        state = self._workers.get(worker_id)
        if state is None or (incarnation is not None and state.incarnation != incarnation):
            return None
        return state

    def workers(self) -> list[WorkerState]:
        return list(self._workers.values())

    def models(self) -> dict[str, list[WorkerState]]:
        by_model: dict[str, list[WorkerState]] = {}
        for w in self._workers.values():
            by_model.setdefault(w.model, []).append(w)
        return by_model
