"""An ASGI middleware that refuses request bodies over a size limit with 413, whether the
client declares the length or streams the body chunked."""

import json
from typing import Any

from services.gateway import errors

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
                await self._reply(send, errors.bad_request("invalid Content-Length header"))
                return
            if int(declared) > self.limit:
                await self._reply(send, errors.too_large(self.limit))
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
                await self._reply(send, errors.too_large(self.limit))

    @staticmethod
    async def _reply(send: Any, e: errors.APIError) -> None:
        body = json.dumps(e.body()).encode()
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
        ]
        await send({"type": "http.response.start", "status": e.status, "headers": headers})
        await send({"type": "http.response.body", "body": body})
