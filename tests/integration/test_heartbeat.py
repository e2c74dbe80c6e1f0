"""The worker's heartbeat against a real global scheduler on loopback (gRPC, the in-memory
directory, the sweep that drops silent workers): an engine busy in one long step, a heartbeat
hit by an unexpected error, a worker that no scheduler knows, and a stream cut during the
scheduler's stall against a worker's goodbye."""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from services.global_scheduler.directory import create_directory
from services.global_scheduler.registry import WorkerRegistry
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.server import SchedulerServicer
from services.worker import main as worker_main
from services.worker.heartbeat import RESYNC_WAIT_S, Heartbeat
from shared import rpc
from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch
from shared.lifecycle import StopSignal
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc

TIMEOUT_S = 0.5  # the scheduler drops a worker silent for this long
INTERVAL_S = 0.1  # the worker's heartbeat interval
WORKER = WorkerId("w0")


@contextlib.asynccontextmanager
async def scheduler(
    sweeping: bool = True, servicer: SchedulerServicer | None = None
) -> AsyncIterator[tuple[SchedulerServicer, str]]:
    if servicer is None:
        servicer = SchedulerServicer(
            WorkerRegistry(TIMEOUT_S), create_directory("memory"), RoutingPolicy()
        )
    server = rpc.server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, server)
    port = rpc.add_port(server, "127.0.0.1:0")
    await server.start()

    async def sweep() -> None:
        while True:
            await servicer.sweep()
            await asyncio.sleep(0.05)

    sweeper = asyncio.create_task(sweep() if sweeping else asyncio.sleep(0))
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        sweeper.cancel()
        await server.stop(0)


class BusyEngine:
    """An engine core in one long step: it answers a re-announcement only when the step
    ends, as the real core answers calls between steps only; its blocks then reach the
    heartbeat through the KV-event listener."""

    def __init__(self) -> None:
        self.step_done = asyncio.Event()
        self.listener: Callable[[KVEventBatch], None] = lambda batch: None
        self._seq = 0
        self._answers: set[asyncio.Future[None]] = set()

    async def resync_kv_events(self) -> None:
        # the call is on its way: the core answers once its step ends, waited for or not
        answer = asyncio.ensure_future(self._answer())
        self._answers.add(answer)
        await asyncio.shield(answer)

    async def _answer(self) -> None:
        await self.step_done.wait()
        self._seq += 1
        hashes = [BlockHash(b"h" * 8), BlockHash(b"i" * 8)]
        events: list[KVEvent] = [AllBlocksCleared(), BlockStored(hashes, None, 16)]
        self.listener(KVEventBatch(self._seq, events))


def registration() -> scheduler_pb2.WorkerRegistration:
    return scheduler_pb2.WorkerRegistration(
        worker_id=WORKER, incarnation="inc-1", role=common_pb2.WORKER_ROLE_BOTH,
        address="127.0.0.1:1", model="m", max_model_len=512, block_size=16, num_kv_blocks=64,
        vocab_size=128,
    )  # fmt: skip


async def until(cond: Callable[[], bool], what: str, bound_s: float) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.01)


async def stays(cond: Callable[[], bool], what: str, for_s: float) -> None:
    deadline = time.monotonic() + for_s
    while time.monotonic() < deadline:
        assert cond(), what
        await asyncio.sleep(0.01)


async def test_a_busy_engine_stays_registered() -> None:
    """Registered while the engine is in a step, and kept registered for six times the
    scheduler's timeout; the blocks the engine re-announces when the step ends follow."""
    engine = BusyEngine()
    async with scheduler() as (servicer, address):
        beat = Heartbeat(address, registration(), engine, scheduler_pb2.WorkerLoad, INTERVAL_S)
        engine.listener = beat.on_kv_events
        task = asyncio.create_task(beat.run())
        try:
            await until(lambda: servicer.is_registered(WORKER), "registered", RESYNC_WAIT_S + 2)
            servicer.request_resync()  # a re-announce command in the middle of the step
            await stays(lambda: servicer.is_registered(WORKER), "dropped while the engine is busy",
                        6 * TIMEOUT_S)  # fmt: skip
            assert await servicer.directory.num_blocks(WORKER, "inc-1") == 0
            engine.step_done.set()
            await until(lambda: beat.connected.is_set(), "connected", 1)
            blocks = servicer.directory.num_blocks
            await until_async(lambda: blocks(WORKER, "inc-1"), 2, 2)
            assert servicer.is_registered(WORKER)
        finally:
            beat.stop()
            task.cancel()


async def until_async(
    get: Callable[[], object], want: object, bound_s: float
) -> None:  # (the directory's lookups are coroutines)
    deadline = time.monotonic() + bound_s
    while (seen := await get()) != want:  # type: ignore[misc]
        assert time.monotonic() < deadline, f"not within {bound_s} s: {want} (seen {seen})"
        await asyncio.sleep(0.02)


