"""The Worker gRPC service: translation between protobuf and ``AsyncLLM`` only.

Errors map once: a bad request is INVALID_ARGUMENT (with the engine's message), a draining
worker is UNAVAILABLE (the gateway retries elsewhere), a dead engine is UNAVAILABLE and stops
the worker. Leaving a Generate stream early (the gateway disconnected) aborts the request in the
engine, so its KV blocks are freed at once.
"""

import asyncio
import contextlib
import functools
import logging
import time
from collections.abc import AsyncGenerator, AsyncIterator, Callable

import grpc
from grpc import aio

from services.worker import convert, metrics
from services.worker.engine.async_llm import AsyncLLM
from services.worker.engine.core_client import EngineDeadError
from services.worker.engine.kv_transfer.params import KVTransferParams
from services.worker.engine.messages import ErrorCode
from services.worker.engine.outputs import RequestOutput
from services.worker.engine.params import SamplingParams
from services.worker.settings import WorkerSettings
from shared import hop_trace
from shared.logs import request_id_var
from shared.protos.baton.v1 import common_pb2, worker_pb2, worker_pb2_grpc
from shared.rpc import adopt_request_id

logger = logging.getLogger(__name__)

# a prefill that ended in error (its response has no error field): the call's status, which
# the gateway maps as for any call (errors.from_status: 400, 503, else 502)
PREFILL_ERRORS = {
    ErrorCode.INVALID_REQUEST: grpc.StatusCode.INVALID_ARGUMENT,
    ErrorCode.OVERLOADED: grpc.StatusCode.RESOURCE_EXHAUSTED,
}

# how long an unknown prefill peer is waited for, in heartbeat intervals (see kv_refusal)
KV_PEER_WAIT_HEARTBEATS = 4
ROLES = {
    "prefill": common_pb2.WORKER_ROLE_PREFILL,
    "decode": common_pb2.WORKER_ROLE_DECODE,
    "both": common_pb2.WORKER_ROLE_BOTH,
}


class CallRejected(Exception):
    """A Generate or Prefill the worker refuses or cannot finish: the gRPC status it ends
    with (a unary call aborts with it; on GenerateStream it is the request's end event)."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


class _StreamGone(Exception):
    """A write to a GenerateStream failed: the stream is closed or broken."""


class _Stopped(Exception):
    """A request on a GenerateStream was stopped (aborted, or its deadline passed) while one
    of its events was being written; it ends as that write returns."""


_ABORTED, _LATE = "aborted", "deadline"


class _StreamCall:
    """One request on a GenerateStream: its task, whether one of its events is being written,
    and why it must stop. ``stop`` cancels the task at once, unless a write is in flight: that
    write completes first (gRPC allows one outstanding write per call, and a cancelled awaiter
    would not stop it), and ``send`` raises ``_Stopped`` as it returns."""

    __slots__ = ("task", "why", "writing")
    task: "asyncio.Task[None]"  # set as its request starts; a refusal's call has none

    def __init__(self) -> None:
        self.writing = False
        self.why: str | None = None

    def stop(self, why: str) -> None:
        if self.why is None:
            self.why = why
            if not self.writing:
                self.task.cancel()


def _forget(
    running: dict[str, _StreamCall], rid: str, call: _StreamCall, _done: object = None
) -> None:
    """Drop ``call`` from a stream's table, and not a later request that reused its id."""
    if running.get(rid) is call:
        del running[rid]


# one Generate's responses (CallRejected: a refusal's status)
GenerateFn = Callable[
    [worker_pb2.GenerateRequest], AsyncGenerator[worker_pb2.GenerateResponse, None]
]


