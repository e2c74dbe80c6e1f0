"""The gateway's /metrics: with ``--metrics-port`` it is served (with /health and /ready, for
probes and scrapers that carry no key) on that port only, and the API port answers it 404;
without it, it stays on the API port, behind the API keys when there are some.

The app runs in this process, lifespan and all, against a scheduler on loopback (the real
servicer, with a worker registered or none)."""

import contextlib
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
from fastapi import FastAPI

from services.gateway.app import NOT_READY, create_app
from services.gateway.settings import GatewaySettings
from services.global_scheduler.directory import InMemoryDirectory
from services.global_scheduler.registry import WorkerLoad, WorkerRegistry, WorkerState
from services.global_scheduler.routing import RoutingPolicy
from services.global_scheduler.server import SchedulerServicer
from shared import rpc
from shared.ids import WorkerId
from shared.protos.baton.v1 import scheduler_pb2_grpc

NO_SCHEDULER = "127.0.0.1:9"  # nothing listens there: never ready
PROMETHEUS = "# TYPE baton_asyncio_tasks gauge"  # (exported as the gateway starts)


@contextlib.asynccontextmanager
async def scheduler_with_a_worker() -> AsyncIterator[str]:
    """A scheduler on loopback whose registry holds one live worker of model ``m``."""
    registry = WorkerRegistry(60.0)
    w = WorkerState(WorkerId("w0"), "i", "both", "127.0.0.1:1", "m", 1024, 16, 100)
    w.load = WorkerLoad()
    registry.register(w)
    server = rpc.server()
    servicer = SchedulerServicer(registry, InMemoryDirectory(), RoutingPolicy())
    scheduler_pb2_grpc.add_GlobalSchedulerServicer_to_server(servicer, server)
    port = rpc.add_port(server, "127.0.0.1:0")
    await server.start()
    try:
        yield f"127.0.0.1:{port}"
    finally:
        await server.stop(0)


@contextlib.asynccontextmanager
async def gateway(
    model: Path,
    scheduler: str = NO_SCHEDULER,
    metrics_port: int | None = None,
    api_keys: tuple[str, ...] = (),
) -> AsyncIterator[tuple[httpx.AsyncClient, FastAPI]]:
    """The gateway app started (its lifespan run) and a client of its API port."""
    models = {"m": str(model.parent)}
    app = create_app(GatewaySettings(scheduler, models, metrics_port=metrics_port,
                                     api_keys=api_keys))  # fmt: skip
    async with app.router.lifespan_context(app):
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://api") as api:
            yield api, app


async def probes(app: FastAPI, path: str) -> httpx.Response:
    async with httpx.AsyncClient() as client:
        return await client.get(f"http://127.0.0.1:{app.state.metrics_port}{path}", timeout=5)


async def test_metrics_port_serves_metrics_and_mirrors_ready(smollm2_gguf: Path) -> None:
    async with gateway(smollm2_gguf, metrics_port=0) as (api, app):
        moved = await api.get("/metrics")
        assert moved.status_code == 404
        assert moved.json()["error"]["type"] == "invalid_request_error"  # OpenAI's error JSON
        scraped = await probes(app, "/metrics")
        assert scraped.status_code == 200 and PROMETHEUS in scraped.text
        assert (await probes(app, "/health")).status_code == 200
        assert (await api.get("/health")).status_code == 200
        # no scheduler: neither port is ready, for the same reason
        api_ready, probe_ready = await api.get("/ready"), await probes(app, "/ready")
        assert api_ready.status_code == probe_ready.status_code == 503
        assert probe_ready.json()["detail"] == NOT_READY
        assert NOT_READY in api_ready.json()["error"]["message"]
    async with (
        scheduler_with_a_worker() as address,
        gateway(smollm2_gguf, address, metrics_port=0) as (api, app),
    ):
        assert (await api.get("/ready")).status_code == 200  # a worker serves m
        probe_ready = await probes(app, "/ready")
        assert probe_ready.status_code == 200, probe_ready.text
        assert probe_ready.json()["status"] == "ok"


async def test_metrics_on_the_api_port_need_a_key_when_there_are_keys(smollm2_gguf: Path) -> None:
    async with gateway(smollm2_gguf, api_keys=("k1",)) as (api, app):
        refused = await api.get("/metrics")
        assert refused.status_code == 401
        assert refused.json()["error"]["code"] == "invalid_api_key"
        wrong = await api.get("/metrics", headers={"authorization": "Bearer k2"})
        assert wrong.status_code == 401
        keyed = await api.get("/metrics", headers={"authorization": "Bearer k1"})
        assert keyed.status_code == 200 and PROMETHEUS in keyed.text
        assert (await api.get("/health")).status_code == 200  # probes carry no key
        assert (await api.get("/ready")).status_code == 503  # (no scheduler), but not a 401
        assert not hasattr(app.state, "metrics_port")  # no probe server
    async with gateway(smollm2_gguf) as (api, _):  # no keys: open, as local runs read it
        scraped = await api.get("/metrics")
        assert scraped.status_code == 200 and PROMETHEUS in scraped.text
