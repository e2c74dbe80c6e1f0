"""A worker against hangs. A real ``baton worker`` (tiny model, CPU) registered with a real
global scheduler, its engine core stopped (SIGSTOP) in the middle of a request: within
``--step-timeout`` and the exit grace the worker turns not live, the scheduler no longer lists
it, the request ends UNAVAILABLE (what a gateway resumes elsewhere), the log says which bound
tripped, and the worker exits with code 1, its engine core killed. And a worker that a
scheduler replica had dropped (its heartbeats had stopped) comes back as a new incarnation at
every replica, with its KV blocks announced afresh and its requests ended."""

import asyncio
import contextlib
import os
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import grpc
import psutil
import pytest

from baton.launcher import Cluster, ClusterSpec
from services.worker.heartbeat import Heartbeat
from services.worker.watchdog import Reincarnation
from shared import rpc
from shared.ids import BlockHash
from shared.internal_auth import TOKEN_ENV
from shared.kv_events import AllBlocksCleared, BlockStored, KVEvent, KVEventBatch
from shared.protos.baton.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
    worker_pb2_grpc,
)

STEP_TIMEOUT_S = 2.0
GRACE_S = STEP_TIMEOUT_S / 4  # the watchdog's exit grace at this bound
SLACK_S = 3.0  # a look's delay, the scheduler's reaction, the worker's own stop
ENGINE_FLAGS = ["--num-kv-blocks", "512", "--max-num-seqs", "16", "--max-model-len", "1024"]


@contextlib.contextmanager
def worker_and_scheduler(model: Path, logs: Path) -> Iterator[tuple[Cluster, str, dict]]:
    """A global scheduler and one worker ``w0`` (with /health) registered with it."""
    group = Cluster(ClusterSpec(model=str(model), log_dir=str(logs)))
    try:
        ready = group.spawn("scheduler", ["global-scheduler", "--port", "0"], ready=True)
        scheduler = group.wait_ready("scheduler", ready, 30)["address"]
        argv = ["worker", "--model", str(model), "--worker-id", "w0", "--scheduler", scheduler,
                "--metrics-port", "0", "--step-timeout", f"{STEP_TIMEOUT_S:g}",
                *ENGINE_FLAGS]  # fmt: skip
        worker = group.wait_ready("w0", group.spawn("w0", argv, ready=True), 120)
        yield group, scheduler, worker
    finally:
        group.stop()


def auth() -> list[tuple[str, str]]:
    return [("authorization", f"Bearer {os.environ[TOKEN_ENV]}")]


def listed(scheduler: str) -> dict[str, str]:
    """The workers the scheduler lists: worker id → incarnation."""
    with grpc.insecure_channel(scheduler) as ch:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
        answer = stub.ListWorkers(scheduler_pb2.ListWorkersRequest(), metadata=auth(), timeout=5)
        return {w.registration.worker_id: w.registration.incarnation for w in answer.workers}


def generate(
    ch: grpc.Channel, request_id: str, timeout_s: float, max_tokens: int = 1000
) -> Iterator[object]:
    """A request on the worker (long by default), once its first response came."""
    params = common_pb2.SamplingParams(max_tokens=max_tokens, ignore_eos=True, temperature=0)
    request = worker_pb2.GenerateRequest(
        request_id=request_id, prompt_token_ids=list(range(1, 17)), params=params
    )
    stream = worker_pb2_grpc.WorkerStub(ch).Generate(request, metadata=auth(), timeout=timeout_s)
    next(stream)
    return stream


def health(metrics_port: int) -> int:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{metrics_port}/health", timeout=2) as r:
            return int(r.status)
    except urllib.error.HTTPError as e:
        return e.code
    except OSError:
        return 0  # gone


def engine_core(worker: psutil.Process) -> psutil.Process:
    (core,) = [p for p in worker.children() if "services.worker.engine.core_proc" in p.cmdline()]
    return core


def wait_for(cond: Callable[[], bool], bound_s: float, what: str) -> float:
    """Poll ``cond`` until true; the seconds it took (fails past ``bound_s``)."""
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > bound_s:
            pytest.fail(f"not within {bound_s} s: {what}")
        time.sleep(0.02)
    return time.monotonic() - start


