"""Drives one prompt through the cluster and yields what each of its ``n`` choices produced:

    hash the prompt's blocks → Route (scheduler) → n × Generate (worker stream, n = 1 each,
    seed + i like the engine's own fan-out) → detokenize, apply stop strings → ChoiceDelta

Every call has a deadline. Leaving the iterator (client gone, stop string hit) cancels the
gRPC streams, which aborts the requests in the worker's engine. When a worker fails before or
during a stream (UNAVAILABLE: it died or is draining), the choice is resumed on another worker
with the prompt plus the tokens generated so far (the prefix cache makes that cheap), so the
client's stream continues. Greedy output is unchanged by a resume; seeded sampling continues
with a fresh generator state.

A worker that hangs is a failed worker too, found two ways: each leg has a progress bound (no
token within ``progress_timeout_s``, or for the first token that plus
``prefill_progress_s_per_token`` per prompt token the worker must compute: ``_progress``), and
the scheduler's notice that a worker missed its heartbeats (``WorkerChannels.lost``) ends
what waits on it at once. A stalled decode leg resumes like a failed one; a stalled prefill
leg falls back to a local prefill on the decode worker.
"""

import asyncio
import contextlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import grpc

from services.gateway import errors, metrics
from services.gateway.call_stream import CallFailed, status_of
from services.gateway.catalog import ModelCatalog
from services.gateway.choice import ChoiceDelta, ChoiceState
from services.gateway.generate_client import Progress, Stalled
from services.gateway.merge import merge
from services.gateway.route_client import RouteClient
from services.gateway.worker_pool import WorkerChannels
from shared import hop_trace
from shared.block_hash import hash_blocks
from shared.ids import BlockHash
from shared.protos.baton.v1 import (
    common_pb2,
    scheduler_pb2,
    scheduler_pb2_grpc,
    worker_pb2,
)
from shared.rpc import auth, metadata
from shared.sample_seed import continued_seed
from shared.text.detokenizer import IncrementalDetokenizer

logger = logging.getLogger(__name__)

ROUTE_TIMEOUT_S = 5.0


@dataclass
class Job:
    """One prompt of one client request, ready to run."""

    request_id: str
    model: str
    prompt_ids: list[int]
    params: common_pb2.SamplingParams  # n = 1; the per-choice seed is set here
    n: int
    stop: list[str]
    include_stop: bool
    skip_special_tokens: bool
    cache_salt: str | None
    deadline: float  # time.monotonic() by which the request must end
    block_size: int  # of the model's workers: the prompt is hashed in blocks of this size
    trace_id: str = "-"  # the client's x-request-id: in every service's log lines
    max_resumes: int = 2


