"""``baton worker``: the engine behind the Worker gRPC service, registered with the global
scheduler's replicas (a fixed list, or a DNS name followed as it changes: schedulers.py).
Lifecycle (shared/lifecycle.py):

    start the engine → serve gRPC → register + heartbeat → wait for SIGTERM
    → drain: refuse new requests, tell the scheduler, let in-flight ones finish (bounded)
    → close the heartbeats (the scheduler drops us at once) → stop gRPC → stop the engine

Ready (/ready) once the model is loaded and at least one replica has the registration. Live
(/health) while its event loop ticks and its engine, when it has work, progresses (a hang:
watchdog.py, which stops the worker with exit code 1 past ``step_timeout_s``).
"""

import asyncio
import json
import logging
import time
from collections.abc import Iterable
from pathlib import Path

from services.worker import convert, metrics
from services.worker.engine.async_llm import AsyncLLM
from services.worker.heartbeat import Heartbeat
from services.worker.schedulers import SchedulerSet
from services.worker.servicer import ROLES, WorkerServicer
from services.worker.settings import WorkerSettings, new_incarnation
from services.worker.watchdog import END_REQUESTS_S, Activity, Reincarnation, Trip, Watchdog
from shared import rpc
from shared.affinity import pin_threads
from shared.kv_events import KVEventBatch
from shared.lifecycle import (
    StopSignal,
    TaskOwner,
    export_task_count,
    freeze_startup_heap,
    wait_or_forced,
)
from shared.probes import LoopTicker, start_probe_server
from shared.protos.baton.v1 import scheduler_pb2, worker_pb2_grpc

logger = logging.getLogger(__name__)

ENGINE_POLL_S = 0.5
REGISTRATION_POLL_S = 0.5
REGISTRATION_WARN_S = 10.0  # while unregistered, a warning this often
REGISTRATION_WAIT_S = 10.0  # at start, how long serving waits for a first registration
GOODBYE_BOUND_S = 1.0  # at stop, how long the heartbeats have to say goodbye to the replicas


