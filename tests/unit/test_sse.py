"""The gateway's SSE response: it streams in the request's own task, and a client that leaves
mid-stream ends the line iterator where it waits (what aborts the request on the workers),
without the cancellation leaking out of the response."""

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

import pytest

from services.gateway.sse import EventStream


class Client:
    """An ASGI peer: ``receive`` blocks until ``leave()``, then says http.disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self._left = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self._left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)

    def leave(self) -> None:
        self._left.set()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]


def test_streams_every_line_then_ends_the_body() -> None:
    async def lines() -> AsyncGenerator[str, None]:
        yield "data: 1\n\n"
        yield "data: [DONE]\n\n"

    async def run() -> Client:
        client = Client()
        await EventStream(lines(), {"cache-control": "no-cache"})(
            {"type": "http"}, client.receive, client.send
        )
        return client

    client = asyncio.run(run())
    start = client.sent[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    headers = dict(start["headers"])
    assert headers[b"content-type"].startswith(b"text/event-stream")
    assert headers[b"cache-control"] == b"no-cache"
    assert b"content-length" not in headers  # a stream has no length
    assert client.bodies() == [b"data: 1\n\n", b"data: [DONE]\n\n", b""]
    assert client.sent[-1]["more_body"] is False


def test_a_client_leaving_mid_stream_closes_the_lines_where_they_wait() -> None:
    cleaned = asyncio.Event()
    waiting = asyncio.Event()

    async def lines() -> AsyncGenerator[str, None]:
        try:
            yield "data: first\n\n"
            waiting.set()
            await asyncio.sleep(3600)  # a long prefill: no token for a while
            yield "data: never\n\n"
        finally:
            cleaned.set()  # the orchestrator's cleanup: abort on the workers

    async def run() -> tuple[Client, bool]:
        client = Client()
        response = asyncio.ensure_future(
            EventStream(lines())({"type": "http"}, client.receive, client.send)
        )
        await waiting.wait()
        client.leave()
        await asyncio.wait_for(response, 5)  # returns, not cancelled
        return client, response.cancelled()

    client, cancelled = asyncio.run(run())
    assert not cancelled and cleaned.is_set()
    assert client.bodies() == [b"data: first\n\n"]  # nothing after the client left


def test_the_request_task_is_not_left_cancelled() -> None:
    """After the client left, the task that served the stream can go on awaiting (uvicorn
    finishes the request in it)."""

    async def lines() -> AsyncGenerator[str, None]:
        yield "data: first\n\n"
        await asyncio.sleep(3600)
        yield "never"  # pragma: no cover

    async def serve(client: Client) -> str:
        await EventStream(lines())({"type": "http"}, client.receive, client.send)
        task = asyncio.current_task()
        assert task is not None and task.cancelling() == 0
        await asyncio.sleep(0.01)  # would raise if a cancel were still pending
        return "finished"

    async def run() -> str:
        client = Client()
        served = asyncio.ensure_future(serve(client))
        await asyncio.sleep(0.05)
        client.leave()
        return await asyncio.wait_for(served, 5)

    assert asyncio.run(run()) == "finished"


def test_a_cancel_from_outside_is_not_swallowed() -> None:
    """The server stopping cancels the request's task: that must propagate."""
    cleaned = asyncio.Event()

    async def lines() -> AsyncGenerator[str, None]:
        try:
            yield "data: first\n\n"
            await asyncio.sleep(3600)
            yield "never"  # pragma: no cover
        finally:
            cleaned.set()

    async def run() -> None:
        client = Client()
        response = asyncio.ensure_future(
            EventStream(lines())({"type": "http"}, client.receive, client.send)
        )
        await asyncio.sleep(0.05)
        response.cancel()
        with pytest.raises(asyncio.CancelledError):
            await response

    asyncio.run(run())
    assert cleaned.is_set()
