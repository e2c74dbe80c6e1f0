"""Route calls over the gateway's long-lived RouteStream (services/gateway/route_client.py)
against the real scheduler servicer in this process: concurrent calls share one stream and
each gets its own answer, a failure ends only its call, and a lost or missing stream falls
back to unary Route calls."""

import asyncio

import grpc
import pytest
from grpc import aio

from services.gateway.route_client import RouteClient, RouteFailed
from services.global_scheduler.directory import InMemoryDirectory
from services.global_scheduler.registry import WorkerLoad, WorkerRegistry, WorkerState
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.server import SchedulerServicer
from shared.ids import WorkerId
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import channel, server


def servicer() -> SchedulerServicer:
    registry = WorkerRegistry(60.0)
    for name in ("w0", "w1"):
        w = WorkerState(WorkerId(name), "i", "both", f"{name}:1", "m", 1024, 16, 100)
        w.load = WorkerLoad()
        registry.register(w)
    return SchedulerServicer(registry, InMemoryDirectory(), RoutingPolicy())


class UnaryOnly(scheduler_pb2_grpc.GlobalSchedulerServicer):
    """A scheduler from before RouteStream: Route only."""

    def __init__(self) -> None:
        self.inner = servicer()

    async def Route(self, request, context):  # type: ignore[no-untyped-def]
        return await self.inner.Route(request, context)


async def start(
    impl: scheduler_pb2_grpc.GlobalSchedulerServicer, port: int = 0
) -> tuple[aio.Server, int]:
    s = server()
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(impl, s)
    port = s.add_insecure_port(f"127.0.0.1:{port}")
    await s.start()
    return s, port


def request(i: int, model: str = "m") -> scheduler_pb2.RouteRequest:
    return scheduler_pb2.RouteRequest(request_id=f"r{i}", model=model, num_prompt_tokens=8)


class Setup:
    """A scheduler server on a free port and a gateway RouteClient talking to it."""

    def __init__(self, impl: scheduler_pb2_grpc.GlobalSchedulerServicer):
        self.impl = impl

    async def __aenter__(self) -> "Setup":
        self.server, self.port = await start(self.impl)
        self.channel = channel(f"127.0.0.1:{self.port}")
        self.client = RouteClient(scheduler_pb2_grpc.GlobalSchedulerStub(self.channel))
        return self

    async def restart(self, impl: scheduler_pb2_grpc.GlobalSchedulerServicer) -> None:
        await self.server.stop(0)
        self.server, _ = await start(impl, self.port)

    async def __aexit__(self, *exc: object) -> None:
        await self.client.close()
        await self.channel.close()
        await self.server.stop(0)


async def test_concurrent_calls_share_one_stream_and_get_their_own_answers() -> None:
    impl = servicer()
    async with Setup(impl) as setup:
        client = setup.client
        routes = await asyncio.gather(*(client.route(request(i), 5.0, "t") for i in range(40)))
        stream = client.stream
        assert stream is not None and client.streaming
        assert {r.decode.worker_id for r in routes} == {"w0", "w1"}  # load spreads
        routed = sum(w.num_routed for w in impl.registry.workers())
        assert routed == 40  # every call routed exactly once
        with pytest.raises(RouteFailed) as e:
            await client.route(request(99, model="nope"), 5.0, "t")
        assert e.value.code == grpc.StatusCode.NOT_FOUND and "nope" in e.value.details
        again = await client.route(request(100), 5.0, "t")  # the failure ended one call only
        assert again.decode.worker_id in ("w0", "w1") and client.stream is stream
        # no heartbeats here: all 41 routes are in transit until the gateway says they finished
        assert sum(w.in_transit for w in impl.registry.workers()) == 41
        for i in [*range(40), 100]:
            client.finished(f"r{i}")
        await client.route(request(101), 5.0, "t")  # carries the notices
        assert sum(w.in_transit for w in impl.registry.workers()) == 1


async def test_a_restarted_scheduler_gets_a_new_stream() -> None:
    async with Setup(servicer()) as setup:
        client = setup.client
        await client.route(request(0), 5.0, "t")
        first = client.stream
        await setup.restart(servicer())
        route = await client.route(request(1), 10.0, "t")  # unary fallback or a new stream
        assert route.decode.worker_id in ("w0", "w1")
        await client.route(request(2), 10.0, "t")
        assert client.stream is not None and client.stream is not first


async def test_a_scheduler_without_route_stream_is_used_through_unary_calls() -> None:
    async with Setup(UnaryOnly()) as setup:
        client = setup.client
        for i in range(3):
            route = await client.route(request(i), 5.0, "t")
            assert route.decode.worker_id in ("w0", "w1")
        assert not client.streaming
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await client.route(request(9, model="nope"), 5.0, "t")
        assert e.value.code() == grpc.StatusCode.NOT_FOUND


async def test_callers_that_give_up_do_not_break_the_shared_stream() -> None:
    """Clients leave at any moment (their route task is cancelled): the stream's one writer
    finishes every write, so the stream stays open for everyone else (a cancelled write
    used to end the call for all)."""
    import random

    async with Setup(servicer()) as setup:
        client, rng = setup.client, random.Random(0)
        await client.route(request(0), 5.0, "t")
        stream = client.stream

        async def one(i: int) -> bool:
            task = asyncio.create_task(client.route(request(i), 5.0, "t"))
            await asyncio.sleep(rng.choice([0, 0, 0.0001, 0.001]))
            if rng.random() < 0.5:
                task.cancel()
            try:
                await task
                return True
            except asyncio.CancelledError:
                return False

        done = await asyncio.gather(*(one(i) for i in range(1, 301)))
        assert 0 < sum(done) < 300  # some finished, some gave up
        assert client.stream is stream and stream is not None and not stream.pending
        route = await client.route(request(999), 5.0, "t")
        assert route.decode.worker_id in ("w0", "w1") and client.stream is stream