async def serve(settings: WorkerSettings, stop: StopSignal | None = None) -> int:
    """Serve until stopped; the process's exit code (non-zero: stopped by a failure, for the
    supervisor to restart it)."""
    exit_code: list[int] = [0]  # set by the watchers that stop the worker on a failure
    stop = stop or StopSignal()
    stop.install()
    owner = TaskOwner("worker")
    export_task_count()
    engine = await asyncio.to_thread(AsyncLLM.from_engine_args, settings.engine)
    server = rpc.server()
    watchdog: Watchdog | None = None
    try:
        servicer = WorkerServicer(settings, engine)
        worker_pb2_grpc.add_WorkerServicer_to_server(servicer, server)
        port = rpc.add_port(server, f"{settings.host}:{settings.port}")
        await server.start()
        address = f"{settings.advertise_host or settings.host}:{port}"
        rate = ThroughputMeter()
        counters = metrics.EngineCounters()

        def load() -> scheduler_pb2.WorkerLoad:
            """The load now, from the engine's last pushed stats: never waits on its step."""
            stats = engine.latest_stats
            metrics.RUNNING.set(stats.num_running)
            metrics.WAITING.set(stats.num_waiting)
            metrics.KV_USAGE.set(stats.kv_usage)
            metrics.IN_FLIGHT.set(servicer.in_flight)
            metrics.KV_LEASES_HELD.set(stats.kv_leases_held)
            counters.update(stats)
            tokens_per_s = rate.update(stats.computed_tokens, stats.model_seconds)
            stalled = watchdog.stalled_s if watchdog is not None else 0.0
            return convert.load(stats, servicer.in_flight, servicer.draining, tokens_per_s,
                                servicer.num_received, stalled)  # fmt: skip

        def heartbeat(replica: str, tls_name: str | None) -> Heartbeat:
            beat = Heartbeat(replica, incarnations.registration, engine, load,
                             settings.heartbeat_interval_s, servicer.set_kv_peers,
                             tls_name)  # fmt: skip
            beat.on_dropped = incarnations.dropped
            return beat

        schedulers = SchedulerSet(heartbeat, owner)
        incarnations = Reincarnation(await _registration(settings, engine, address),
                                     servicer.end_the_rest, schedulers)  # fmt: skip
        serving = asyncio.Event()
        ticker = LoopTicker()
        owner.spawn(ticker.run(), "loop-ticker")
        watchdog = Watchdog(lambda: _activity(engine), settings.step_timeout_s)

        def alive() -> tuple[bool, str]:
            """/health (the livenessProbe): the event loop ticks, the engine is not hung."""
            (loop_ok, loop), (engine_ok, hung) = ticker.check(), watchdog.check()
            return loop_ok and engine_ok, f"{loop}; {hung}"

        def ready() -> tuple[bool, str]:
            """/ready (and the startupProbe): model loaded, registered with a scheduler
            replica at least, not draining, the engine not hung."""
            if watchdog.tripped:
                return False, "the engine is hung"
            if servicer.draining or engine.dead:
                return False, "draining" if servicer.draining else "the engine died"
            registered, why = schedulers.registration()
            if not registered or not serving.is_set():
                return False, why if not registered else "starting"
            return True, f"serving; {why}"

        metrics_port = None
        if settings.metrics_port is not None:
            metrics_port = start_probe_server(settings.host, settings.metrics_port, ready,
                                              alive)  # fmt: skip

        if settings.scheduler_addresses:

            def fan_out(batch: KVEventBatch) -> None:
                for beat in schedulers:
                    beat.on_kv_events(batch)

            engine.kv_event_listener = fan_out

            def ask_for_kv_peers() -> None:
                for beat in schedulers:
                    beat.wake()

            servicer.ask_for_kv_peers = ask_for_kv_peers
            # one stream per scheduler replica, a replica found later gets one too
            await schedulers.start(settings.scheduler_addresses,
                                   settings.scheduler_resolve_interval_s)  # fmt: skip
            await _wait_registered(schedulers)
            if settings.unregistered_exit_s:
                owner.spawn(watch_registration(schedulers, stop, settings.unregistered_exit_s,
                                               exit_code), "registration-watch")  # fmt: skip
        owner.spawn(_watch_engine(engine, stop, exit_code), "engine-watch")

        async def leave(trip: Trip) -> None:
            """The engine is hung: refuse new calls, leave every scheduler replica now (no
            more routing here), end what runs here resumably (the gateways resume it)."""
            servicer.draining = True
            schedulers.stop()
            await _end_requests(servicer)

        def exit_hung(trip: Trip) -> None:
            exit_code[0] = 1
            stop.trigger()
            stop.trigger()  # no drain: nothing can finish (the engine core is killed at stop)

        owner.spawn(watchdog.run(leave, exit_hung), "watchdog")
        serving.set()
        freeze_startup_heap()
        logger.info("worker %s (%s) serving %s on %s", settings.worker_id, settings.role,
                    engine.model_name, address)  # fmt: skip
        if settings.cpus:  # the engine core runs in its own process, which keeps every CPU
            pin_threads(settings.cpus)
        if settings.ready_file:
            _write_ready(settings.ready_file, address, metrics_port)
        await stop.wait()

        servicer.draining = True
        for beat in schedulers:
            beat.wake()
        # in-flight requests finish, and KV still leased is pulled, within the drain timeout;
        # what is left then ends with the status the gateway resumes elsewhere
        if not await wait_or_forced(servicer.drained(), stop, settings.drain_timeout_s):
            logger.warning("drain: %d requests still running, ending them (resumable)",
                           servicer.in_flight)  # fmt: skip
            await servicer.end_the_rest()
            try:
                await asyncio.wait_for(servicer.wait_idle(), 5.0)
            except TimeoutError:
                logger.warning("drain: %d requests did not end", servicer.in_flight)
        schedulers.stop()
        await schedulers.ended(GOODBYE_BOUND_S)  # the goodbyes out before the channels close
    finally:
        await server.stop(grace=1.0)
        await owner.cancel_all()
        engine.shutdown(kill=watchdog is not None and watchdog.tripped is not None)
        logger.info("worker stopped")
    return exit_code[0]


class ThroughputMeter:
    """Tokens the model computes per second of model time, smoothed over heartbeats (what the
    scheduler's TTFT predictor divides a prefill backlog by). 0 until something ran."""

    def __init__(self, smoothing: float = 0.3):
        self.smoothing = smoothing
        self.rate = 0.0
        self._last = (0, 0.0)

    def update(self, computed_tokens: int, model_seconds: float) -> float:
        tokens, seconds = computed_tokens - self._last[0], model_seconds - self._last[1]
        self._last = (computed_tokens, model_seconds)
        if tokens > 0 and seconds > 0:
            now = tokens / seconds
            self.rate = (
                now if self.rate == 0 else (1 - self.smoothing) * self.rate + self.smoothing * now
            )
        return self.rate