class Orchestrator:
    def __init__(
        self,
        scheduler: scheduler_pb2_grpc.GlobalSchedulerStub,
        catalog: ModelCatalog,
        workers: WorkerChannels,
        progress_timeout_s: float = 10.0,
        prefill_progress_s_per_token: float = 0.01,
    ):
        self.routes = RouteClient(scheduler, self._lost)
        self.catalog = catalog
        self.workers = workers
        self.progress_timeout_s = progress_timeout_s
        self.prefill_progress_s_per_token = prefill_progress_s_per_token
        self._background: set[asyncio.Task[None]] = set()  # lease releases in flight

    def _lost(self, workers: list[scheduler_pb2.LostWorker]) -> None:
        """The scheduler dropped these workers for missed heartbeats: what waits on them
        resumes elsewhere now, not at its progress bound."""
        for w in workers:
            self.workers.lost(w.address, f"{w.worker_id}: {w.reason or 'missed heartbeats'}")

    def _progress(
        self, uncached_tokens: int, keep_waiting: Callable[[], bool] = lambda: False
    ) -> Progress:
        """The progress bound of a leg whose worker must compute ``uncached_tokens`` before
        its first token."""
        per_token = self.prefill_progress_s_per_token
        return Progress(self.progress_timeout_s + max(uncached_tokens, 0) * per_token,
                        self.progress_timeout_s, keep_waiting)  # fmt: skip

    def _nowhere_else(self, model: str, excluded: set[str]) -> bool:
        """No other live worker could take a decode leg off the ``excluded`` ones: a silent
        worker is then waited for (a long step is likelier than a hang, which its heartbeats
        and its watchdog catch) rather than the request failed."""
        known = self.catalog.known(model)
        return known is None or known.num_decode_workers <= len(excluded)

    async def close(self) -> None:
        await self.routes.close()

    async def run(self, job: Job, num_logprobs: int | None) -> AsyncIterator[ChoiceDelta]:
        """Deltas of all n choices, interleaved as they arrive; ends when every choice ends."""
        hashes = hash_blocks(
            job.prompt_ids, job.block_size, (job.cache_salt,) if job.cache_salt else ()
        )
        hop_trace.mark("gateway.route_call")
        route = await self._route(job, hashes, exclude=[])
        hop_trace.mark("gateway.routed")
        choices = [self._choice(job, i, route, hashes, num_logprobs) for i in range(job.n)]
        try:
            async for _, delta in merge(choices):
                yield delta
        finally:
            self.routes.finished(job.request_id)

    async def _route(
        self, job: Job, hashes: list[BlockHash], exclude: list[str]
    ) -> scheduler_pb2.RouteResponse:
        start = time.perf_counter()
        try:
            route = await self.routes.route(
                scheduler_pb2.RouteRequest(
                    request_id=job.request_id, model=job.model, block_hashes=hashes,
                    num_prompt_tokens=len(job.prompt_ids), exclude_workers=exclude,
                ),
                timeout=min(ROUTE_TIMEOUT_S, max(job.deadline - time.monotonic(), 0.001)),
                trace_id=job.trace_id,
            )  # fmt: skip
        except (CallFailed, grpc.aio.AioRpcError) as e:
            code, details = status_of(e)
            if code == grpc.StatusCode.NOT_FOUND:  # we serve the model; its workers are gone
                raise errors.no_worker(details or "no live worker") from None
            raise errors.from_status(code, details, "routing") from None
        except TimeoutError:
            raise errors.timeout("routing") from None
        metrics.ROUTE_SECONDS.observe(time.perf_counter() - start)
        return route

    async def _choice(
        self,
        job: Job,
        index: int,
        route: scheduler_pb2.RouteResponse,
        hashes: list[BlockHash],
        num_logprobs: int | None,
    ) -> AsyncIterator[ChoiceDelta]:
        """Run choice ``index`` to its end, resuming on another worker if one fails."""
        state = ChoiceState(
            index,
            IncrementalDetokenizer(
                self.catalog.tokenizers[job.model].tokenizer, job.prompt_ids, job.stop,
                job.include_stop, job.skip_special_tokens,
            ),
            num_logprobs,
        )  # fmt: skip
        params = common_pb2.SamplingParams()
        params.CopyFrom(job.params)
        if params.HasField("seed"):
            params.seed = params.seed + index  # as the engine's own n fan-out does
        handoff = None
        prefill_id = f"{job.request_id}-{index}-p"
        try:
            if route.HasField("prefill"):  # disaggregated: the prompt runs on the prefill worker
                handoff = await self._prefill(job, params, route.prefill, prefill_id)
            if handoff is not None:
                delta = state.apply_first(handoff)
                yield delta
                if delta.finish_reason is not None:
                    return
            async for delta in self._decode(job, index, params, route, hashes, state, handoff):
                yield delta
        finally:
            if route.HasField("prefill") and (handoff is None or handoff.HasField("kv_handle")):
                # Ends the lease at once if the decode leg never pulled (client gone, failure),
                # also when the client left during the prefill leg: its lease may exist
                # though no handle came back. After a pull it is a no-op.
                self._release_later(route.prefill.address, prefill_id)

    def _release_later(self, address: str, request_id: str) -> None:
        task = asyncio.get_running_loop().create_task(
            self._release(address, request_id), name=f"release-{request_id}"
        )
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def _release(self, address: str, request_id: str) -> None:
        with contextlib.suppress(grpc.aio.AioRpcError):
            await self.workers.stub(address).Abort(
                worker_pb2.AbortRequest(request_ids=[request_id]), timeout=2.0, metadata=auth()
            )

    async def _decode(
        self,
        job: Job,
        index: int,
        params: common_pb2.SamplingParams,
        route: scheduler_pb2.RouteResponse,
        hashes: list[BlockHash],
        state: ChoiceState,
        handoff: worker_pb2.PrefillResponse | None,
    ) -> AsyncIterator[ChoiceDelta]:
        """The decode leg (or the whole request), resumed on another worker if one fails."""
        failed: list[str] = []
        while True:
            at_start = len(state.generated)  # tokens before this worker (P/D: the first)
            if state.prompt_logprobs is not None and params.HasField("prompt_logprobs"):
                params = _without_prompt_logprobs(params)  # the prefill leg sent them
            request = generate_request(job, index, params, state.generated, handoff)
            computed = len(request.prompt_token_ids) - route.decode.matched_blocks * job.block_size
            responses = self.workers.generate(route.decode.address).generate(
                request,
                timeout=max(job.deadline - time.monotonic(), 0.001),
                trace_id=job.trace_id,
                progress=self._progress(
                    0 if handoff is not None else computed,
                    partial(self._nowhere_else, job.model, {*failed, route.decode.worker_id}),
                ),
            )
            try:
                hop_trace.mark("gateway.generate_call")
                async for resp in responses:
                    hop_trace.mark("gateway.generate_response")
                    for delta in state.apply(resp):
                        yield delta
                        if delta.finish_reason is not None:
                            return  # (a stop string: closing the call aborts it)
                return
            except (CallFailed, grpc.aio.AioRpcError) as e:
                code, details = status_of(e)
                if isinstance(e, Stalled):
                    metrics.STALLS.labels("decode").inc()
                if code != grpc.StatusCode.UNAVAILABLE or len(failed) >= job.max_resumes:
                    raise errors.from_status(code, details, "generation") from None
                failed.append(route.decode.worker_id)
                logger.warning(
                    "worker %s failed (%s): resuming choice %d after %d tokens",
                    route.decode.worker_id, details, index, len(state.generated),
                )  # fmt: skip
                # refused before it produced anything (draining, say), or cut short
                stage = "mid_stream" if len(state.generated) > at_start else "refused"
                metrics.RESUMES.labels(stage).inc()
                route = await self._route(job, hashes, exclude=failed)
                handoff = None  # resumed: the new worker computes prompt + tokens itself
            finally:
                await responses.aclose()  # leaving early aborts the request on the worker

    async def _prefill(
        self,
        job: Job,
        params: common_pb2.SamplingParams,
        worker: scheduler_pb2.WorkerRef,
        request_id: str,
    ) -> worker_pb2.PrefillResponse | None:
        """The prefill leg: the first token and a KV handle; None falls back to a local prefill
        on the decode worker (the prefill worker is gone or draining)."""
        req = worker_pb2.PrefillRequest(
            request_id=request_id, prompt_token_ids=job.prompt_ids, params=params, keep_kv=True
        )
        if job.cache_salt:
            req.cache_salt = job.cache_salt
        start = time.perf_counter()
        left = max(job.deadline - time.monotonic(), 0.001)
        bound = self._progress(len(job.prompt_ids) - worker.matched_blocks * job.block_size)
        lost = self.workers.lost_signal(worker.address)
        call = self.workers.stub(worker.address).Prefill(
            req, timeout=min(left, bound.first_s), metadata=metadata(job.trace_id)
        )
        try:
            resp = await _unless(call, lost)
        except grpc.aio.AioRpcError as e:
            stalled = e.code() == grpc.StatusCode.DEADLINE_EXCEEDED and bound.first_s < left
            if e.code() != grpc.StatusCode.UNAVAILABLE and not stalled:
                raise errors.from_grpc(e, "prefill") from None
            if stalled:
                metrics.STALLS.labels("prefill").inc()
            logger.warning("prefill worker %s failed (%s): prefilling locally",
                           worker.worker_id, e.details())  # fmt: skip
            return None
        except _Lost:
            logger.warning("prefill worker %s lost (missed its heartbeats): prefilling locally",
                           worker.worker_id)  # fmt: skip
            return None
        metrics.PREFILL_SECONDS.observe(time.perf_counter() - start)
        return resp


