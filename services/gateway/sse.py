"""A server-sent-event response that streams in the request's own task.

Starlette's ``StreamingResponse`` (under uvicorn, whose ASGI spec version is 2.3) runs every
stream in an anyio task group: the body in a task of its own, next to one that waits for the
client to leave. That is a task group, a task and their cancel scopes per request, and the
first chunk waits a turn of the event loop for the new task: about 0.06 ms of a streamed
request's time on this repository's VM, more when it is busy (docs/performance.md, "Where the
time goes": the SSE response in the request's own task, 0.06 ms).

Here the body streams in the task that already serves the request. One plain future waits for
``http.disconnect``; when the client leaves mid-stream, its callback cancels that task, which
closes the line iterator where it waits (so the orchestrator aborts the request on its
workers), as Starlette's cancel scope did. A client that stops reading is disconnected the
same way, by the HTTP edge (http_edge.py) once its buffers stay full past
``--stream-write-timeout``.
"""

import asyncio
from collections.abc import AsyncGenerator, Mapping

from starlette.responses import Response
from starlette.types import Receive, Scope, Send


class EventStream(Response):
    media_type = "text/event-stream"

    def __init__(self, lines: AsyncGenerator[str, None], headers: Mapping[str, str] | None = None):
        # as StreamingResponse does: no body, so no content-length
        self.status_code, self.background = 200, None
        self.init_headers(headers)
        self.lines = lines

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        task = asyncio.current_task()
        assert task is not None
        streaming, left = True, False

        def on_gone(f: "asyncio.Future[None]") -> None:
            nonlocal left
            if f.cancelled() or f.exception() is not None or not streaming:
                return  # stopped by us, or the stream had already ended: nothing to cut short
            left = True
            task.cancel()

        gone = asyncio.ensure_future(_until_disconnect(receive))
        gone.add_done_callback(on_gone)
        try:
            try:
                await send(
                    {"type": "http.response.start", "status": self.status_code,
                     "headers": self.raw_headers}
                )  # fmt: skip
                async for line in self.lines:
                    body = line.encode()
                    await send({"type": "http.response.body", "body": body, "more_body": True})
                await send({"type": "http.response.body", "body": b"", "more_body": False})
            finally:
                streaming = False  # a disconnect from here on changes nothing
                gone.cancel()
                await self.lines.aclose()
        except asyncio.CancelledError:
            if not left:
                raise  # cancelled from outside (the server is stopping): not ours to keep
            task.uncancel()  # the client left: the stream, and the request, end here


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass
