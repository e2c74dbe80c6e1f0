"""Route calls to the global scheduler over one long-lived ``RouteStream``.

A unary ``Route`` sets up an HTTP/2 stream per request; on this machine that is ~0.9 ms,
against ~0.3 ms for one message each way on a stream that is already open
(``benchmarks/rpc_floor.py``). The gateway therefore keeps one stream open, writes each call
with its own ``call_id`` and matches the replies, which come in completion order, to waiting
futures. A failure reply (no worker for the model, none left by the filters) ends only its own
call, as the unary status would.

When the stream breaks (the scheduler restarted, or a connection dropped), the calls waiting
on it are sent again as unary ``Route`` calls within their own deadlines, and the next call
opens a new stream; a scheduler without ``RouteStream`` (an older version during a rolling
upgrade) is used through unary calls from then on.
"""

import asyncio
import contextlib
import itertools
import logging

import grpc

from services.gateway import metrics
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import metadata

logger = logging.getLogger(__name__)


class RouteFailed(Exception):
    """The scheduler found no route: a status code and its message, as a unary call ends."""

    def __init__(self, code: grpc.StatusCode, details: str):
        super().__init__(details)
        self.code, self.details = code, details


class _StreamBroken(Exception):
    pass


_CODES = {c.value[0]: c for c in grpc.StatusCode}
MAX_FINISHED = 4096  # beyond this between two routes, the heartbeats catch up instead


class RouteClient:
    def __init__(self, stub: scheduler_pb2_grpc.GlobalSchedulerStub):
        self.stub = stub
        self._call: grpc.aio.StreamStreamCall | None = None
        self._reader: asyncio.Task[None] | None = None
        self._pending: dict[int, asyncio.Future[scheduler_pb2.RouteReply]] = {}
        self._ids = itertools.count(1)
        self._write_lock = asyncio.Lock()
        self._streaming = True  # False once the scheduler says it has no RouteStream
        self._finished: list[str] = []  # told to the scheduler with the next call

    def finished(self, request_id: str) -> None:
        """A routed request is over; the scheduler hears it with the next Route call (a
        quiet gateway leaves it to the workers' heartbeats)."""
        if len(self._finished) < MAX_FINISHED:
            self._finished.append(request_id)

    async def route(
        self, request: scheduler_pb2.RouteRequest, timeout: float, trace_id: str
    ) -> scheduler_pb2.RouteResponse:
        """The route, or RouteFailed; a grpc.aio.AioRpcError from a unary fallback; TimeoutError
        after ``timeout`` seconds."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        if self._finished:
            request.finished_request_ids.extend(self._finished)
            self._finished.clear()
        if self._streaming:
            try:
                reply = await self._over_stream(request, timeout, trace_id)
            except _StreamBroken:
                pass  # sent again below as a unary call, within what is left of its deadline
            else:
                metrics.ROUTE_CALLS.labels("stream").inc()
                if reply.HasField("failure"):
                    code = _CODES.get(reply.failure.code, grpc.StatusCode.UNKNOWN)
                    raise RouteFailed(code, reply.failure.message)
                return reply.route
        metrics.ROUTE_CALLS.labels("unary").inc()
        left = max(deadline - loop.time(), 0.001)
        try:
            response: scheduler_pb2.RouteResponse = await self.stub.Route(
                request, timeout=left, metadata=metadata(trace_id)
            )
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.DEADLINE_EXCEEDED:
                raise TimeoutError("routing") from None
            raise
        return response

    async def _over_stream(
        self, request: scheduler_pb2.RouteRequest, timeout: float, trace_id: str
    ) -> scheduler_pb2.RouteReply:
        call = self._open()
        call_id = next(self._ids)
        future: asyncio.Future[scheduler_pb2.RouteReply] = (
            asyncio.get_running_loop().create_future()
        )
        self._pending[call_id] = future
        try:
            try:
                async with self._write_lock:
                    await call.write(
                        scheduler_pb2.RouteCall(call_id=call_id, request=request, trace_id=trace_id)
                    )
            except (grpc.aio.AioRpcError, grpc.aio.UsageError, asyncio.InvalidStateError) as e:
                self._broken(call, e)
                raise _StreamBroken from None
            return await asyncio.wait_for(future, timeout)
        finally:
            self._pending.pop(call_id, None)

    def _open(self) -> grpc.aio.StreamStreamCall:
        if self._call is None:
            self._call = self.stub.RouteStream()
            self._reader = asyncio.get_running_loop().create_task(
                self._read(self._call), name="route-stream-reader"
            )
        return self._call

    async def _read(self, call: grpc.aio.StreamStreamCall) -> None:
        try:
            async for reply in call:
                future = self._pending.get(reply.call_id)
                if future is not None and not future.done():
                    future.set_result(reply)
            self._broken(call, None)
        except grpc.aio.AioRpcError as e:
            self._broken(call, e)

    def _broken(self, call: grpc.aio.StreamStreamCall, error: BaseException | None) -> None:
        """The stream is gone: its waiting calls go unary, the next call opens a new one."""
        stream = call  # (the identity test below narrows ``call`` to an Optional)
        if self._call is not call:
            return
        self._call = None
        if (
            isinstance(error, grpc.aio.AioRpcError)
            and error.code() == grpc.StatusCode.UNIMPLEMENTED
        ):
            logger.warning("the scheduler has no RouteStream: routing with unary calls")
            self._streaming = False
        elif not isinstance(error, asyncio.CancelledError):
            logger.warning("route stream ended (%s): reopening on the next request", error)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(_StreamBroken())
        stream.cancel()

    async def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
            self._call = None
        if self._reader is not None:
            self._reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._reader