class WorkerServicer(worker_pb2_grpc.WorkerServicer):
    def __init__(
        self, settings: WorkerSettings, engine: AsyncLLM, generate: GenerateFn | None = None
    ):
        """``generate``: what one Generate answers, for either transport (the unary call, or a
        request on GenerateStream); by default the engine's. Given, the transports run over it
        alone: their framing, aborts and deadlines, with no engine."""
        self.settings = settings
        self.engine = engine
        self._responses: GenerateFn = generate or self._generate
        self.draining = False
        self.in_flight = 0
        self._running: set[str] = set()  # request ids of the calls in flight
        self._evicted: set[str] = set()  # ended by end_the_rest
        self.num_received = 0  # Prefill + Generate calls since start (heartbeats carry it)
        self._idle = asyncio.Event()
        self._idle.set()
        # scheduler replica → the KV side channels of the prefill workers it registered
        self._kv_peers: dict[str, frozenset[str]] = {}
        self._kv_peers_changed = asyncio.Event()  # set (and replaced) at every update
        # asks the scheduler replicas for their peers now (main: wakes the heartbeats)
        self.ask_for_kv_peers: Callable[[], None] = lambda: None

    def set_kv_peers(self, replica: str, peers: frozenset[str]) -> None:
        """The prefill workers a scheduler replica has registered (its heartbeat stream says
        so whenever they change): a decode leg's handle is read only from one of them."""
        self._kv_peers[replica] = peers
        changed, self._kv_peers_changed = self._kv_peers_changed, asyncio.Event()
        changed.set()

    async def kv_refusal(self, side_channel: str) -> str | None:
        """Why a handle pointing at ``side_channel`` must not be read (None: it may). A
        worker that runs without a scheduler has nobody to ask and reads from any peer.

        A prefill worker the scheduler has just registered may route its first handles here
        before this worker's heartbeat has brought the news: an unknown peer is asked about
        at once (the heartbeats go now, and the scheduler answers with its peers), and
        refused only if no update names it within KV_PEER_WAIT_HEARTBEATS intervals."""
        if not self.settings.scheduler_addresses:
            return None
        loop = asyncio.get_running_loop()
        deadline = loop.time() + KV_PEER_WAIT_HEARTBEATS * self.settings.heartbeat_interval_s
        while not any(side_channel in peers for peers in self._kv_peers.values()):
            remaining = deadline - loop.time()
            if remaining <= 0:
                break
            changed = self._kv_peers_changed
            self.ask_for_kv_peers()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(changed.wait(), remaining)
        else:
            return None
        metrics.KV_HANDLES_REFUSED.inc()
        logger.warning("a KV handle points at %s, no prefill worker the scheduler registered: "
                       "not reading from it", side_channel)  # fmt: skip
        return f"{side_channel} is not a prefill worker the scheduler has registered"

    async def Generate(
        self, request: worker_pb2.GenerateRequest, context: aio.ServicerContext
    ) -> AsyncIterator[worker_pb2.GenerateResponse]:
        adopt_request_id(context)
        try:
            async for response in self._responses(request):
                yield response
        except CallRejected as e:
            await context.abort(e.code, e.message)

    async def GenerateStream(
        self, calls: AsyncIterator[worker_pb2.GenerateCall], context: aio.ServicerContext
    ) -> None:
        """Many Generate calls over one stream: each start runs as its own task, which writes
        its responses, tagged with its request id, straight to the stream (one write at a
        time), the last one ``finished`` — or, when it ends otherwise, a ``CallEnd``. An abort
        stops the task, which aborts the request in the engine as leaving a unary Generate
        does. When the gateway closes its side the stream ends after the requests on it; when
        it goes away, they are all aborted."""
        running: dict[str, _StreamCall] = {}
        writing = asyncio.Lock()

        async def send(call: _StreamCall, event: worker_pb2.GenerateEvent) -> None:
            """One write at a time, and a write once started is finished: gRPC allows one
            outstanding write per call, and cancelling the task that awaits a write would not
            stop the write, only let the next one start too early. So an abort or a deadline
            that comes during the write waits for it (``_StreamCall.stop``) and takes effect
            here, as it returns."""
            async with writing:  # waiting here may be cancelled: nothing is in flight yet
                call.writing = True
                try:
                    await context.write(event)
                except Exception as e:  # the stream is gone (closed, reset, the gateway left)
                    raise _StreamGone from e
                finally:
                    call.writing = False
            if call.why is not None:
                raise _Stopped

        async def serve(start: worker_pb2.GenerateCall, call: _StreamCall) -> None:
            rid = start.start.request_id
            if start.trace_id:
                request_id_var.set(start.trace_id)  # this task's own context
            timer = None
            if start.timeout_s > 0:
                timer = asyncio.get_running_loop().call_later(start.timeout_s, call.stop, _LATE)
            end = worker_pb2.CallEnd()
            finished = False  # its last response said so: that ends it, no CallEnd needed
            try:
                try:
                    async with contextlib.aclosing(self._responses(start.start)) as responses:
                        async for response in responses:
                            finished = response.finished
                            event = worker_pb2.GenerateEvent(request_id=rid, response=response)
                            await send(call, event)
                except CallRejected as e:
                    end.code, end.message = e.code.value[0], e.message
                except (asyncio.CancelledError, _Stopped) as e:
                    # stopped during its last response's write, it had finished all the same
                    if call.why != _LATE and not (finished and isinstance(e, _Stopped)):
                        raise  # aborted, or the stream is ending: nobody waits for an end
                    if isinstance(e, asyncio.CancelledError):
                        asyncio.current_task().uncancel()  # type: ignore[union-attr]
                    if not finished:
                        end.code = grpc.StatusCode.DEADLINE_EXCEEDED.value[0]
                        end.message = "the request's deadline passed"
                except _StreamGone:
                    raise
                except Exception as e:  # the engine failed it: its caller hears so now
                    logger.exception("request %s failed", rid)
                    end.code = grpc.StatusCode.INTERNAL.value[0]
                    end.message = f"the worker failed the request: {e}"
                _forget(running, rid, call)  # an abort from here on finds nothing to stop
                if not (finished and end.code == 0):
                    call.why = None  # its end is the one write still owed
                    await send(call, worker_pb2.GenerateEvent(request_id=rid, end=end))
            except (_StreamGone, _Stopped):
                pass  # the stream is gone, or an abort came during the end's write
            finally:
                if timer is not None:
                    timer.cancel()

        try:
            async for message in calls:
                if message.WhichOneof("call") == "start":
                    rid = message.start.request_id
                    if rid in running:
                        end = worker_pb2.CallEnd(
                            code=grpc.StatusCode.ALREADY_EXISTS.value[0],
                            message=f"request {rid} is already running on this stream",
                        )
                        await send(_StreamCall(), worker_pb2.GenerateEvent(request_id=rid, end=end))
                        continue
                    new = running[rid] = _StreamCall()
                    new.task = asyncio.create_task(serve(message, new), name=f"generate-{rid}")
                    # however it ends, even cancelled by an abort before it ever ran
                    new.task.add_done_callback(functools.partial(_forget, running, rid, new))
                elif (aborted := running.get(message.abort)) is not None:
                    aborted.stop(_ABORTED)
            while running:  # the gateway is done sending: finish what it started
                await asyncio.gather(*(c.task for c in running.values()), return_exceptions=True)
        finally:
            for left in list(running.values()):
                left.task.cancel()

    async def _generate(
        self, request: worker_pb2.GenerateRequest
    ) -> AsyncGenerator[worker_pb2.GenerateResponse, None]:
        """One Generate, for either transport; CallRejected carries a refusal's status."""
        hop_trace.mark("worker.generate_in")
        params = self._admit(request.params)
        leg = None
        if request.HasField("remote_kv"):
            self._require_kv_transfer()
            if not request.HasField("first_token_id"):
                raise CallRejected(
                    grpc.StatusCode.INVALID_ARGUMENT, "remote_kv needs first_token_id"
                )
            remote = convert.remote_kv(request.remote_kv)
            leg = KVTransferParams(
                remote=remote, first_token_id=request.first_token_id,
                refused=await self.kv_refusal(remote.side_channel),
            )  # fmt: skip
        async for out in self._run(request, params, leg):
            hop_trace.mark("worker.output")
            yield convert.generate_response(out)

    async def Prefill(
        self, request: worker_pb2.PrefillRequest, context: aio.ServicerContext
    ) -> worker_pb2.PrefillResponse:
        adopt_request_id(context)
        try:
            return await self._prefill(request)
        except CallRejected as e:
            await context.abort(e.code, e.message)
            raise  # unreachable: abort raises

    async def _prefill(self, request: worker_pb2.PrefillRequest) -> worker_pb2.PrefillResponse:
        params = self._admit(request.params)
        if params.n != 1:
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, "prefill takes n = 1")
        keep_kv = request.keep_kv
        if keep_kv:
            self._require_kv_transfer()
        prompt_only = params.max_tokens == 0  # nothing to decode: no token, no KV kept
        params = params.clone(max_tokens=0 if prompt_only else 1, min_tokens=0)
        leg = KVTransferParams(do_remote_decode=True) if keep_kv and not prompt_only else None
        last: RequestOutput | None = None
        prompt_logprobs: list[common_pb2.TokenLogprobs] = []
        async for out in self._run(request, params, leg):
            last = out
            prompt_logprobs += convert.prompt_logprobs(out)  # (with the first output)
        if last is not None and last.error is not None:  # ended in error: by its kind, as a
            # stream's error code tells the gateway (a 400, a 503 to retry, a 502)
            code = PREFILL_ERRORS.get(last.error_code, grpc.StatusCode.INTERNAL)  # type: ignore[arg-type]
            raise CallRejected(code, last.error)
        if last is None or not last.outputs or not (last.outputs[0].token_ids or prompt_only):
            raise CallRejected(grpc.StatusCode.INTERNAL, "prefill produced no token")
        first = last.outputs[0]
        # max_tokens=1 ends it with "length"; any other reason (eos, a stop id) ends the request
        reason = first.finish_reason if first.finish_reason != "length" or prompt_only else ""
        if reason and last.kv_handle is not None:  # nothing to decode: end the lease now
            await self.engine.abort(request.request_id)
        logprobs = convert.token_logprobs(first)
        response = worker_pb2.PrefillResponse(
            first_logprobs=logprobs[0] if logprobs else None,
            num_prompt_tokens=len(last.prompt_token_ids),
            num_cached_tokens=last.num_cached_tokens,
            finish_reason=reason or "",
            prompt_logprobs=prompt_logprobs,
        )
        if first.token_ids:
            response.first_token_id = first.token_ids[0]
        if last.kv_handle is not None and not reason:
            response.kv_handle.CopyFrom(convert.kv_handle(last.kv_handle))
        return response

    async def Abort(
        self, request: worker_pb2.AbortRequest, context: aio.ServicerContext
    ) -> worker_pb2.AbortResponse:
        for request_id in request.request_ids:
            await self.engine.abort(request_id)
        return worker_pb2.AbortResponse(num_aborted=len(request.request_ids))

    async def Health(
        self, request: worker_pb2.HealthRequest, context: aio.ServicerContext
    ) -> worker_pb2.HealthResponse:
        serving = not self.draining and not self.engine.dead
        response = worker_pb2.HealthResponse(
            serving=serving, role=ROLES[self.settings.role], model=self.engine.model_name
        )
        if not self.engine.dead:
            stats = await self.engine.get_stats()
            response.num_running, response.num_waiting = stats.num_running, stats.num_waiting
            response.kv_usage = stats.kv_usage
            response.num_cached_blocks = stats.num_cached_blocks
        return response

    def _require_kv_transfer(self) -> None:
        if not self.engine.config.kv_transfer.enabled:
            raise CallRejected(
                grpc.StatusCode.FAILED_PRECONDITION, "this worker runs without KV transfer"
            )

    async def wait_idle(self) -> None:
        await self._idle.wait()

    async def drained(self, poll_s: float = 0.1) -> None:
        """Nothing left to serve: no call in flight, and (a prefill worker) no KV lease held,
        so no decode worker is still to pull from us. The caller bounds the wait."""
        await self.wait_idle()
        while not self.engine.dead and (await self.engine.get_stats()).kv_leases_held:
            await asyncio.sleep(poll_s)
            await self.wait_idle()

    async def end_the_rest(self) -> None:
        """The drain timed out (or the worker must let go of its requests: its engine hung,
        or the schedulers had dropped it): every request still running ends with UNAVAILABLE,
        the status the gateway resumes on another worker (with the tokens streamed so far)."""
        self._evicted.update(self._running)
        for request_id in list(self._running):
            with contextlib.suppress(EngineDeadError):  # (then it fails on its own)
                await self.engine.abort(request_id)

    def _admit(self, p: "common_pb2.SamplingParams") -> SamplingParams:
        if self.draining:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, "the worker is draining")
        if self.engine.dead:
            raise CallRejected(grpc.StatusCode.UNAVAILABLE, "the worker's engine has died")
        try:
            return convert.sampling_params(p)
        except ValueError as e:
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None

    async def _run(
        self,
        request: worker_pb2.GenerateRequest | worker_pb2.PrefillRequest,
        params: SamplingParams,
        leg: KVTransferParams | None = None,
    ) -> AsyncIterator[RequestOutput]:
        prompt: dict[str, object] = {"prompt_token_ids": list(request.prompt_token_ids)}
        if request.HasField("cache_salt"):
            prompt["cache_salt"] = request.cache_salt
        if leg is not None:
            prompt["kv_transfer"] = leg
        self.in_flight += 1
        self.num_received += 1
        self._running.add(request.request_id)
        self._idle.clear()
        start, outcome = time.perf_counter(), "error"
        first = True
        try:
            async for out in self.engine.generate(prompt, params, request.request_id):
                if first:
                    metrics.TTFT.observe(time.perf_counter() - start)
                    metrics.QUEUE.observe(out.metrics.get("queued_seconds", 0.0))
                    metrics.PREFIX_HIT_TOKENS.inc(out.num_cached_tokens)
                    metrics.PROMPT_TOKENS.inc(len(out.prompt_token_ids))
                    first = False
                yield out
            outcome = "ok"
        except ValueError as e:
            outcome = "invalid"
            raise CallRejected(grpc.StatusCode.INVALID_ARGUMENT, str(e)) from None
        except EngineDeadError as e:
            raise CallRejected(
                grpc.StatusCode.UNAVAILABLE, f"the worker's engine died: {e}"
            ) from None
        except asyncio.CancelledError:
            outcome = "cancelled"
            task = asyncio.current_task()
            if request.request_id in self._evicted and not (task and task.cancelling()):
                outcome = "evicted"
                raise CallRejected(grpc.StatusCode.UNAVAILABLE, "the worker drained before this "
                                   "request ended: resume it elsewhere") from None  # fmt: skip
            raise
        except GeneratorExit:
            outcome = "cancelled"
            raise
        finally:
            self._running.discard(request.request_id)
            self._evicted.discard(request.request_id)
            seconds = time.perf_counter() - start
            metrics.REQUESTS.labels(outcome=outcome).inc()
            metrics.E2E.observe(seconds)
            logger.info("%s %s: %d prompt tokens, %.1f ms", request.request_id, outcome,
                        len(request.prompt_token_ids), 1e3 * seconds)  # fmt: skip
            self.in_flight -= 1
            if self.in_flight == 0:
                self._idle.set()
