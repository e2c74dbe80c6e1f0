"""The gateway's HTTP face (FastAPI): routes translate HTTP ⇄ ``Handler`` and nothing more.

    POST /v1/completions, /v1/chat/completions   OpenAI, streamed (SSE) or not
    GET  /v1/models, /v1/models/{id} (OpenAI's Model objects), /openapi.json
         (every request body described by the same pydantic models the routes validate with)
    GET  /metrics Prometheus, behind the API keys when there are some; with ``metrics_port``
                  it moves to that port (with /health and /ready, for probes and scrapers that
                  carry no key) and the API port answers it 404
    GET  /health  liveness: the process serves (always 200 while it does)
    GET  /ready   readiness: the scheduler answers and a worker of a served model is
                  registered (200), else 503 JSON with Retry-After (a load balancer stops
                  sending traffic here until it is ready again)

Every error leaves as OpenAI's error JSON with its status (errors.py): 400 bad input (pydantic's
422 included), 401 bad key, 404 unknown model or path, 408 body late (``--body-timeout``),
413 body too large, 503 no worker, 504 deadline. An unexpected exception is a logged 500,
never a crash. A client that goes away cancels its request, which aborts it on the workers.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any, TypeVar

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from services.gateway import errors, metrics
from services.gateway.catalog import ModelCatalog
from services.gateway.handler import SSE_DONE, Body, Handler, sse
from services.gateway.middleware import BodySizeLimit, RequestContext
from services.gateway.orchestrator import Orchestrator
from services.gateway.schemas import ChatCompletionRequest, CompletionRequest
from services.gateway.settings import GatewaySettings
from services.gateway.sse import EventStream
from services.gateway.worker_pool import WorkerChannels
from shared import hop_trace, rpc
from shared.affinity import pin_threads
from shared.lifecycle import TaskOwner, export_task_count
from shared.logs import request_id_var
from shared.probes import LoopTicker, start_probe_server
from shared.protos.baton.v1 import scheduler_pb2_grpc
from shared.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)

DISCONNECT_POLL_S = 0.25
RETRY_AFTER_S = 1  # a 503's Retry-After: a scheduler restart or a worker start takes seconds
NOT_READY = "the scheduler does not answer, or no worker serves a model"
B = TypeVar("B", bound=BaseModel)


def create_app(settings: GatewaySettings) -> FastAPI:
    tokenizers = {name: TextTokenizer(path) for name, path in settings.models.items()}
    state: dict[str, Any] = {}

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        sched_channel = rpc.channel(settings.scheduler_address)
        scheduler = scheduler_pb2_grpc.GlobalSchedulerStub(sched_channel)
        catalog = ModelCatalog(tokenizers, scheduler)
        workers = WorkerChannels(settings.generate_stream)
        state["catalog"] = catalog
        owner = TaskOwner("gateway")
        export_task_count()
        owner.spawn(catalog.refresh_forever(), "catalog-refresh")
        orchestrator = Orchestrator(scheduler, catalog, workers, settings.progress_timeout_s,
                                    settings.prefill_progress_s_per_token)  # fmt: skip
        state["handler"] = Handler(orchestrator, catalog, settings.request_timeout_s,
                                   settings.limits, settings.tool_call_parser)  # fmt: skip
        if settings.metrics_port is not None:
            app.state.metrics_port = _start_probes(settings.host, settings.metrics_port,
                                                   catalog, owner)  # fmt: skip
        if settings.cpus:
            pin_threads(settings.cpus)
        yield
        await owner.cancel_all()
        await orchestrator.close()
        await workers.close()
        await sched_channel.close()

    app = FastAPI(title="Baton", lifespan=lifespan, docs_url=None, redoc_url=None)
    app.add_middleware(BodySizeLimit, limit=settings.max_body_bytes)
    app.add_middleware(RequestContext, api_keys=settings.api_keys)  # outermost: runs first
    _install_error_handlers(app)
    _describe_bodies(app)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        body = await _parse(request, CompletionRequest, settings.edge.body_timeout_s)
        return await _serve(state["handler"], body, request, body.stream and body.include_usage)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        body = await _parse(request, ChatCompletionRequest, settings.edge.body_timeout_s)
        return await _serve(state["handler"], body, request, body.stream and body.include_usage)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        catalog: ModelCatalog = state["catalog"]
        return {"object": "list", "data": [catalog.card(m) for m in catalog.served]}

    # ``path``: a model id may hold slashes (``org/name``), as Hugging Face names do
    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str) -> dict[str, Any]:
        catalog: ModelCatalog = state["catalog"]
        card = catalog.card(model_id)
        if card is None:
            raise errors.model_not_found(model_id, catalog.served)
        return card

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.get("/ready")
    async def ready() -> Response:
        catalog: ModelCatalog = state["catalog"]
        models = await catalog.readiness()
        ok, why = readiness_verdict(models)
        if ok:
            return JSONResponse({"status": "ready", "models": models})
        e = errors.not_ready(why)
        return JSONResponse({**e.body(), "models": models}, status_code=e.status,
                            headers={"retry-after": str(RETRY_AFTER_S)})  # fmt: skip

    if settings.metrics_port is None:  # else on that port only (_start_probes)

        @app.get("/metrics")
        async def prometheus() -> Response:
            return Response(generate_latest(), media_type=CONTENT_TYPE_LATEST)

    return app


def readiness_verdict(models: dict[str, bool]) -> tuple[bool, str]:
    """What ``/ready`` says, on either port, given each served model's readiness
    (``ModelCatalog.ready``): ready while a live worker serves any of them."""
    serving = [m for m, ok in models.items() if ok]
    return (True, f"serving {', '.join(serving)}") if serving else (False, NOT_READY)


def _start_probes(host: str, port: int, catalog: ModelCatalog, owner: TaskOwner) -> int:
    """/health, /ready and /metrics on ``host:port`` (shared/probes.py, in a thread):
    /health while the event loop ticks, /ready from the catalog's last worker list (kept
    fresh by its refresh task; the API's /ready also refreshes it when a model is not ready,
    which a thread may not do); the bound port."""
    ticker = LoopTicker()
    owner.spawn(ticker.run(), "loop-ticker")

    def ready() -> tuple[bool, str]:
        return readiness_verdict({m: catalog.ready(m) for m in catalog.served})

    bound = start_probe_server(host, port, ready, ticker.check)
    logger.info("/health, /ready and /metrics on %s:%d", host, bound)
    return bound


BODIES: dict[str, type[BaseModel]] = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
}


def _describe_bodies(app: FastAPI) -> None:
    """/openapi.json with each route's request body: the routes read the raw body and validate
    it in one pass (``_parse``), so FastAPI does not see their models; the schema names them."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = get_openapi(title=app.title, version=app.version, routes=app.routes)
            components = schema.setdefault("components", {}).setdefault("schemas", {})
            for path, model in BODIES.items():
                body = model.model_json_schema(ref_template="#/components/schemas/{model}")
                components.update(body.pop("$defs", {}))
                components[model.__name__] = body
                ref = {"$ref": f"#/components/schemas/{model.__name__}"}
                schema["paths"][path]["post"]["requestBody"] = {
                    "required": True, "content": {"application/json": {"schema": ref}},
                }  # fmt: skip
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]


