"""One long-lived bidirectional gRPC call shared by many requests (the gateway's RouteStream to
the scheduler and GenerateStream to each worker).

One writer task sends what callers queue (a caller cancelled in the middle of a write would
otherwise end the call for every request on it); one reader task hands each message to the
owner. When the call ends, the owner hears it once, with the error (None: the server closed
it), and the call is torn down. ``pending`` is the owner's per-stream bookkeeping: the requests
waiting on this stream, which must hear that it ended.
"""

import asyncio
import logging
from collections.abc import Callable
from typing import Any, Generic, TypeVar

import grpc

logger = logging.getLogger(__name__)

Send = TypeVar("Send")
Recv = TypeVar("Recv")


class CallStream(Generic[Send, Recv]):
    def __init__(
        self,
        call: grpc.aio.StreamStreamCall,
        on_message: Callable[["CallStream[Send, Recv]", Recv], None],
        on_end: Callable[["CallStream[Send, Recv]", BaseException | None], None],
        name: str,
    ):
        self.call = call
        self.pending: dict[Any, Any] = {}
        self._outbox: asyncio.Queue[Send] = asyncio.Queue()
        self._on_message, self._on_end = on_message, on_end
        self._ended = False
        loop = asyncio.get_running_loop()
        self._tasks = [
            loop.create_task(self._write(), name=f"{name}-writer"),
            loop.create_task(self._read(), name=f"{name}-reader"),
        ]

    def send(self, message: Send) -> None:
        self._outbox.put_nowait(message)

    async def _write(self) -> None:
        try:
            while True:
                await self.call.write(await self._outbox.get())
        except Exception:
            # Any failed write leaves the call unusable, but its error may not say why: a write
            # racing the server's end of the call fails INTERNAL ("execute_batch") where the
            # call itself ended UNIMPLEMENTED (a server without the method, which the client
            # must hear to go unary). The reader hears the call's own status and ends the
            # stream with it; cancelling ends a call still open, so the reader ends either way.
            self.call.cancel()

    async def _read(self) -> None:
        try:
            async for message in self.call:
                self._on_message(self, message)
            self._end(None)
        except Exception as e:  # a task that died quietly would leave its requests waiting
            self._end(e)

    def _end(self, error: BaseException | None) -> None:
        if not self._ended:
            self._ended = True
            self._on_end(self, error)
            self.close()

    def fail(self, error: BaseException) -> None:
        """End the stream now, as if the call had failed with ``error``: the owner hears it
        (every request waiting on it ends), then the call is torn down."""
        self._end(error)

    def close(self) -> None:
        self.call.cancel()
        current = asyncio.current_task()
        for task in self._tasks:
            if task is not current:
                task.cancel()

    async def aclose(self) -> None:
        self._ended = True  # closed by its owner: no end to report
        self.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)


class StreamClient(Generic[Send, Recv]):
    """A client's one long-lived ``CallStream`` to a server: opened on first use and forgotten
    when it ends, so the next use opens a new one; a server without the method (UNIMPLEMENTED:
    an older version during a rolling upgrade) is called unary from then on. A subclass starts
    the call, takes each message, and tells the calls still waiting on a stream that ended."""

    def __init__(self, method: str, peer: str, streaming: bool = True):
        self._method, self._peer = method, peer  # for the logs: "RouteStream", "the scheduler"
        self._stream: CallStream[Send, Recv] | None = None
        self._streaming = streaming  # False: unary (configured, or the server has no stream)

    @property
    def stream(self) -> CallStream[Send, Recv] | None:
        """The stream open now (None: none yet, or the last one ended, or calls go unary)."""
        return self._stream

    @property
    def streaming(self) -> bool:
        """Whether calls go over the stream (False: unary, configured so or because the server
        has no such method)."""
        return self._streaming

    def _start_call(self) -> grpc.aio.StreamStreamCall:
        raise NotImplementedError

    def _on_message(self, stream: CallStream[Send, Recv], message: Recv) -> None:
        raise NotImplementedError

    def _end_pending(self, stream: CallStream[Send, Recv]) -> None:
        """The calls waiting on ``stream`` (``stream.pending``) hear that it ended."""
        raise NotImplementedError

    def _open(self) -> CallStream[Send, Recv]:
        if self._stream is None:
            self._stream = CallStream(
                self._start_call(), self._on_message, self._broken, self._method
            )
        return self._stream

    def _broken(self, stream: CallStream[Send, Recv], error: BaseException | None) -> None:
        if self._stream is stream:
            self._stream = None
            if unimplemented(error):
                logger.warning("%s has no %s: unary calls from now on", self._peer, self._method)
                self._streaming = False
            else:
                logger.warning("%s: %s ended (%s); the next call opens a new one",
                               self._peer, self._method, error)  # fmt: skip
        self._end_pending(stream)

    async def close(self) -> None:
        stream, self._stream = self._stream, None
        if stream is not None:
            await stream.aclose()


class CallFailed(Exception):
    """A call over a shared stream that ended with a status other than OK: its code and
    message, as a unary call would have ended (``AioRpcError``)."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details

    @classmethod
    def from_wire(cls, code: int, details: str) -> "CallFailed":
        return cls(_CODES.get(code, grpc.StatusCode.UNKNOWN), details)


_CODES = {c.value[0]: c for c in grpc.StatusCode}


def status_of(e: CallFailed | grpc.aio.AioRpcError) -> tuple[grpc.StatusCode, str]:
    """(code, details) of a failed call, over a shared stream or unary."""
    if isinstance(e, CallFailed):
        return e.code, e.details
    return e.code(), e.details() or e.code().name


def unimplemented(error: BaseException | None) -> bool:
    """The server has no such method (an older version during a rolling upgrade)."""
    return isinstance(error, grpc.aio.AioRpcError) and error.code() == grpc.StatusCode.UNIMPLEMENTED
