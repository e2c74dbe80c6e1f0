"""The scheduler tells the gateways about lost workers: a worker dropped for missed heartbeats
is named in one ``WorkersLost`` notice on every open RouteStream (a clean leave is not), a
gateway that does not read cannot grow the scheduler's memory, a heartbeat that still comes
from a dropped worker is answered ``dropped``, and the gateway's RouteClient hands the notice
to its hook without disturbing the route calls in flight."""

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest
from prometheus_client import REGISTRY

from services.gateway.route_client import RouteClient
from services.global_scheduler.directory import InMemoryDirectory, Match
from services.global_scheduler.registry import RECONNECT_S, WorkerLoad, WorkerRegistry, WorkerState
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.server import MAX_NOTICES, SchedulerServicer
from shared.ids import BlockHash, WorkerId
from shared.kv_events import BlockStored, KVEventBatch
from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import channel, server
from tests.helpers import Clock

BOUND_S = 5.0  # every wait here is bounded; each is a readiness signal, met in milliseconds


class Context:
    """What the servicer uses of an ``aio.ServicerContext`` on the paths driven here."""

    async def abort(self, code: Any, details: str) -> None:
        raise AssertionError(f"aborted: {code} {details}")


async def next_of(stream: AsyncIterator[Any]) -> Any:
    return await asyncio.wait_for(anext(stream), BOUND_S)


async def rest_of(stream: AsyncIterator[Any]) -> list[Any]:
    async def drain() -> list[Any]:
        return [m async for m in stream]

    return await asyncio.wait_for(drain(), BOUND_S)


class Outbox:
    """A client's side of a streaming call into the servicer: messages sent on demand, None
    ends it."""

    def __init__(self) -> None:
        self.queue: asyncio.Queue[Any] = asyncio.Queue()

    async def messages(self) -> AsyncIterator[Any]:
        while (m := await self.queue.get()) is not None:
            yield m


class Worker:
    """A worker's heartbeat stream into the servicer."""

    def __init__(self, servicer: SchedulerServicer, name: str):
        self.name, self.outbox, self.servicer = name, Outbox(), servicer
        self.registered: WorkerState | None = None  # the registry's entry, once registered
        self.commands = servicer.Heartbeat(self.outbox.messages(), Context())  # type: ignore[arg-type]

    async def register(self) -> None:
        reg = scheduler_pb2.WorkerRegistration(
            worker_id=self.name, incarnation=f"{self.name}-1", role=common_pb2.WORKER_ROLE_BOTH,
            address=f"{self.name}:1", model="m", max_model_len=1024, block_size=16,
            num_kv_blocks=100,
        )  # fmt: skip
        self.outbox.queue.put_nowait(scheduler_pb2.WorkerHeartbeat(registration=reg))
        first = await next_of(self.commands)  # registered: its KV peers come back
        assert first.HasField("kv_peers")
        self.registered = self.servicer.registry.get(WorkerId(self.name))

    async def end(self, leaving: bool = False) -> None:
        """End the stream (``leaving``: with the worker's goodbye, else as a broken transport
        ends it) and wait for the servicer to be done with it."""
        if leaving:
            self.outbox.queue.put_nowait(scheduler_pb2.WorkerHeartbeat(leaving=True))
        self.outbox.queue.put_nowait(None)
        assert await rest_of(self.commands) == []

    def beat(self) -> None:
        self.outbox.queue.put_nowait(scheduler_pb2.WorkerHeartbeat(load=scheduler_pb2.WorkerLoad()))


class Gateway:
    """A gateway's RouteStream into the servicer."""

    def __init__(self, servicer: SchedulerServicer):
        self.outbox = Outbox()
        self.replies = servicer.RouteStream(self.outbox.messages(), Context())  # type: ignore[arg-type]

    async def open(self) -> None:
        """One route call answered: the stream is open in the servicer."""
        request = scheduler_pb2.RouteRequest(request_id="r", model="m")
        self.outbox.queue.put_nowait(scheduler_pb2.RouteCall(call_id=1, request=request))
        assert (await next_of(self.replies)).call_id == 1  # (a route, or none: no worker)

    async def close(self) -> list[scheduler_pb2.RouteReply]:
        """What was still on its way to this gateway, once it closes its side."""
        self.outbox.queue.put_nowait(None)
        return await rest_of(self.replies)


def silence(servicer: SchedulerServicer, name: str) -> None:
    """The worker's last heartbeat was long ago (a hung or stopped process)."""
    state = servicer.registry.get(WorkerId(name))
    assert state is not None
    state.last_seen -= 60.0


