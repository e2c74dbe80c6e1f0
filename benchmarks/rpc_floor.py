"""The floor under the control plane's overhead: what the transports alone cost on this
machine, with nothing behind them. Each server runs in its own process (uvloop, as the
services do); one client request at a time; p50 of ``--requests``.

    http  a FastAPI/uvicorn endpoint that validates a 64-token completion body and streams one
          SSE chunk back, timed to the first ``data:`` line (the gateway's in + out) by two
          clients: httpx and aiohttp (the serving benchmark's); once with Starlette's
          StreamingResponse, once with the gateway's sse.EventStream
    grpc  a unary call (``Route``'s shape) and one message each way on an open bidirectional
          stream, grpc.aio
    route the real scheduler servicer (two idle workers): the gateway's Route as a unary
          call and over its RouteStream (services/gateway/route_client.py), alternating
    gateway the real gateway app (middleware, schemas, error handling, response path) with a
          handler that answers at once: its HTTP layer against the bare endpoint above

    python benchmarks/rpc_floor.py
"""

import argparse
import functools
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncGenerator, AsyncIterator
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


async def _one_chunk() -> AsyncGenerator[str, None]:
    """What every HTTP floor server streams: one completion chunk, then [DONE]."""
    yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
    yield "data: [DONE]\n\n"


def _serve_app(app: Any, port: int) -> None:
    import uvicorn

    # as the gateway runs: uvloop, no access log
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop",
                access_log=False)  # fmt: skip


def http_server(port: int, event_stream: bool = False) -> None:
    """A bare FastAPI endpoint; it streams with Starlette's ``StreamingResponse``, or with the
    gateway's ``sse.EventStream`` (``event_stream``)."""
    from fastapi import FastAPI
    from fastapi.responses import Response, StreamingResponse
    from pydantic import BaseModel

    from services.gateway.sse import EventStream

    class Body(BaseModel):
        model: str
        prompt: list[int]
        max_tokens: int = 1
        stream: bool = True

    app = FastAPI()

    @app.post("/v1/completions")
    async def completions(body: Body) -> Response:
        if event_stream:
            return EventStream(_one_chunk())
        return StreamingResponse(_one_chunk(), media_type="text/event-stream")

    _serve_app(app, port)


def gateway_server(port: int) -> None:
    """The gateway's app with its Handler replaced by one that answers at once."""
    import tempfile

    from baton.tiny_model import train_tokenizer
    from services.gateway import app as gateway_app
    from services.gateway.settings import GatewaySettings

    class Instant:
        def __init__(self, *args: object) -> None:
            pass

        async def plan(self, body: object, request_id: str) -> object:
            return body

        def stream(self, plan: object, include_usage: bool) -> AsyncIterator[str]:
            return _one_chunk()

    tokenizer = Path(tempfile.mkdtemp())
    train_tokenizer(tokenizer)
    gateway_app.Handler = Instant  # type: ignore[assignment,misc]
    settings = GatewaySettings(scheduler_address="127.0.0.1:1", models={"m": str(tokenizer)})
    _serve_app(gateway_app.create_app(settings), port)


def grpc_server(port: int) -> None:
    import grpc
    import uvloop
    from grpc import aio

    from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc

    class Scheduler(scheduler_pb2_grpc.GlobalSchedulerServicer):
        async def Route(self, request, context):  # type: ignore[no-untyped-def]
            return scheduler_pb2.RouteResponse(reason="floor")

    async def echo(requests, context):  # type: ignore[no-untyped-def]
        async for r in requests:
            yield r

    async def serve() -> None:
        server = aio.server()
        scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(Scheduler(), server)
        handler = grpc.stream_stream_rpc_method_handler(
            echo, request_deserializer=bytes, response_serializer=bytes
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Echo", {"Chat": handler}),)
        )
        server.add_insecure_port(f"127.0.0.1:{port}")
        await server.start()
        await server.wait_for_termination()

    uvloop.run(serve())


BODY = {"model": "m", "prompt": list(range(64)), "max_tokens": 1, "stream": True}


async def time_http(port: int, n: int) -> list[float]:
    """With httpx as the client (the e2e tests' and the openai package's)."""
    import httpx

    out = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(n + 20):
            start = time.perf_counter()
            async with http.stream("POST", "/v1/completions", json=BODY) as resp:
                first = 0.0
                async for line in resp.aiter_lines():  # to the end: the connection is reused
                    if line.startswith("data: ") and not first:
                        first = time.perf_counter() - start
                out.append(first)
    return out[20:]


async def time_aiohttp(port: int, n: int) -> list[float]:
    """With aiohttp as the client (the serving benchmark's, as in vLLM's)."""
    from benchmarks.serving import client

    out = []
    async with client(60) as http:
        for _ in range(n + 20):
            start = time.perf_counter()
            async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=BODY) as resp:
                first = 0.0
                async for line in resp.content:  # to the end: the connection is reused
                    if line.startswith(b"data: ") and not first:
                        first = time.perf_counter() - start
                out.append(first)
    return out[20:]


