"""Generate calls to one worker over one long-lived ``GenerateStream``.

A unary-stream ``Generate`` sets up an HTTP/2 stream per request, both ways (~1.1 ms of a
request's time on this machine: ``benchmarks/hops.py``); on an open stream a request costs one
message each way. The gateway keeps one stream per worker (``call_stream.CallStream``); each
event goes to the queue of the request it names.

A request ends with its ``finished`` response, or with a ``CallEnd`` event carrying the status a
unary call would have ended with (a refusal, a deadline, a failure); a caller that stops before
either (its client left, a stop string) sends an abort. A request that finished sends nothing
back: on the 2-core development VM a write took ~150 µs of the gateway's event loop and held the
stream's one writer ~0.6 ms (gRPC allows one write in flight). When the stream breaks (the
worker died or restarted), every request on it ends with UNAVAILABLE, which the orchestrator
treats as a failed worker, as it does for a unary call; the next request opens a new stream. A
worker without ``GenerateStream`` (an older version during a rolling upgrade) is called with
unary ``Generate`` from then on.

A worker that hangs (stopped, a wedged device) breaks nothing: its stream stays open and sends
nothing. So each request also has a progress bound (``Progress``): a first response within
``first_s``, each next one within ``next_s`` of the last. Past it the request ends ``Stalled``
(UNAVAILABLE, as for a dead worker: the orchestrator resumes it elsewhere) and is aborted on
the worker. ``abandon`` ends every request on the stream the same way at once (the scheduler
said the worker missed its heartbeats).
"""

import asyncio
import math
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from dataclasses import dataclass

import grpc

from services.gateway import metrics
from services.gateway.call_stream import CallFailed, CallStream, StreamClient
from shared.protos.baton.v1 import worker_pb2, worker_pb2_grpc
from shared.rpc import auth, metadata


class GenerateFailed(CallFailed):
    """A Generate on the stream that ended with a status other than OK."""


class Stalled(GenerateFailed):
    """No response from the worker within the request's progress bound: a hung worker, which
    the caller treats as a failed one (UNAVAILABLE)."""

    def __init__(self, waited_s: float, first: bool):
        what = "first token" if first else "token"
        super().__init__(grpc.StatusCode.UNAVAILABLE,
                         f"no {what} from the worker in {waited_s:.1f} s: stalled")  # fmt: skip


@dataclass(frozen=True)
class Progress:
    """How long a request may wait on its worker: ``first_s`` for the first response (the
    prompt's prefill or KV pull, and the queue before it), ``next_s`` between responses."""

    first_s: float
    next_s: float
    # asked when the bound passes: True waits another bound instead of ending Stalled (there
    # is no other worker to resume on: a long step, not a hang, is then the likelier cause)
    keep_waiting: Callable[[], bool] = lambda: False

    def bound(self, loop: asyncio.AbstractEventLoop, started: bool) -> float:
        return loop.time() + (self.next_s if started else self.first_s)


class _NoStream(Exception):
    """The worker has no GenerateStream (UNIMPLEMENTED): go unary."""


_GenerateStream = CallStream[worker_pb2.GenerateCall, worker_pb2.GenerateEvent]
UNBOUNDED = Progress(float("inf"), float("inf"))  # (the request's deadline alone)