def notices(outcome: str) -> float:
    labels = {"outcome": outcome}
    return REGISTRY.get_sample_value("baton_scheduler_lost_worker_notices_total", labels) or 0.0


def new_servicer() -> SchedulerServicer:
    return SchedulerServicer(WorkerRegistry(1.5), InMemoryDirectory(), RoutingPolicy())


async def test_a_silent_worker_is_named_once_on_every_route_stream_a_clean_leave_not() -> None:
    servicer = new_servicer()
    workers = {name: Worker(servicer, name) for name in ("w0", "w1", "w2")}
    for w in workers.values():
        await w.register()
    gateways = [Gateway(servicer), Gateway(servicer)]
    for g in gateways:
        await g.open()
    await workers["w0"].end(leaving=True)  # w0 drains and leaves cleanly
    assert not servicer.is_registered(WorkerId("w0"))
    silence(servicer, "w1")  # w1 hangs; w2 stays healthy
    await servicer.sweep()
    await servicer.sweep()  # w1 is announced once, not on every sweep
    for g in gateways:
        notice = await next_of(g.replies)
        assert notice.call_id == 0 and notice.HasField("lost")
        [lost] = notice.lost.workers
        assert (lost.worker_id, lost.address, lost.incarnation) == ("w1", "w1:1", "w1-1")
        assert lost.reason.startswith("missed heartbeats for 6")
    # a stream that closed hears nothing more: only the open one is sent the next notice
    assert await gateways[1].close() == []
    before = notices("queued")
    silence(servicer, "w2")
    await servicer.sweep()
    assert notices("queued") == before + 1
    [notice] = await gateways[0].close()
    assert [w.worker_id for w in notice.lost.workers] == ["w2"]


async def test_a_gateway_that_does_not_read_makes_the_scheduler_drop_notices_not_grow() -> None:
    servicer = new_servicer()
    gateway = Gateway(servicer)
    await gateway.open()  # ... and then reads nothing
    dropped = notices("dropped")
    for i in range(MAX_NOTICES + 20):
        servicer.registry.register(
            WorkerState(WorkerId(f"w{i}"), "1", "both", f"w{i}:1", "m", 1024, 16, 100)
        )
        silence(servicer, f"w{i}")
        await servicer.sweep()
    assert notices("dropped") == dropped + 20
    waiting = await gateway.close()
    assert len(waiting) == MAX_NOTICES  # the oldest ones, in order
    assert [r.lost.workers[0].worker_id for r in waiting] == [f"w{i}" for i in range(MAX_NOTICES)]


async def test_a_heartbeat_from_a_dropped_worker_is_told_so_and_its_stream_ends() -> None:
    servicer = new_servicer()
    worker = Worker(servicer, "w0")
    await worker.register()
    silence(servicer, "w0")
    await servicer.sweep()
    assert not servicer.is_registered(WorkerId("w0"))
    worker.beat()  # the thawed worker speaks again, on its old stream
    command = await next_of(worker.commands)
    assert command.dropped
    assert command.reason.startswith("missed heartbeats for 6")
    assert command.reason.endswith(": dropped; register again under a new incarnation")
    assert await rest_of(worker.commands) == []  # the scheduler ended the stream
    assert not servicer.is_registered(WorkerId("w0"))  # the beat did not bring it back


