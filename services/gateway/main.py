"""``baton gateway``: uvicorn serving the FastAPI app. uvicorn owns the lifecycle: on SIGTERM
it stops accepting, lets in-flight requests finish (bounded by ``timeout_graceful_shutdown``),
then runs the app's shutdown (closing the gRPC channels). Its connections are http_edge's
protocol: uvicorn's httptools one with the bounds a hostile client must not get past."""

import uvicorn

from services.gateway import http_edge
from services.gateway.app import create_app
from services.gateway.settings import GatewaySettings

GRACEFUL_SHUTDOWN_S = 30


def serve(settings: GatewaySettings) -> None:
    app = create_app(settings)
    uvicorn.run(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
        access_log=False,
        http=http_edge.protocol(settings.edge),
        ws="none",  # no WebSocket route: an upgrade request is a plain HTTP request
    )