async def time_grpc(port: int, n: int) -> tuple[list[float], list[float]]:
    from grpc import aio

    from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc

    async with aio.insecure_channel(f"127.0.0.1:{port}") as ch:
        stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
        req = scheduler_pb2.RouteRequest(request_id="r", model="m", num_prompt_tokens=64,
                                         block_hashes=[bytes(16)] * 4)  # fmt: skip
        unary = []
        for _ in range(n + 20):
            start = time.perf_counter()
            await stub.Route(req, timeout=5)
            unary.append(time.perf_counter() - start)
        call = ch.stream_stream("/floor.Echo/Chat", request_serializer=bytes,
                                response_deserializer=bytes)()  # fmt: skip
        payload, stream = req.SerializeToString(), []
        for _ in range(n + 20):
            start = time.perf_counter()
            await call.write(payload)
            await call.read()
            stream.append(time.perf_counter() - start)
        await call.done_writing()
    return unary[20:], stream[20:]


def scheduler_server(port: int) -> None:
    """The real scheduler servicer with two idle workers."""
    import uvloop

    from services.global_scheduler.directory import InMemoryDirectory
    from services.global_scheduler.registry import WorkerLoad, WorkerRegistry, WorkerState
    from services.global_scheduler.routing import RoutingPolicy
    from services.global_scheduler.server import SchedulerServicer
    from shared.ids import WorkerId
    from shared.protos.baton.v1 import scheduler_pb2_grpc
    from shared.rpc import server

    registry = WorkerRegistry(3600.0)
    for name in ("w0", "w1"):
        w = WorkerState(WorkerId(name), "i", "both", f"{name}:1", "m", 1024, 16, 10**9)
        w.load = WorkerLoad()
        registry.register(w)

    async def serve() -> None:
        s = server()
        # no heartbeats here: a capacity filter would count every routed call as queued
        policy = RoutingPolicy({"filters": ["role", "healthy"]})
        impl = SchedulerServicer(registry, InMemoryDirectory(), policy)
        scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(impl, s)
        s.add_insecure_port(f"127.0.0.1:{port}")
        await s.start()
        await s.wait_for_termination()

    uvloop.run(serve())


async def time_route(port: int, n: int) -> tuple[list[float], list[float]]:
    """The gateway's Route: a unary call, and the same over its RouteStream, alternating."""
    from services.gateway.route_client import RouteClient
    from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
    from shared.rpc import channel, metadata

    ch = channel(f"127.0.0.1:{port}")
    stub = scheduler_pb2_grpc.GlobalSchedulerStub(ch)
    client = RouteClient(stub)
    unary, stream = [], []
    for i in range(n + 20):
        req = scheduler_pb2.RouteRequest(request_id=f"r{i}", model="m", num_prompt_tokens=64,
                                         block_hashes=[bytes(16)] * 4)  # fmt: skip
        start = time.perf_counter()
        await stub.Route(req, timeout=5, metadata=metadata("t"))
        unary.append(time.perf_counter() - start)
        start = time.perf_counter()
        await client.route(req, 5.0, "t")
        stream.append(time.perf_counter() - start)
    await client.close()
    await ch.close()
    return unary[20:], stream[20:]


def wait_listening(port: int, timeout_s: float) -> None:
    import socket

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.05)
    raise TimeoutError(f"nothing listens on port {port} after {timeout_s} s")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--requests", type=int, default=500)
    p.add_argument(
        "--serve",
        choices=["http", "http-sse", "grpc", "scheduler", "gateway"],
        help=argparse.SUPPRESS,
    )
    p.add_argument("--only-http", action="store_true", help="the bare endpoint and the gateway")
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        servers = {"http": http_server,
                   "http-sse": functools.partial(http_server, event_stream=True),
                   "grpc": grpc_server, "scheduler": scheduler_server,
                   "gateway": gateway_server}  # fmt: skip
        servers[args.serve](args.port)
        return

    import uvloop

    from baton.launcher import free_port

    kinds = ["http", "http-sse", "gateway"]
    kinds += [] if args.only_http else ["grpc", "scheduler"]
    ports = {kind: free_port() for kind in kinds}
    servers = [subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
               for kind, port in ports.items()]  # fmt: skip
    try:
        for port in ports.values():
            wait_listening(port, 30.0)
        p50: dict[str, float] = {}
        if not args.only_http:
            http = uvloop.run(time_http(ports["http"], args.requests))
            p50["http_streamed_first_chunk_httpx_ms"] = 1e3 * statistics.median(http)
        bare, own, gateway = [], [], []
        for _ in range(3):  # alternating: this machine's speed drifts
            bare += uvloop.run(time_aiohttp(ports["http"], args.requests // 3))
            own += uvloop.run(time_aiohttp(ports["http-sse"], args.requests // 3))
            gateway += uvloop.run(time_aiohttp(ports["gateway"], args.requests // 3))
        p50["http_streamed_first_chunk_aiohttp_ms"] = 1e3 * statistics.median(bare)
        p50["http_event_stream_first_chunk_aiohttp_ms"] = 1e3 * statistics.median(own)
        p50["gateway_app_first_chunk_aiohttp_ms"] = 1e3 * statistics.median(gateway)
        if not args.only_http:
            unary, stream = uvloop.run(time_grpc(ports["grpc"], args.requests))
            route_unary, route_stream = uvloop.run(time_route(ports["scheduler"], args.requests))
            p50.update(
                grpc_unary_ms=1e3 * statistics.median(unary),
                grpc_stream_round_trip_ms=1e3 * statistics.median(stream),
                route_unary_ms=1e3 * statistics.median(route_unary),
                route_stream_ms=1e3 * statistics.median(route_stream),
            )
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=10)
    print(json.dumps(p50, indent=2))


if __name__ == "__main__":
    main()