class _Lost(Exception):
    """The worker was declared lost while a call to it waited."""


async def _unless(call: "grpc.aio.UnaryUnaryCall[Any, Any]", lost: asyncio.Event) -> Any:
    """``call``'s answer, unless ``lost`` is set first (then the call is cancelled: _Lost)."""
    answer = asyncio.ensure_future(call)
    signal = asyncio.ensure_future(lost.wait())
    try:
        await asyncio.wait((answer, signal), return_when=asyncio.FIRST_COMPLETED)
    finally:
        signal.cancel()
    if not answer.done():
        call.cancel()
        answer.cancel()
        raise _Lost
    return answer.result()


def generate_request(
    job: Job,
    index: int,
    params: common_pb2.SamplingParams,
    generated: list[int],
    handoff: worker_pb2.PrefillResponse | None = None,
) -> worker_pb2.GenerateRequest:
    """The request for one choice: the decode leg of a hand-off (pull the prompt's KV, go on
    from its first token); after a failure, the prompt plus what was generated; else the
    prompt."""
    if handoff is not None:
        req = worker_pb2.GenerateRequest(
            request_id=f"{job.request_id}-{index}", prompt_token_ids=job.prompt_ids,
            params=params, remote_kv=handoff.kv_handle, first_token_id=handoff.first_token_id,
        )  # fmt: skip
        if job.cache_salt:
            req.cache_salt = job.cache_salt
        return req
    if generated:
        params = _remaining(params, len(generated))
    req = worker_pb2.GenerateRequest(
        request_id=f"{job.request_id}-{index}" + (f"-r{len(generated)}" if generated else ""),
        prompt_token_ids=job.prompt_ids + generated,
        params=params,
    )
    if job.cache_salt:
        req.cache_salt = job.cache_salt
    return req


def _without_prompt_logprobs(params: common_pb2.SamplingParams) -> common_pb2.SamplingParams:
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(params)
    rest.ClearField("prompt_logprobs")
    return rest


def _remaining(params: common_pb2.SamplingParams, done: int) -> common_pb2.SamplingParams:
    """The params of a request resumed after ``done`` generated tokens, which it re-sends as
    the prompt's last tokens. (Not for the decode leg of a P/D hand-off: its engine takes the
    first token as an output.)"""
    rest = common_pb2.SamplingParams()
    rest.CopyFrom(params)
    if rest.HasField("max_tokens"):
        rest.max_tokens = max(rest.max_tokens - done, 1)
    rest.min_tokens = max(rest.min_tokens - done, 0)
    if rest.HasField("seed"):  # its token count starts again at 0 there: keep its draws
        rest.seed = continued_seed(rest.seed, done)
    if rest.HasField("structured_output"):  # the grammar goes on from where they left it
        rest.structured_output.replay_tokens = done
    return rest