def test_a_stopped_engine_core_takes_its_worker_out_in_seconds(
    tiny_model: Path, tmp_path: Path
) -> None:
    with worker_and_scheduler(tiny_model, tmp_path) as (group, scheduler, worker):
        proc, port = group.procs["w0"], worker["metrics_port"]
        core = engine_core(psutil.Process(proc.pid))
        assert list(listed(scheduler)) == ["w0"] and health(port) == 200
        try:
            with grpc.insecure_channel(worker["address"]) as ch:
                stream = generate(ch, "r0", STEP_TIMEOUT_S + 6)  # it runs
                core.suspend()  # SIGSTOP: the front still answers, but no step ends
                stopped = time.monotonic()
                with pytest.raises(grpc.RpcError) as ended:
                    for _ in stream:
                        pass
                request_ended = time.monotonic() - stopped
            assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value  # resumable
            assert health(port) in (503, 0)  # not live (0: exited already)
            wait_for(lambda: "w0" not in listed(scheduler), SLACK_S, "the scheduler to drop it")
            dropped = time.monotonic() - stopped
            wait_for(lambda: proc.poll() is not None, GRACE_S + 2 * SLACK_S, "the exit")
            exited = time.monotonic() - stopped
        finally:
            with contextlib.suppress(psutil.NoSuchProcess):
                core.resume()
        assert proc.returncode == 1
        assert STEP_TIMEOUT_S < request_ended <= STEP_TIMEOUT_S + SLACK_S
        assert dropped <= STEP_TIMEOUT_S + SLACK_S
        assert exited <= STEP_TIMEOUT_S + GRACE_S + 2 * SLACK_S
        assert not core.is_running()  # killed, stopped as it was
        log = (tmp_path / "w0.log").read_text()
        assert "watchdog: no engine step ended in" in log and "--step-timeout 2 s" in log
        print(f"after the SIGSTOP: the request ended in {request_ended:.1f} s, the scheduler "
              f"dropped the worker in {dropped:.1f} s, it exited in {exited:.1f} s")  # fmt: skip


def test_a_worker_stopped_past_its_heartbeat_timeout_comes_back_as_a_new_incarnation(
    tiny_model: Path, tmp_path: Path
) -> None:
    """The whole worker (its service and its engine core) stopped in the middle of a request
    until the scheduler drops it: continued, it ends that request (resumably: a gateway has
    moved it meanwhile), registers as a new incarnation, stays live (its own stall is not its
    engine's) and serves again."""
    with worker_and_scheduler(tiny_model, tmp_path) as (group, scheduler, worker):
        proc, port = group.procs["w0"], worker["metrics_port"]
        front = psutil.Process(proc.pid)
        core = engine_core(front)
        first = listed(scheduler)["w0"]
        try:
            with grpc.insecure_channel(worker["address"]) as ch:
                stream = generate(ch, "r0", 30)
                front.suspend()
                core.suspend()
                wait_for(lambda: "w0" not in listed(scheduler), 5, "the scheduler to drop it")
                core.resume()
                front.resume()
                with pytest.raises(grpc.RpcError) as ended:
                    for _ in stream:
                        pass
                assert ended.value.code() == grpc.StatusCode.UNAVAILABLE, ended.value
                wait_for(lambda: listed(scheduler).get("w0") not in (None, first), 5,
                         "a new incarnation registered")  # fmt: skip
                assert health(port) == 200 and proc.poll() is None
                for _ in generate(ch, "r1", 30, max_tokens=4):  # it serves again
                    pass
        finally:
            for p in (core, front):
                with contextlib.suppress(psutil.NoSuchProcess):
                    p.resume()
        assert health(port) == 200 and proc.poll() is None
        log = (tmp_path / "w0.log").read_text()
        assert "had dropped this worker" in log and "the engine is hung" not in log


# -- a worker a scheduler replica had dropped: a fake scheduler, a real heartbeat -------------


