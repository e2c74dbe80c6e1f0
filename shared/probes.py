"""Kubernetes probes beside /metrics, on a service's metrics port (plain HTTP, no secret: a
kubelet probe carries none; what they say is not sensitive):

    GET /health   liveness: the service's event loop has ticked within ``stall_s`` (a worker
                  busy with a long prefill passes: its engine core runs in another process)
    GET /ready    readiness: the service says it can take work (a worker: its model loaded,
                  registered with a scheduler replica at least, not draining)
    GET /metrics  Prometheus

The server runs in a thread, as prometheus-client's own does; the two callables only read
flags the event loop sets.
"""

import asyncio
import json
import threading
import time
from collections.abc import Callable, Iterable
from socketserver import ThreadingMixIn
from typing import Any
from wsgiref.simple_server import WSGIRequestHandler, WSGIServer, make_server

from prometheus_client import make_wsgi_app

Check = Callable[[], tuple[bool, str]]  # (ok, why)


class _Server(ThreadingMixIn, WSGIServer):
    daemon_threads = True


class _Quiet(WSGIRequestHandler):
    def log_message(self, format: str, *args: Any) -> None:
        pass


class LoopTicker:
    """Liveness of an asyncio loop: ``run`` ticks every second; ``check`` fails once no tick
    came for ``stall_s``."""

    def __init__(self, stall_s: float = 30.0):
        self.stall_s = stall_s
        self.last = time.monotonic()

    async def run(self) -> None:
        while True:
            self.last = time.monotonic()
            await asyncio.sleep(1.0)

    def check(self) -> tuple[bool, str]:
        late = time.monotonic() - self.last
        return late < self.stall_s, f"event loop last ticked {late:.1f} s ago"


def start_probe_server(host: str, port: int, ready: Check, alive: Check) -> int:
    """Serve /health, /ready and /metrics on host:port in a daemon thread; the bound port."""
    metrics = make_wsgi_app()

    def app(environ: dict[str, Any], start_response: Callable[..., Any]) -> Iterable[bytes]:
        path = environ.get("PATH_INFO", "")
        if path in ("/health", "/ready"):
            ok, why = (alive if path == "/health" else ready)()
            body = json.dumps({"status": "ok" if ok else "unavailable", "detail": why}).encode()
            start_response("200 OK" if ok else "503 Service Unavailable",
                           [("Content-Type", "application/json")])  # fmt: skip
            return [body]
        return metrics(environ, start_response)

    httpd = make_server(host, port, app, _Server, handler_class=_Quiet)
    threading.Thread(target=httpd.serve_forever, name="probes", daemon=True).start()
    return int(httpd.server_port)