async def _registration(
    settings: WorkerSettings, engine: AsyncLLM, address: str
) -> scheduler_pb2.WorkerRegistration:
    """What the heartbeats tell every scheduler replica when they (re)connect."""
    stats, info = await engine.get_stats(), await engine.get_model_info()
    return scheduler_pb2.WorkerRegistration(
        worker_id=settings.worker_id,
        incarnation=new_incarnation(),
        role=ROLES[settings.role],
        address=address,
        model=engine.model_name,
        max_model_len=engine.config.model.max_model_len,
        block_size=engine.config.cache.block_size,
        num_kv_blocks=stats.num_blocks,
        vocab_size=engine.config.model.arch.vocab_size,
        kv_side_channel=info.kv_side_channel,
        quantization=info.quantization,
        kv_cache_dtype=info.kv_cache_dtype,
        tensor_parallel_size=info.tensor_parallel_size,
    )


def _activity(engine: AsyncLLM) -> Activity:
    stats = engine.latest_stats
    return Activity(engine.progress, stats.num_running, stats.num_waiting, engine.num_in_flight)


async def _end_requests(servicer: WorkerServicer) -> None:
    """End every request still here, resumably (bounded: the engine may be hung)."""
    try:
        await asyncio.wait_for(servicer.end_the_rest(), END_REQUESTS_S)
    except TimeoutError:
        logger.warning("%d requests did not end within %.0f s", servicer.in_flight,
                       END_REQUESTS_S)  # fmt: skip


async def _wait_registered(schedulers: SchedulerSet) -> None:
    """Serve once a scheduler replica knows us (bounded, never fatal: they keep retrying)."""
    if not await schedulers.wait_registered(REGISTRATION_WAIT_S):
        logger.warning("%s after %.0f s; still trying", schedulers.registration()[1],
                       REGISTRATION_WAIT_S)  # fmt: skip


async def _watch_engine(engine: AsyncLLM, stop: StopSignal, exit_code: list[int]) -> None:
    """A dead engine core ends the worker (its supervisor restarts it)."""
    while not engine.dead and not engine.client.core_dead():
        await asyncio.sleep(ENGINE_POLL_S)
    logger.error("the engine core died; stopping the worker")
    exit_code[0] = 1
    stop.trigger()
    stop.trigger()  # no drain: nothing can finish


async def watch_registration(
    heartbeats: Iterable[Heartbeat], stop: StopSignal, bound_s: float, exit_code: list[int]
) -> None:
    """A worker no scheduler replica knows serves nobody: say so while it lasts, and past
    ``bound_s`` stop (draining what it still serves) with a failure code, so that the
    supervisor (``baton serve``, Kubernetes) starts it again, instead of living on unseen.
    ``heartbeats`` is read anew at every poll (a ``SchedulerSet`` changes as DNS answers do);
    a replica found while alone does not restart the clock, a registration does."""
    warned = 0.0
    alone_since: float | None = None  # when the last registration was lost
    while True:
        await asyncio.sleep(REGISTRATION_POLL_S)
        beats = list(heartbeats)
        since = [h.disconnected_at for h in beats]
        if None in since:
            warned, alone_since = 0.0, None
            continue
        if alone_since is None:
            alone_since = max((t for t in since if t is not None), default=time.monotonic())
        alone = time.monotonic() - alone_since
        if alone >= bound_s:
            logger.error("registered with no global scheduler for %.0f s (%s): stopping the "
                         "worker for its supervisor to restart it", alone,
                         ", ".join(h.address for h in beats))  # fmt: skip
            exit_code[0] = 1
            stop.trigger()
            return
        if alone - warned >= REGISTRATION_WARN_S:
            warned = alone
            logger.warning("registered with no global scheduler for %.0f s; stopping at %.0f s",
                           alone, bound_s)  # fmt: skip


def _write_ready(path: str, address: str, metrics_port: int | None) -> None:
    tmp = Path(path + ".tmp")
    tmp.write_text(json.dumps({"address": address, "metrics_port": metrics_port}))
    tmp.rename(path)