async def _parse(request: Request, schema: type[B], timeout_s: float) -> B:
    """The body, parsed and validated in one pass by pydantic's JSON parser. (As a FastAPI
    body parameter it went through FastAPI's dependency solving, ``json.loads`` and then
    validation of the Python objects: about a seventh of the gateway's Python calls per
    request.) Errors take the same path as FastAPI's: a 400 naming the field. A body that
    has not arrived within ``timeout_s`` is a 408 (and the connection closes)."""
    try:
        async with asyncio.timeout(timeout_s):
            raw = await request.body()
    except TimeoutError:
        metrics.EDGE.labels("body_timeout").inc()
        raise errors.request_timeout(timeout_s) from None
    try:
        return schema.model_validate_json(raw)
    except ValidationError as e:
        # the context carries a refusal's field (errors.refuse) and a ValueError's own message
        raise RequestValidationError(e.errors(include_url=False)) from None


async def _serve(handler: Handler, body: Body, request: Request, include_usage: bool) -> Response:
    hop_trace.mark("gateway.app")
    plan = await handler.plan(body, request_id_var.get())
    if body.stream:
        lines = handler.stream(plan, include_usage)
        # an error before the first chunk keeps its HTTP status; a client that leaves before
        # it (during the prefill) aborts the request at once, as it would later
        first = asyncio.ensure_future(anext(lines))
        if not await _unless_gone(first, request):
            await lines.aclose()
            return Response(status_code=499)
        hop_trace.mark("gateway.first_chunk")
        return EventStream(_stream_errors_inline(first.result(), lines),
                           {"cache-control": "no-cache"})  # fmt: skip
    task = asyncio.ensure_future(handler.complete(plan))
    if not await _unless_gone(task, request):
        return Response(status_code=499)
    return JSONResponse(task.result())


async def _unless_gone(task: "asyncio.Future[Any]", request: Request) -> bool:
    """Wait for ``task``; False (the task cancelled, which aborts the request on its workers)
    when the client leaves first."""
    watcher = asyncio.ensure_future(_watch_disconnect(request))
    done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    watcher.cancel()
    if task in done:
        return True
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    metrics.REQUESTS.labels(request.url.path, "disconnected").inc()
    return False


async def _stream_errors_inline(first: str, rest: AsyncIterator[str]) -> AsyncGenerator[str, None]:
    """After the headers are sent, an error is an ``error`` event, then ``[DONE]``."""
    yield first
    try:
        async for line in rest:
            yield line
    except errors.APIError as e:
        logger.warning("stream failed: %s", e.message)
        yield sse(e.body())
        yield SSE_DONE


async def _watch_disconnect(request: Request) -> None:
    while not await request.is_disconnected():
        await asyncio.sleep(DISCONNECT_POLL_S)


def _error(e: errors.APIError) -> JSONResponse:
    """OpenAI's error JSON; a 503 also says when to retry (the system is healing or scaling);
    after a 408 the connection closes (the rest of its body would arrive to nobody)."""
    headers = {"retry-after": str(RETRY_AFTER_S)} if e.status == 503 else None
    headers = {"connection": "close"} if e.status == 408 else headers
    return JSONResponse(e.body(), status_code=e.status, headers=headers)


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(errors.APIError)
    async def api_error(request: Request, e: errors.APIError) -> JSONResponse:
        if e.status >= 500:
            logger.warning("request failed: %s", e.message)
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError) -> JSONResponse:
        return _error(errors.from_validation(e.errors()))

    @app.exception_handler(ClientDisconnect)
    async def gone(request: Request, e: ClientDisconnect) -> Response:
        # the client left while its body was being read: nobody to answer, and no error
        metrics.REQUESTS.labels(request.url.path, "disconnected").inc()
        return Response(status_code=499)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException) -> JSONResponse:
        kind = "invalid_request_error" if e.status_code < 500 else "server_error"
        return _error(errors.APIError(e.status_code, str(e.detail), type=kind))

    @app.exception_handler(Exception)
    async def unexpected(request: Request, e: Exception) -> JSONResponse:
        logger.exception("unexpected error")
        return _error(errors.APIError(500, "internal error", type="server_error"))
