"""The GlobalScheduler gRPC service: translation only; the registry, the directory and the
routing policy do the work. Workers leave the registry when their heartbeat stream ends (at
once; a stream that broke during this scheduler's own stall only if its worker does not
register again in time: ``WorkerRegistry.stream_ended``) or goes silent (``sweep``, within
``heartbeat_timeout_s`` + one sweep interval).

A worker dropped for silence is hung or cut off, and what streams from it will not finish:
``sweep`` tells every gateway at once, with a ``WorkersLost`` notice on each open RouteStream
(at most ``MAX_NOTICES`` waiting on one: a gateway that does not read loses notices rather
than grow the scheduler's memory), and a heartbeat that still arrives from it is answered
``dropped`` (it registers again under a new incarnation). A worker that leaves cleanly ends
its own requests and is not announced."""

import asyncio
import logging
import time
from collections.abc import AsyncIterator

import grpc
from grpc import aio

from services.global_scheduler import convert, metrics
from services.global_scheduler.directory import PrefixDirectory
from services.global_scheduler.planner import WorkerSignal
from services.global_scheduler.registry import WorkerRegistry, WorkerState
from services.global_scheduler.routing import (
    Candidate,
    NoWorkerError,
    Reason,
    RouteQuery,
    RoutingPolicy,
)
from shared import hop_trace
from shared.ids import BlockHash, WorkerId
from shared.logs import request_id_var
from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import adopt_request_id

logger = logging.getLogger(__name__)

MAX_NOTICES = 8  # notices waiting on one RouteStream; beyond, new ones are dropped


class RouteFailed(Exception):
    """No route: the status a unary Route ends with, or a RouteStream call's failure."""

    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code, self.message = code, message


def _ref(c: Candidate) -> scheduler_pb2.WorkerRef:
    return scheduler_pb2.WorkerRef(
        worker_id=c.worker.worker_id, address=c.worker.address, matched_blocks=c.matched_blocks
    )


class _RouteReplies:
    """What one RouteStream sends: its calls' replies (one per call the gateway made) and the
    scheduler's notices, of which at most MAX_NOTICES wait."""

    def __init__(self) -> None:
        self._queue: asyncio.Queue[scheduler_pb2.RouteReply | None] = asyncio.Queue()
        self._notices = 0  # notices in the queue

    def put(self, reply: scheduler_pb2.RouteReply | None) -> None:
        """A call's reply, or None: the stream ends after what is queued."""
        self._queue.put_nowait(reply)

    def notice(self, reply: scheduler_pb2.RouteReply) -> bool:
        """Queue a notice; False (dropped) when MAX_NOTICES already wait."""
        if self._notices >= MAX_NOTICES:
            return False
        self._notices += 1
        self._queue.put_nowait(reply)
        return True

    async def get(self) -> scheduler_pb2.RouteReply | None:
        reply = await self._queue.get()
        if reply is not None and reply.HasField("lost"):
            self._notices -= 1
        return reply