async def test_a_failed_heartbeat_comes_back(caplog: pytest.LogCaptureFixture) -> None:
    """An unexpected exception in the heartbeat (here: the load report) is logged, and the
    heartbeat registers again instead of ending without a word."""
    engine = BusyEngine()
    engine.step_done.set()
    calls = 0

    def load() -> scheduler_pb2.WorkerLoad:
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("an unexpected failure")
        return scheduler_pb2.WorkerLoad(num_running=calls)

    async with scheduler() as (servicer, address):
        registered = 0

        def count(*_: object) -> None:
            nonlocal registered
            registered = sum(1 for r in caplog.records if "registered with" in r.getMessage())

        beat = Heartbeat(address, registration(), engine, load, INTERVAL_S)
        with caplog.at_level(logging.INFO, logger="services.worker.heartbeat"):
            task = asyncio.create_task(beat.run())
            try:
                await until(lambda: calls > 8 and servicer.is_registered(WORKER), "back", 5)
                count()
                assert registered >= 2, "the heartbeat did not register again"
                assert any("an unexpected failure" in r.getMessage() for r in caplog.records)
                assert not task.done()
                state = servicer.registry.get(WORKER)
                await until(lambda: state is not None and state.load.num_running > 5,
                            "its load reported", 2)  # fmt: skip
            finally:
                beat.stop()
                task.cancel()


async def test_an_unregistered_worker_stops_with_a_failure() -> None:
    """No scheduler answers: past the bound the worker stops with exit code 1 (for its
    supervisor); while one replica knows it, it does not."""
    async with scheduler() as (_, address):
        beats = [Heartbeat(a, registration(), BusyEngine(), scheduler_pb2.WorkerLoad, INTERVAL_S)
                 for a in ("127.0.0.1:9", address)]  # fmt: skip
        beats[1].engine.step_done.set()  # type: ignore[attr-defined]
        task = asyncio.create_task(beats[1].run())
        stop, code = StopSignal(), [0]
        watch = asyncio.create_task(worker_main.watch_registration(beats, stop, 0.5, code))
        try:
            await until(lambda: beats[1].connected.is_set(), "registered", 3)
            await asyncio.sleep(1.0)
            assert not stop.event.is_set() and code == [0]
            beats[1].stop()
            await until(lambda: stop.event.is_set(), "stopped", 3)
            assert code == [1] and watch.done()
        finally:
            task.cancel()
            watch.cancel()


async def test_a_goodbye_removes_at_once_a_stream_cut_in_a_stall_does_not() -> None:
    """Over gRPC, while the scheduler counts as stalled (no sweep for longer than its stall
    bound): a worker whose heartbeat is cancelled (its stream ends with no goodbye, as a
    broken transport's does) stays registered, detached, while one that stops says
    ``leaving`` and is removed at once."""
    async with scheduler(sweeping=False) as (servicer, address):
        engine = BusyEngine()
        engine.step_done.set()  # (it answers the re-announcements at once)
        other = registration()
        other.worker_id = "w1"
        cut, leaving = (Heartbeat(address, r, engine, scheduler_pb2.WorkerLoad, INTERVAL_S)
                        for r in (registration(), other))  # fmt: skip
        tasks = [asyncio.create_task(b.run()) for b in (cut, leaving)]
        try:
            for worker in (WORKER, WorkerId("w1")):
                await until(lambda w=worker: servicer.is_registered(w), "registered", 2)
            await servicer.sweep()
            await asyncio.sleep(servicer.registry.stall_s + 0.05)  # the sweeps stop: a stall
            assert servicer.registry.stalled()
            state = servicer.registry.get(WORKER)
            assert state is not None
            tasks[0].cancel()
            await until(lambda: state.detached, "kept, detached", 2)
            assert servicer.registry.get(WORKER) is state
            leaving.stop()
            await until(lambda: not servicer.is_registered(WorkerId("w1")), "removed", 2)
            assert servicer.registry.get(WORKER) is state and servicer.registry.stalled()
        finally:
            for t in tasks:
                t.cancel()


class Recording(SchedulerServicer):
    """The scheduler's servicer, keeping every heartbeat message it reads."""

    def __init__(self) -> None:
        super().__init__(WorkerRegistry(TIMEOUT_S), create_directory("memory"), RoutingPolicy())
        self.seen: list[scheduler_pb2.WorkerHeartbeat] = []

    async def Heartbeat(
        self, request_iterator: AsyncIterator[scheduler_pb2.WorkerHeartbeat], context: Any
    ) -> AsyncIterator[scheduler_pb2.SchedulerCommand]:
        async def recorded() -> AsyncIterator[scheduler_pb2.WorkerHeartbeat]:
            async for m in request_iterator:
                self.seen.append(m)
                yield m

        async for command in super().Heartbeat(recorded(), context):
            yield command


@pytest.mark.parametrize("how", ["stop", "reregister"])
async def test_the_goodbye_is_the_next_message(how: str) -> None:
    """Stopped, or asked to register anew, a heartbeat's next message is its goodbye, not one
    more heartbeat first (a worker shutting down may be cancelled right after it)."""
    engine = BusyEngine()
    engine.step_done.set()
    async with scheduler(servicer=Recording()) as (servicer, address):
        assert isinstance(servicer, Recording)
        beat = Heartbeat(address, registration(), engine, scheduler_pb2.WorkerLoad, 30.0)
        task = asyncio.create_task(beat.run())
        try:
            await until(lambda: servicer.is_registered(WORKER), "registered", 2)
            beat.stop() if how == "stop" else beat.reregister(registration())
            await until(lambda: len(servicer.seen) >= 2, "the next message", 2)
            first, second = servicer.seen[:2]
            assert first.HasField("registration") and second.leaving
            assert not second.HasField("load") and not second.HasField("registration")
        finally:
            beat.stop()
            task.cancel()
