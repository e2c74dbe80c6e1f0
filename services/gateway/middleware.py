"""The gateway's pure ASGI middleware (Starlette's ``BaseHTTPMiddleware`` costs about a
millisecond per streamed request, a third of the control plane's latency budget):

- ``RequestContext``: the request id (``x-request-id``, made if absent) into the logging
  context and the response, the API key check on ``/v1/*`` and ``/metrics`` (401; probes,
  ``/health`` and ``/ready``, carry no key), requests counted by status.
- ``BodySizeLimit``: bodies over the limit get 413, whether the client declares the length or
  streams the body chunked.
"""

import hmac
import json
import uuid
from typing import Any

from services.gateway import errors, metrics
from shared import hop_trace
from shared.logs import REQUEST_ID_HEADER, request_id_var

_COUNTED = ("/v1/completions", "/v1/chat/completions")
_KEYED = ("/metrics",)  # besides /v1/*: the API keys guard it too (it shows traffic and load)

Scope = dict[str, Any]


class _TooLarge(Exception):
    pass


class BodySizeLimit:
    def __init__(self, app: Any, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers", [])).get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await reply(send, errors.bad_request("invalid Content-Length header"))
                return
            if int(declared) > self.limit:
                await reply(send, errors.too_large(self.limit))
                return
        received = 0
        started = False

        async def limited_receive() -> dict[str, Any]:
            nonlocal received
            message: dict[str, Any] = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise _TooLarge
            return message

        async def tracking_send(message: dict[str, Any]) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await reply(send, errors.too_large(self.limit))


async def reply(
    send: Any, e: errors.APIError, extra_headers: tuple[tuple[bytes, bytes], ...] = ()
) -> None:
    """Send ``e`` as the whole response (before anything else was sent)."""
    body = json.dumps(e.body()).encode()
    headers = [
        (b"content-type", b"application/json"),
        (b"content-length", str(len(body)).encode()),
        *extra_headers,
    ]
    await send({"type": "http.response.start", "status": e.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class RequestContext:
    def __init__(self, app: Any, api_keys: tuple[str, ...]):
        self.app = app
        self.api_keys = tuple(k.encode() for k in api_keys)

    async def __call__(self, scope: Scope, receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers", []))
        rid = headers.get(REQUEST_ID_HEADER.encode(), b"").decode("latin-1") or uuid.uuid4().hex
        request_id_var.set(rid)
        hop_trace.mark("gateway.asgi")
        rid_header = (REQUEST_ID_HEADER.encode(), rid.encode("latin-1"))
        path = scope.get("path", "")
        keyed = path.startswith("/v1/") or path in _KEYED
        if self.api_keys and keyed and not self._authorized(headers):
            await reply(send, errors.unauthorized(), (rid_header,))
            return

        async def send_with_id(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                message["headers"] = [*message.get("headers", []), rid_header]
                if path in _COUNTED:
                    metrics.REQUESTS.labels(path, str(message["status"])).inc()
            await send(message)

        await self.app(scope, receive, send_with_id)

    def _authorized(self, headers: dict[bytes, bytes]) -> bool:
        scheme, _, token = headers.get(b"authorization", b"").partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        return any(hmac.compare_digest(token.strip(), key) for key in self.api_keys)
