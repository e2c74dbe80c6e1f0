"""Route calls to the global scheduler over one long-lived ``RouteStream``.

A unary ``Route`` sets up an HTTP/2 stream per request; on this machine that is ~0.9 ms,
against ~0.3 ms for one message each way on a stream that is already open
(``benchmarks/rpc_floor.py``). The gateway therefore keeps one stream open
(``call_stream.CallStream``); each call has its own ``call_id``, and the replies, which come in
completion order, are matched to waiting futures. A failure reply (no worker for the model,
none left by the filters) ends only its own call, as the unary status would.

When the stream breaks (the scheduler restarted, or a connection dropped), the calls waiting
on it are sent again as unary ``Route`` calls within their own deadlines, and the next call
opens a new stream; a scheduler without ``RouteStream`` (an older version during a rolling
upgrade) is used through unary calls from then on.

The scheduler also sends notices on the stream (``call_id`` 0, matched to no call): a
``WorkersLost`` names the workers it dropped for missed heartbeats, handed to
``on_workers_lost`` so the gateway moves what streams from them at once. Only a gateway with
a stream open hears them (one that routed nothing yet has nothing on those workers).
"""

import asyncio
import itertools
import logging
from collections.abc import Callable

import grpc

from services.gateway import metrics
from services.gateway.call_stream import CallFailed, CallStream, StreamClient
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import auth, metadata

logger = logging.getLogger(__name__)


class RouteFailed(CallFailed):
    """The scheduler found no route: a status code and its message, as a unary call ends."""


class _StreamBroken(Exception):
    """The stream broke before this call's reply came: the call goes unary."""


MAX_FINISHED = 4096  # beyond this between two routes, the heartbeats catch up instead


_RouteStream = CallStream[scheduler_pb2.RouteCall, scheduler_pb2.RouteReply]
WorkersLostHook = Callable[[list[scheduler_pb2.LostWorker]], None]


class RouteClient(StreamClient[scheduler_pb2.RouteCall, scheduler_pb2.RouteReply]):
    def __init__(
        self,
        stub: scheduler_pb2_grpc.GlobalSchedulerStub,
        on_workers_lost: WorkersLostHook | None = None,
    ):
        super().__init__("RouteStream", "the scheduler")
        self.stub = stub
        # called (on the stream's reader: it must not block) with the workers the scheduler
        # dropped for missed heartbeats
        self.on_workers_lost = on_workers_lost
        self._ids = itertools.count(1)
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
                    raise RouteFailed.from_wire(reply.failure.code, reply.failure.message)
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
        stream = self._open()
        call_id = next(self._ids)
        future: asyncio.Future[scheduler_pb2.RouteReply | None] = (
            asyncio.get_running_loop().create_future()
        )
        stream.pending[call_id] = future
        try:
            stream.send(
                scheduler_pb2.RouteCall(call_id=call_id, request=request, trace_id=trace_id)
            )
            reply = await asyncio.wait_for(future, timeout)
        finally:
            stream.pending.pop(call_id, None)
        if reply is None:  # the stream broke before the reply came
            raise _StreamBroken
        return reply

    def _start_call(self) -> grpc.aio.StreamStreamCall:
        return self.stub.RouteStream(metadata=auth())

    def _on_message(self, stream: _RouteStream, reply: scheduler_pb2.RouteReply) -> None:
        if reply.HasField("lost"):  # a notice (call_id 0), on no call
            self._workers_lost(list(reply.lost.workers))
            return
        future = stream.pending.get(reply.call_id)
        if future is not None and not future.done():
            future.set_result(reply)

    def _workers_lost(self, workers: list[scheduler_pb2.LostWorker]) -> None:
        names = ", ".join(f"{w.worker_id} at {w.address} ({w.reason})" for w in workers)
        logger.warning("the scheduler lost %s", names)
        if self.on_workers_lost is None:
            return
        try:
            self.on_workers_lost(workers)
        except Exception:  # the stream carries every route call: it must stay open
            logger.exception("on_workers_lost failed")

    def _end_pending(self, stream: _RouteStream) -> None:
        """Its waiting calls go unary."""
        for future in stream.pending.values():
            if not future.done():
                future.set_result(None)
