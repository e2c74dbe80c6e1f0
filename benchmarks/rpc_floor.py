"""The floor under the control plane's overhead: what the transports alone cost on this
machine, with nothing behind them. Each server runs in its own process (uvloop, as the
services do); one client request at a time; p50 of ``--requests``.

    http  a FastAPI/uvicorn endpoint that validates a 64-token completion body and streams one
          SSE chunk back, timed by httpx to the first ``data:`` line (the gateway's in + out)
    grpc  a unary call (``Route``'s shape) and one message each way on an open bidirectional
          stream, grpc.aio

    python benchmarks/rpc_floor.py
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def http_server(port: int) -> None:
    import uvicorn
    from fastapi import FastAPI
    from fastapi.responses import StreamingResponse
    from pydantic import BaseModel

    class Body(BaseModel):
        model: str
        prompt: list[int]
        max_tokens: int = 1
        stream: bool = True

    app = FastAPI()

    async def chunks() -> AsyncIterator[str]:
        yield "data: " + json.dumps({"choices": [{"index": 0, "text": "x"}]}) + "\n\n"
        yield "data: [DONE]\n\n"

    @app.post("/v1/completions")
    async def completions(body: Body) -> StreamingResponse:
        return StreamingResponse(chunks(), media_type="text/event-stream")

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning", loop="uvloop")


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


async def time_http(port: int, n: int) -> list[float]:
    import httpx

    body = {"model": "m", "prompt": list(range(64)), "max_tokens": 1, "stream": True}
    out = []
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}") as http:
        for _ in range(n + 20):
            start = time.perf_counter()
            async with http.stream("POST", "/v1/completions", json=body) as resp:
                first = 0.0
                async for line in resp.aiter_lines():  # to the end: the connection is reused
                    if line.startswith("data: ") and not first:
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
    p.add_argument("--serve", choices=["http", "grpc"], help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.serve:
        (http_server if args.serve == "http" else grpc_server)(args.port)
        return

    import uvloop

    from baton.launcher import free_port

    ports = {"http": free_port(), "grpc": free_port()}
    servers = [subprocess.Popen([sys.executable, __file__, "--serve", kind, "--port", str(port)])
               for kind, port in ports.items()]  # fmt: skip
    try:
        for port in ports.values():
            wait_listening(port, 30.0)
        http = uvloop.run(time_http(ports["http"], args.requests))
        unary, stream = uvloop.run(time_grpc(ports["grpc"], args.requests))
    finally:
        for s in servers:
            s.terminate()
            s.wait(timeout=10)
    p50 = {
        "http_streamed_first_chunk_ms": 1e3 * statistics.median(http),
        "grpc_unary_ms": 1e3 * statistics.median(unary),
        "grpc_stream_round_trip_ms": 1e3 * statistics.median(stream),
    }
    print(json.dumps(p50, indent=2))


if __name__ == "__main__":
    main()