async def test_streams_that_broke_in_the_schedulers_own_stall_keep_their_workers() -> None:
    """Stopped past its workers' ping timeout, the scheduler wakes to find their streams
    ended without a goodbye while they reconnect: the workers stay registered; an old
    stream's end read after its worker registered again leaves the new entry (and its
    blocks) alone; one never back goes after the timeout and RECONNECT_S, no gateway told. A
    goodbye, or a break while the scheduler runs, removes the worker at once."""
    clock = Clock()
    registry = WorkerRegistry(1.5, clock=clock)
    servicer = SchedulerServicer(registry, InMemoryDirectory(), RoutingPolicy())
    gateway = Gateway(servicer)
    await gateway.open()
    workers = {name: Worker(servicer, name) for name in ("w0", "w1", "w2", "w3")}
    for w in workers.values():
        await w.register()
    await servicer.sweep()
    clock.now += 10.0  # stopped 10 s
    await workers["w0"].end()  # its transport broke: the stream ends, no goodbye
    assert servicer.is_registered(WorkerId("w0"))
    again = Worker(servicer, "w1")  # w1 registered on a new stream before its old one ended
    await again.register()
    stored = KVEventBatch(1, [BlockStored([BlockHash(7)], None, 16)])
    await servicer.directory.apply(WorkerId("w1"), "w1-1", stored)  # re-announced
    await workers["w1"].end()
    assert registry.get(WorkerId("w1")) is again.registered
    assert await servicer.directory.num_blocks(WorkerId("w1"), "w1-1") == 1
    await workers["w2"].end(leaving=True)  # said goodbye: gone, stall or not
    assert not servicer.is_registered(WorkerId("w2"))
    await servicer.sweep()  # the late sweep: a stall, nobody expires
    assert all(servicer.is_registered(WorkerId(n)) for n in ("w0", "w1", "w3"))
    listed = await servicer.ListWorkers(scheduler_pb2.ListWorkersRequest(), Context())  # type: ignore[arg-type]
    # what operators see: the one whose stream broke and that is not back is detached
    assert {w.registration.worker_id: w.detached for w in listed.workers} == {
        "w0": True, "w1": False, "w3": False}  # fmt: skip
    while servicer.is_registered(WorkerId("w0")):  # w1 and w3 heard from; w0 never back
        assert clock.now < 1010.0 + 1.5 + RECONNECT_S + 0.5
        clock.now += 0.25
        for n in ("w1", "w3"):
            assert registry.heartbeat(WorkerId(n), f"{n}-1", WorkerLoad())
        await servicer.sweep()
    assert clock.now > 1010.0 + 1.5 + RECONNECT_S
    assert not registry.stalled()  # a heartbeat timeout after the stall's sweep
    await workers["w3"].end()  # broke while the scheduler runs: gone at once
    assert not servicer.is_registered(WorkerId("w3"))
    assert [n for n in ("w0", "w1", "w2", "w3") if servicer.is_registered(WorkerId(n))] == ["w1"]
    assert await gateway.close() == []  # nobody was announced lost


class GatedDirectory(InMemoryDirectory):
    """Route calls wait in the directory lookup until ``gate`` opens: calls in flight."""

    def __init__(self, waiting_for: int) -> None:
        super().__init__()
        self.gate = asyncio.Event()
        self.all_waiting = asyncio.Event()
        self.waiting, self.waiting_for = 0, waiting_for

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, Match]:
        self.waiting += 1
        if self.waiting >= self.waiting_for:
            self.all_waiting.set()
        await self.gate.wait()
        return await super().longest_prefix(hashes, live)


async def start(impl: SchedulerServicer) -> tuple[Any, int]:
    s = server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(impl, s)
    port = s.add_insecure_port("127.0.0.1:0")
    await s.start()
    return s, port


@pytest.mark.parametrize("hook_fails", [False, True])
async def test_route_client_hands_the_notice_to_its_hook_and_calls_in_flight_still_end(
    hook_fails: bool,
) -> None:
    directory = GatedDirectory(waiting_for=5)
    impl = SchedulerServicer(WorkerRegistry(1.5), directory, RoutingPolicy())
    for name in ("w0", "w1"):
        impl.registry.register(WorkerState(WorkerId(name), "1", "both", f"{name}:1", "m", 1024,
                                           16, 100))  # fmt: skip
    heard: list[list[scheduler_pb2.LostWorker]] = []
    got_it = asyncio.Event()

    def on_workers_lost(workers: list[scheduler_pb2.LostWorker]) -> None:
        heard.append(workers)
        got_it.set()
        if hook_fails:
            raise RuntimeError("a bug in the hook")

    srv, port = await start(impl)
    ch = channel(f"127.0.0.1:{port}")
    client = RouteClient(scheduler_pb2_grpc.GlobalSchedulerStub(ch), on_workers_lost)
    calls: list[asyncio.Task[scheduler_pb2.RouteResponse]] = []
    try:
        calls += [
            asyncio.create_task(
                client.route(scheduler_pb2.RouteRequest(request_id=f"r{i}", model="m"), 10.0, "t")
            )
            for i in range(5)
        ]
        await asyncio.wait_for(directory.all_waiting.wait(), BOUND_S)  # all five in flight
        stream = client.stream
        silence(impl, "w1")
        await impl.sweep()
        await asyncio.wait_for(got_it.wait(), BOUND_S)
        assert [[w.worker_id for w in ws] for ws in heard] == [["w1"]]
        directory.gate.set()
        routes = await asyncio.wait_for(asyncio.gather(*calls), BOUND_S)
        assert all(r.decode.worker_id in ("w0", "w1") for r in routes)
        assert client.stream is stream and stream is not None  # the same stream, still open
        after = await client.route(scheduler_pb2.RouteRequest(request_id="x", model="m"), 5, "t")
        assert after.decode.worker_id == "w0" and client.stream is stream
    finally:
        for call in calls:
            call.cancel()
        await client.close()
        await ch.close()
        await srv.stop(0)