class DroppingScheduler(scheduler_pb2_grpc.GlobalSchedulerServicer):
    """Records each registration (its incarnation, and whether its KV events start from all
    cleared); the heartbeat after one of an incarnation in ``drop`` is answered ``dropped``,
    and the stream ends, as the real scheduler does for a worker it expired."""

    def __init__(self) -> None:
        self.registrations: list[tuple[str, bool]] = []
        self.drop: set[str] = set()

    async def Heartbeat(  # type: ignore[override]
        self, request_iterator: AsyncIterator[scheduler_pb2.WorkerHeartbeat], context: object
    ) -> AsyncIterator[scheduler_pb2.SchedulerCommand]:
        incarnation = None
        async for msg in request_iterator:
            if incarnation is None:
                incarnation = msg.registration.incarnation
                events = [e for batch in msg.kv_events for e in batch.events]
                self.registrations.append((incarnation, bool(events) and
                                           events[0].HasField("cleared")))  # fmt: skip
            elif incarnation in self.drop:
                yield scheduler_pb2.SchedulerCommand(dropped=True, reason="missed heartbeats")
                return

    def incarnations(self) -> list[str]:
        return [i for i, _ in self.registrations]


@contextlib.asynccontextmanager
async def fake_scheduler() -> AsyncIterator[tuple[DroppingScheduler, str]]:
    servicer = DroppingScheduler()
    server = rpc.server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, server)
    port = rpc.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        yield servicer, f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


class Engine:
    """Re-announces its blocks (all cleared, then each) through the heartbeats, numbering its
    batches on from where they stand, whatever the incarnation."""

    def __init__(self) -> None:
        self.beats: list[Heartbeat] = []
        self.seq = 40

    async def resync_kv_events(self) -> None:
        self.seq += 1
        events: list[KVEvent] = [AllBlocksCleared(), BlockStored([BlockHash(b"h" * 8)], None, 16)]
        for beat in self.beats:
            beat.on_kv_events(KVEventBatch(self.seq, events))


async def until(cond: Callable[[], bool], what: str, bound_s: float = 5.0) -> None:
    deadline = time.monotonic() + bound_s
    while not cond():
        assert time.monotonic() < deadline, f"not within {bound_s} s: {what}"
        await asyncio.sleep(0.01)


async def test_a_dropped_worker_comes_back_as_a_new_incarnation_at_every_replica() -> None:
    """Both replicas had expired the worker (it was stopped): the first ``dropped`` ends its
    requests and gives it a new incarnation, which it registers with both replicas (the
    other's ``dropped``, about the old one, changes nothing more), each registration carrying
    the engine's blocks announced afresh."""
    first = scheduler_pb2.WorkerRegistration(
        worker_id="w0", incarnation="first", role=common_pb2.WORKER_ROLE_BOTH,
        address="127.0.0.1:1", model="m", max_model_len=512, block_size=16, num_kv_blocks=64,
    )  # fmt: skip
    ended = 0

    async def end_requests() -> None:
        nonlocal ended
        ended += 1

    engine = Engine()
    async with fake_scheduler() as (a, a_addr), fake_scheduler() as (b, b_addr):
        incarnations = Reincarnation(first, end_requests, engine.beats)
        for address in (a_addr, b_addr):
            beat = Heartbeat(address, first, engine, scheduler_pb2.WorkerLoad, 0.05)
            beat.on_dropped = incarnations.dropped
            engine.beats.append(beat)
        tasks = [asyncio.create_task(beat.run()) for beat in engine.beats]
        try:
            await until(lambda: a.incarnations() == b.incarnations() == ["first"], "registered")
            a.drop.add("first")
            b.drop.add("first")
            await until(lambda: len(a.incarnations()) == len(b.incarnations()) == 2, "again")
            new = incarnations.registration.incarnation
            assert new != "first"
            await asyncio.sleep(0.3)  # six heartbeats: nothing more happens
            assert a.incarnations() == b.incarnations() == ["first", new]
            assert all(cleared for s in (a, b) for _, cleared in s.registrations)
            assert ended == 1
        finally:
            for beat, task in zip(engine.beats, tasks, strict=True):
                beat.stop()
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