class GenerateClient(StreamClient[worker_pb2.GenerateCall, worker_pb2.GenerateEvent]):
    """Generate on one worker (its address's channel), over the stream when it can."""

    def __init__(self, stub: worker_pb2_grpc.WorkerStub, streaming: bool = True):
        super().__init__("GenerateStream", "a worker", streaming)
        self.stub = stub

    async def generate(
        self, request: worker_pb2.GenerateRequest, timeout: float, trace_id: str,
        progress: Progress = UNBOUNDED,
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:  # fmt: skip
        """The request's responses; GenerateFailed (Stalled past ``progress``) or
        grpc.aio.AioRpcError when it fails."""
        if not self._streaming:
            async for response in self._unary(request, timeout, trace_id, progress):
                yield response
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            async for response in self._over_stream(request, timeout, trace_id, progress):
                yield response
        except _NoStream:  # the worker has no GenerateStream: nothing was sent back yet
            left = max(deadline - loop.time(), 0.001)
            async for response in self._unary(request, left, trace_id, progress):
                yield response

    def abandon(self, why: str) -> None:
        """End every request on the open stream as if it broke (each resumes elsewhere); the
        next request opens a new stream."""
        if self._stream is not None:
            self._stream.fail(ConnectionAbortedError(why))

    async def _unary(
        self, request: worker_pb2.GenerateRequest, timeout: float, trace_id: str,
        progress: Progress,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:  # fmt: skip
        metrics.GENERATE_CALLS.labels("unary").inc()
        call = self.stub.Generate(request, timeout=timeout, metadata=metadata(trace_id))
        loop = asyncio.get_running_loop()
        responses, started = aiter(call), False
        try:
            while True:
                waited, bound = loop.time(), progress.bound(loop, started)
                try:
                    async with asyncio.timeout_at(None if math.isinf(bound) else bound):
                        response = await anext(responses)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    if progress.keep_waiting():
                        continue
                    raise Stalled(loop.time() - waited, not started) from None
                started = True
                yield response
        finally:
            call.cancel()

    async def _over_stream(
        self, request: worker_pb2.GenerateRequest, timeout: float, trace_id: str,
        progress: Progress,
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:  # fmt: skip
        metrics.GENERATE_CALLS.labels("stream").inc()
        stream = self._open()
        rid = request.request_id
        if rid in stream.pending:
            raise GenerateFailed(grpc.StatusCode.ALREADY_EXISTS, f"{rid} is already running")
        inbox: asyncio.Queue[worker_pb2.GenerateEvent | None] = asyncio.Queue()
        stream.pending[rid] = inbox
        stream.send(worker_pb2.GenerateCall(start=request, trace_id=trace_id, timeout_s=timeout))
        ended = started = False
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        try:
            while True:
                waited, bound = loop.time(), progress.bound(loop, started)
                try:
                    async with asyncio.timeout_at(min(deadline, bound)):  # (no task per token)
                        event = await inbox.get()
                except TimeoutError:
                    if bound < deadline and progress.keep_waiting():
                        continue
                    if bound < deadline:
                        raise Stalled(loop.time() - waited, not started) from None
                    raise GenerateFailed(
                        grpc.StatusCode.DEADLINE_EXCEEDED, "the request's deadline passed"
                    ) from None
                started = True
                if event is None:  # the stream broke
                    ended = True
                    if not self._streaming:
                        raise _NoStream
                    raise GenerateFailed(grpc.StatusCode.UNAVAILABLE, "the worker's stream broke")
                if event.WhichOneof("event") == "end":
                    ended = True
                    if event.end.code:
                        raise GenerateFailed.from_wire(event.end.code, event.end.message)
                    return
                if event.response.finished:  # done on the worker: nothing to abort or wait for
                    ended = True
                    yield event.response
                    return
                yield event.response
        finally:
            if stream.pending.get(rid) is inbox:
                del stream.pending[rid]
            if not ended and self._stream is stream:  # stopped early: stop it on the worker
                stream.send(worker_pb2.GenerateCall(abort=rid))

    def _start_call(self) -> grpc.aio.StreamStreamCall:
        return self.stub.GenerateStream(metadata=auth())

    def _on_message(self, stream: _GenerateStream, event: worker_pb2.GenerateEvent) -> None:
        inbox = stream.pending.get(event.request_id)
        if inbox is not None:
            inbox.put_nowait(event)

    def _end_pending(self, stream: _GenerateStream) -> None:
        """Its requests end UNAVAILABLE (or go unary, when the worker has no stream)."""
        for inbox in stream.pending.values():
            inbox.put_nowait(None)
        stream.pending.clear()