class SchedulerServicer(scheduler_pb2_grpc.GlobalSchedulerServicer):
    def __init__(self, registry: WorkerRegistry, directory: PrefixDirectory, policy: RoutingPolicy):
        self.registry = registry
        self.directory = directory
        self.policy = policy
        self._resync: set[WorkerId] = set()
        # the side channels of the registered prefill-capable workers (a new tuple whenever
        # the registry changes): each decode-capable worker is sent it when it changes
        self._kv_peers: tuple[str, ...] = ()
        self._route_streams: set[_RouteReplies] = set()  # the open RouteStreams

    async def Heartbeat(
        self,
        request_iterator: AsyncIterator[scheduler_pb2.WorkerHeartbeat],
        context: aio.ServicerContext,
    ) -> AsyncIterator[scheduler_pb2.SchedulerCommand]:
        worker: WorkerState | None = None
        peers_sent: tuple[str, ...] | None = None
        clean = False  # the worker said it was leaving (any other end is a break)
        try:
            async for msg in request_iterator:
                if msg.leaving:
                    clean = True
                    return
                if worker is None:
                    worker = await self._register(msg, context)
                else:
                    load, hits = convert.load(msg.load), worker.load.prefix_hit_tokens
                    if not self.registry.heartbeat(worker.worker_id, worker.incarnation, load):
                        # expired meanwhile: its work was moved; it must start afresh
                        why = worker.dropped or "no longer registered"
                        yield scheduler_pb2.SchedulerCommand(dropped=True, reason=(
                            f"{why}: dropped; register again under a new incarnation"))  # fmt: skip
                        return
                    metrics.ENGINE_HIT_TOKENS.inc(max(load.prefix_hit_tokens - hits, 0))
                for batch in msg.kv_events:
                    await self.directory.apply(
                        worker.worker_id, worker.incarnation, convert.kv_event_batch(batch)
                    )
                    metrics.KV_EVENTS.inc(len(batch.events))
                if worker.worker_id in self._resync:
                    self._resync.discard(worker.worker_id)
                    yield scheduler_pb2.SchedulerCommand(
                        resync_kv_events=True, reason="the prefix directory lost events"
                    )
                if worker.role != "prefill" and peers_sent is not self._kv_peers:
                    peers_sent = self._kv_peers
                    yield scheduler_pb2.SchedulerCommand(
                        kv_peers=scheduler_pb2.KVPeers(side_channels=peers_sent)
                    )
        finally:
            if worker is not None:
                await self._stream_ended(worker, clean)

    def request_resync(self) -> None:
        """Ask every live worker to re-announce its KV blocks (on its next heartbeat)."""
        self._resync.update(w.worker_id for w in self.registry.workers())

    async def Route(
        self, request: scheduler_pb2.RouteRequest, context: aio.ServicerContext
    ) -> scheduler_pb2.RouteResponse:
        adopt_request_id(context)
        try:
            return await self.route(request)
        except RouteFailed as e:
            await context.abort(e.code, e.message)
            raise  # unreachable: abort raises

    async def RouteStream(
        self, calls: AsyncIterator[scheduler_pb2.RouteCall], context: aio.ServicerContext
    ) -> AsyncIterator[scheduler_pb2.RouteReply]:
        """Route each call as it arrives (concurrently: a Redis directory lookup must not hold
        up the calls behind it) and reply in completion order; a failure answers its call."""
        replies = _RouteReplies()
        routing: set[asyncio.Task[None]] = set()

        async def one(call: scheduler_pb2.RouteCall) -> None:
            request_id_var.set(call.trace_id or call.request.request_id)
            reply = scheduler_pb2.RouteReply(call_id=call.call_id)
            try:
                reply.route.CopyFrom(await self.route(call.request))
            except RouteFailed as e:
                reply.failure.code, reply.failure.message = e.code.value[0], e.message
            except Exception as e:  # a bug must answer its call, as a unary call would
                logger.exception("routing %s failed", call.request.request_id)
                reply.failure.code = grpc.StatusCode.INTERNAL.value[0]
                reply.failure.message = f"routing failed: {e}"
            replies.put(reply)

        async def read() -> None:
            try:
                async for call in calls:
                    task = asyncio.get_running_loop().create_task(one(call))
                    routing.add(task)
                    task.add_done_callback(routing.discard)
                await asyncio.gather(*routing)  # the gateway closed its side: finish what it asked
            finally:
                replies.put(None)

        reader = asyncio.get_running_loop().create_task(read())
        self._route_streams.add(replies)
        try:
            while (reply := await replies.get()) is not None:
                yield reply
        finally:
            self._route_streams.discard(replies)
            reader.cancel()
            for task in list(routing):
                task.cancel()

    async def route(self, request: scheduler_pb2.RouteRequest) -> scheduler_pb2.RouteResponse:
        """Where one request goes (what Route and each RouteStream call answer); RouteFailed
        when nowhere: no live worker serves its model, or none is left by the filters."""
        hop_trace.mark("scheduler.route_in")
        start = time.perf_counter()
        if request.finished_request_ids:
            for w in self.registry.workers():
                for rid in request.finished_request_ids:
                    w.finished(rid)
        workers = [w for w in self.registry.workers() if w.model == request.model]
        if not workers:
            metrics.ROUTES.labels("no_worker", "model").inc()
            known = sorted(self.registry.models())
            raise RouteFailed(
                grpc.StatusCode.NOT_FOUND,
                f"no live worker serves model {request.model!r}; served: {known}",
            )
        hashes = [BlockHash(h) for h in request.block_hashes]
        live = {w.worker_id: w.incarnation for w in workers}
        matches = await self.directory.longest_prefix(hashes, live)
        query = RouteQuery(
            request.model, len(hashes), request_id=request.request_id,
            num_prompt_tokens=request.num_prompt_tokens,
            exclude=frozenset(request.exclude_workers),
        )  # fmt: skip
        candidates = [
            Candidate(w, matches[w.worker_id].blocks, matches[w.worker_id].pending) for w in workers
        ]
        try:
            decision = self.policy.route(query, candidates)
        except NoWorkerError as e:
            metrics.ROUTES.labels("no_worker", "filters").inc()
            raise RouteFailed(grpc.StatusCode.UNAVAILABLE, str(e)) from None
        best, prefill = decision.decode, decision.prefill
        if decision.reason != Reason.NO_PREFILL_POOL:
            where = "local" if prefill is None else "remote"
            metrics.PREFILL_DECISIONS.labels(where, decision.reason.value).inc()
        chosen = [c for c in (best, prefill) if c is not None]
        for c in chosen:
            c.worker.routed(request.request_id)
        if hashes and self.policy.pending_ttl_s > 0:  # where this prompt's blocks will be
            holders = [(c.worker.worker_id, c.worker.incarnation) for c in chosen]
            await self.directory.record_pending(holders, hashes, self.policy.pending_ttl_s)
        factor = "prefix" if best.matched_blocks else "load"
        metrics.ROUTES.labels("disaggregated" if prefill else "routed", factor).inc()
        block = best.worker.block_size
        confirmed = best.matched_blocks - best.pending_blocks
        metrics.PREDICTED_HIT_TOKENS.labels("confirmed").inc(confirmed * block)
        metrics.PREDICTED_HIT_TOKENS.labels("pending").inc(best.pending_blocks * block)
        metrics.ROUTE_SECONDS.observe(time.perf_counter() - start)
        reason = self.policy.reason(best)
        if prefill is not None:
            reason += f"; prefill on {self.policy.reason(prefill)}"
        logger.info("route %s → %s", request.request_id, reason)
        response = scheduler_pb2.RouteResponse(
            decode=_ref(best), reason=reason, block_size=best.worker.block_size
        )
        if prefill is not None:
            response.prefill.CopyFrom(_ref(prefill))
        hop_trace.mark("scheduler.route_out")
        return response

    async def ListWorkers(
        self, request: scheduler_pb2.ListWorkersRequest, context: aio.ServicerContext
    ) -> scheduler_pb2.ListWorkersResponse:
        now = self.registry.clock()
        return scheduler_pb2.ListWorkersResponse(
            workers=[
                scheduler_pb2.WorkerInfo(
                    registration=convert.registration(w),
                    load=convert.load_msg(w.load),
                    seconds_since_heartbeat=now - w.last_seen,
                    num_cached_blocks=await self.directory.num_blocks(w.worker_id, w.incarnation),
                    num_routed=w.num_routed,
                    detached=w.detached,
                )
                for w in self.registry.workers()
            ]
        )

    async def sweep(self) -> None:
        """Drop workers whose heartbeat went silent and tell the gateways (called every sweep
        interval)."""
        expiry = self.registry.expire()
        if expiry.stalled_s:
            logger.warning("the scheduler itself stalled for %.1f s (stopped, or its loop "
                           "blocked): no worker expires this round", expiry.stalled_s)  # fmt: skip
            metrics.STALLS.inc()
        if expiry.expired:
            self._tell_gateways(expiry.expired)
        for w in expiry.expired:
            logger.warning("worker %s %s: removed", w.worker_id, w.dropped)
            metrics.WORKER_EVENTS.labels("expired").inc()
            if self.registry.get(w.worker_id, w.incarnation) is None:  # (not back meanwhile)
                await self.directory.forget(w.worker_id, w.incarnation)
        for w in expiry.detached:  # (as its stream's end would have: no gateway is told)
            if self.registry.get(w.worker_id, w.incarnation) is None:
                await self._forget(w, f"its stream broke in this scheduler's stall and it "
                                      f"did not register again ({w.dropped})")  # fmt: skip
        self._update_alive()

    def _tell_gateways(self, lost: list[WorkerState]) -> None:
        """One WorkersLost notice on every open RouteStream."""
        notice = scheduler_pb2.RouteReply(call_id=0, lost=scheduler_pb2.WorkersLost(workers=[
            scheduler_pb2.LostWorker(worker_id=w.worker_id, address=w.address,
                                     incarnation=w.incarnation, reason=w.dropped)
            for w in lost
        ]))  # fmt: skip
        for stream in self._route_streams:
            metrics.LOST_NOTICES.labels("queued" if stream.notice(notice) else "dropped").inc()

    async def _register(
        self, msg: scheduler_pb2.WorkerHeartbeat, context: aio.ServicerContext
    ) -> WorkerState:
        if not msg.HasField("registration"):
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "first message must register")
        try:
            worker = convert.worker_state(msg.registration)
        except ValueError as e:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
            raise  # unreachable: abort raises
        worker.load = convert.load(msg.load)
        old = self.registry.register(worker)
        if old is not None and old.incarnation != worker.incarnation:
            await self.directory.forget(old.worker_id, old.incarnation)
        logger.info("worker %s registered: %s at %s (%s)", worker.worker_id, worker.role,
                    worker.address, worker.model)  # fmt: skip
        metrics.WORKER_EVENTS.labels("registered").inc()
        self._update_alive()
        return worker

    async def _stream_ended(self, worker: WorkerState, clean: bool) -> None:
        if self.registry.stream_ended(worker, clean):
            await self._forget(worker, "stream ended" if clean else "stream broke")
        elif worker.detached:
            logger.info(
                "worker %s's stream broke during or just after this scheduler's stall: "
                "kept for its reconnection (or its heartbeat timeout)",
                worker.worker_id,
            )

    async def _remove(self, worker: WorkerState, why: str) -> None:
        if self.registry.remove(worker.worker_id, worker.incarnation) is not None:
            await self._forget(worker, why)
        else:
            self._update_alive()

    async def _forget(self, worker: WorkerState, why: str) -> None:
        """``worker`` has left the registry: its blocks leave the directory."""
        await self.directory.forget(worker.worker_id, worker.incarnation)
        logger.info("worker %s removed: %s", worker.worker_id, why)
        metrics.WORKER_EVENTS.labels("removed").inc()
        self._update_alive()

    # -- what pod discovery and the planner change (discovery.WorkerSink) ----------------

    def cordon(self, worker_id: WorkerId, why: str) -> None:
        self.registry.cordon(worker_id, why)

    def uncordon(self, worker_id: WorkerId, why: str) -> None:
        self.registry.uncordon(worker_id, why)

    async def forget(self, worker_id: WorkerId, why: str) -> None:
        """The worker is gone for good (its pod was deleted): out of the registry and the
        directory now, whatever its heartbeat stream still does."""
        state = self.registry.get(worker_id)
        if state is not None:
            await self._remove(state, why)
        self.registry.uncordon(worker_id)

    def is_registered(self, worker_id: WorkerId) -> bool:
        return self.registry.get(worker_id) is not None

    def worker_signals(self) -> list[WorkerSignal]:
        cordoned = self.registry.cordoned()
        out = []
        for w in self.registry.workers():
            load = w.load
            out.append(WorkerSignal(
                w.worker_id, w.role, load.num_running, load.num_waiting, load.num_in_flight,
                load.kv_usage, load.pending_prefill_tokens, load.tokens_per_s,
                cordoned.get(w.worker_id, ""),
            ))  # fmt: skip
        return out

    def _update_alive(self) -> None:
        counts = dict.fromkeys(("prefill", "decode", "both"), 0)
        peers = set()
        for w in self.registry.workers():
            counts[w.role] += 1
            if w.role != "decode" and w.kv_side_channel:
                peers.add(w.kv_side_channel)
        if tuple(sorted(peers)) != self._kv_peers:
            self._kv_peers = tuple(sorted(peers))
        for role, n in counts.items():
            metrics.WORKERS_ALIVE.labels(role).set(n)
