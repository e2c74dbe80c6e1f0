"""Continuous batching with chunked prefill and preemption by recompute.

Each step has a token budget. Running requests go first, in admission order, each asking for
all the tokens it has not computed yet (one, when decoding; a chunk, mid-prefill). When the KV
cache cannot hold them, the most recently admitted running request is preempted: its blocks
are freed and it waits again at the head of the queue, to recompute later (cheaply, when its
blocks are still in the prefix cache). Then waiting requests are admitted while budget, slots
and blocks last; a long prompt takes what budget is left and continues next step.
"""

import time
from collections import deque
from collections.abc import Iterable
from typing import TYPE_CHECKING

from services.worker.engine.config import CacheConfig, SchedulerConfig
from services.worker.engine.kv_cache.groups import KVCacheGroups
from services.worker.engine.kv_cache.manager import BlockIds, KVCacheBlocks, KVCacheManager
from services.worker.engine.kv_transfer.connector import TransferResults
from services.worker.engine.kv_transfer.params import RemoteKV
from services.worker.engine.kv_transfer.scheduler_side import KVTransferBookkeeping
from services.worker.engine.messages import (
    EngineCoreOutput,
    EngineStats,
    ErrorCode,
    SampleLogprobs,
)
from services.worker.engine.request import FINISH_REASONS, FinishReason, Request, RequestStatus
from services.worker.engine.sched.output import (
    CachedRequestData,
    ModelRunnerOutput,
    NewRequestData,
    SchedulerOutput,
)
from shared.ids import RequestId
from shared.kv_events import KVEvent

if TYPE_CHECKING:  # (only the requests hold one; the scheduler asks it ready/accept)
    from services.worker.engine.structured.manager import RequestGrammar

_LEASABLE = (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH_CAPPED)
PULL_FAILED = "pulling the prompt's KV cache from the prefill worker failed"
LEASE_EXPIRED = (
    "the prefill worker's lease on the prompt's KV cache expired before this worker could read it"
)


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        cache: CacheConfig,
        num_blocks: int,
        transfer: KVTransferBookkeeping | None = None,
        groups: KVCacheGroups | None = None,
    ):
        self.config = config
        self.transfer = transfer  # None: this engine does no KV transfer
        # (the layers' kinds stay behind the manager: the scheduler passes its results on)
        self.kv = KVCacheManager(num_blocks, cache.block_size, cache.enable_prefix_caching, groups)
        self.requests: dict[RequestId, Request] = {}
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._finished_since_last_step: set[str] = set()
        self._ended: list[EngineCoreOutput] = []  # failed decode legs not reported yet
        self._num_preemptions = 0
        self._prompt_tokens = 0
        self._prefix_hit_tokens = 0
        self._computed_tokens = 0
        self._num_steps = 0
        self._context_tokens_read = 0

    # ---- requests in and out -------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"duplicate request id {request.request_id!r}")
        self.requests[request.request_id] = request
        request.admitted_at = time.monotonic()
        self.waiting.append(request)

    def finish_requests(self, request_ids: Iterable[str], status: RequestStatus) -> None:
        """End requests from outside the step (abort, stop string); unknown ids are ignored."""
        for rid in request_ids:
            request = self.requests.get(RequestId(rid))
            if request is None or request.status.finished:
                self.end_lease(rid)  # an aborted prefill leg releases its blocks
                continue
            if self.transfer is not None and request.request_id in self.transfer.loading:
                request.status = status  # its pull still writes into its blocks: free later
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            else:
                self.waiting.remove(request)
            self._free(request, status)

    def has_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def needs_polling(self) -> bool:
        """KV pulls in flight or leases held: the engine must keep stepping (no tokens)."""
        return self.transfer is not None and self.transfer.busy

    # ---- one step ------------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_req_ids=self._finished_since_last_step)
        self._finished_since_last_step = set()
        if self.transfer is not None:
            for rid in self.transfer.expired():
                self.end_lease(rid, expired=True)
        budget = self._schedule_running(out, self.config.max_num_batched_tokens)
        if not out.preempted_req_ids:
            self._schedule_waiting(out, budget)
        for rid, n in out.num_scheduled_tokens.items():
            request = self.requests[RequestId(rid)]
            request.num_computed_tokens += n
            self._context_tokens_read += request.num_computed_tokens
            if request.num_computed_tokens == request.num_tokens_with_placeholders:
                request.num_output_placeholders += 1  # this step samples its next token
                if request.grammar is not None:
                    out.structured_req_ids.append(rid)
        out.total_num_scheduled_tokens = sum(out.num_scheduled_tokens.values())
        self._computed_tokens += out.total_num_scheduled_tokens
        self._num_steps += out.total_num_scheduled_tokens > 0
        return out

    def _schedule_running(self, out: SchedulerOutput, budget: int) -> int:
        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            if request.length_reached:  # a step in flight samples its last token
                i += 1
                continue
            num_new = min(
                request.num_tokens_with_placeholders - request.num_computed_tokens, budget
            )
            num_new = self.kv.checkpoint_aligned(request, request.num_computed_tokens, num_new)
            blocks = self._allocate_or_preempt(request, num_new, out)
            if blocks is None:  # it preempted itself: nothing after it can run either
                break
            out.cached_reqs.append(
                CachedRequestData(
                    req_id=request.request_id,
                    new_block_ids=blocks.block_ids(),
                    num_computed_tokens=request.num_computed_tokens,
                    resumed_from_preemption=False,
                )
            )
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
            i += 1
        return budget

    def _allocate_or_preempt(
        self, request: Request, num_new: int, out: SchedulerOutput
    ) -> KVCacheBlocks | None:
        while True:
            blocks = self.kv.allocate_slots(request, num_new)
            if blocks is not None:
                return blocks
            victim = self.running.pop()  # the most recently admitted
            self._preempt(victim)
            out.preempted_req_ids.add(victim.request_id)
            if victim is request:
                return None

    def _schedule_waiting(self, out: SchedulerOutput, budget: int) -> None:
        compiling: list[Request] = []  # passed over: their grammars are not ready yet
        while self.waiting and budget > 0 and self._num_admitted < self.config.max_num_seqs:
            request = self.waiting[0]
            if request.num_output_placeholders:  # preempted while its last step ran: wait for it
                break
            if request.status == RequestStatus.WAITING_FOR_REMOTE_KV and not request.kv_ready:
                if not self._start_pull(request, out):  # (its grammar compiles meanwhile)
                    break
                continue
            grammar = request.grammar
            if grammar is not None and not grammar.ready(request.output_token_ids):
                self.waiting.popleft()
                if grammar.error is None:
                    compiling.append(request)
                else:
                    self._fail(request, grammar.error, grammar.error_code)
                continue
            if request.kv_ready:  # its prompt's KV was pulled: decode on from the first token
                hits, num_hit = None, request.num_computed_tokens
            else:
                hits, num_hit = self.kv.get_computed_blocks(request)
            num_new = request.num_tokens - num_hit
            if num_new > budget:
                if not self.config.enable_chunked_prefill:
                    break
                num_new = budget
            num_new = self.kv.checkpoint_aligned(request, num_hit, num_new)
            if self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.popleft()
            self.running.append(request)
            resumed = request.status == RequestStatus.PREEMPTED
            request.status = RequestStatus.RUNNING
            request.num_computed_tokens = num_hit
            request.kv_ready = False
            if request.num_cached_tokens is None:
                request.num_cached_tokens = num_hit
                request.queued_seconds = time.monotonic() - request.admitted_at
                self._prompt_tokens += request.num_prompt_tokens
                self._prefix_hit_tokens += num_hit
            block_ids = self.kv.get_block_ids(request.request_id)
            if resumed:
                out.cached_reqs.append(
                    CachedRequestData(request.request_id, block_ids, num_hit, True)
                )
            else:
                out.new_reqs.append(self._new_request_data(request, block_ids))
            out.num_scheduled_tokens[request.request_id] = num_new
            budget -= num_new
        self.waiting.extendleft(reversed(compiling))

    def waiting_for_grammars(self) -> "list[RequestGrammar]":
        """The grammars that requests wait for, when nothing else can run (empty otherwise)."""
        if self.running:
            return []
        grammars = [r.grammar for r in self.waiting if r.grammar is not None]
        pending = [g for g in grammars if g.matcher is None and g.error is None]
        return pending if len(pending) == len(self.waiting) else []

    @property
    def _num_admitted(self) -> int:
        return len(self.running) + (len(self.transfer.loading) if self.transfer else 0)

    def _start_pull(self, request: Request, out: SchedulerOutput) -> bool:
        """Allocate a decode leg's prompt blocks (reusing local prefix hits, left out of the
        prefix index until filled) and ask the worker to pull the rest; False: no room yet.
        A lease that has expired meanwhile fails the pull unread (the prefill engine may have
        reused those blocks), and so does a handle its worker refused (an unregistered peer)."""
        assert self.transfer is not None
        assert request.kv_transfer is not None
        refused = request.kv_transfer.refused
        remote = request.kv_transfer.remote
        if remote is not None and remote.num_groups != self.kv.groups.num_groups:
            refused = (f"the KV handle has {remote.num_groups} KV cache groups, this engine "
                       f"{self.kv.groups.num_groups} ({self.kv.groups.describe()})")  # fmt: skip
        if refused or self.transfer.lease_expired(request):
            self.waiting.popleft()
            # (a recompute goes back to the head)
            self._fail_pull(request, refused or LEASE_EXPIRED)
            return True
        hits, num_hit = self.kv.get_computed_blocks(request)
        num_hit = min(num_hit, request.num_prompt_tokens)
        need = request.num_prompt_tokens - num_hit  # (filled by the pull)
        if self.kv.allocate_slots(request, 0, hits, index=False, num_external=need) is None:
            return False
        self.waiting.popleft()
        request.num_cached_tokens = num_hit
        request.queued_seconds = time.monotonic() - request.admitted_at
        block_ids = self.kv.get_block_ids(request.request_id)
        try:
            load = self.transfer.load_for(request, block_ids, num_hit, self.kv.null_block_id)
        except ValueError as e:  # a handle that does not hold what this side needs
            self._fail_pull(request, str(e))
            return True
        out.kv_loads.append(load)
        return True

    def update_from_transfers(self, results: TransferResults) -> list[EngineCoreOutput]:
        """The one way in for KV-transfer progress: pulls that ended decode on, recompute or
        fail (an abort meanwhile frees them); leases a peer has read end. Returns the outputs
        of the decode legs that failed since the last call (here or while scheduling: a stale
        handle). The core applies a step's transfers as soon as the step is submitted
        (``EngineCore._submit``), not when its tokens come back, so a pulled request is
        scheduled by the very next step."""
        if self.transfer is not None:
            for rid in results.finished + results.failed:
                request = self.transfer.loading.pop(RequestId(rid), None)
                if request is None:
                    continue
                if request.status.finished:  # aborted while its pull ran
                    self._free(request, request.status)
                elif rid in results.finished:
                    request.kv_ready = True
                    request.num_computed_tokens = request.num_prompt_tokens
                    self.kv.index_blocks(request, request.num_prompt_tokens)
                    self.waiting.appendleft(request)
                else:
                    self._fail_pull(request, PULL_FAILED)
            for rid in results.released:
                self.end_lease(rid)
        ended, self._ended = self._ended, []
        return ended

    def _fail_pull(self, request: Request, error: str) -> None:
        """A decode leg without its KV (no longer loading nor queued): recomputed here from the
        head of the queue when configured, else ended with a ``kv_transfer_failed`` error."""
        assert self.transfer is not None
        if self.transfer.recompute_on_failure:
            self.kv.free(request)
            request.status, request.num_computed_tokens = RequestStatus.WAITING, 0
            self.waiting.appendleft(request)
            return
        self._fail(request, error, ErrorCode.KV_TRANSFER_FAILED)

    def _fail(self, request: Request, error: str, code: ErrorCode) -> None:
        """End a request that is in no queue with an error (reported with the next outputs)."""
        self._free(request, RequestStatus.FINISHED_ERROR)
        self._ended.append(
            EngineCoreOutput(
                request.request_id, [], finish_reason=FinishReason.ERROR, error=error,
                error_code=code,
            )
        )  # fmt: skip

    def end_lease(self, request_id: str, expired: bool = False) -> None:
        request = self.transfer.end_lease(request_id, expired) if self.transfer else None
        if request is not None:
            self.kv.free(request)

    @staticmethod
    def _new_request_data(request: Request, block_ids: BlockIds) -> NewRequestData:
        return NewRequestData(
            req_id=request.request_id,
            token_ids=list(request.all_token_ids),
            num_prompt_tokens=request.num_prompt_tokens,
            params=request.params,
            eos_token_ids=request.eos_token_ids,
            block_ids=block_ids,
            num_computed_tokens=request.num_computed_tokens,
        )

    def _preempt(self, request: Request) -> None:
        self.kv.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preemptions += 1
        self.waiting.appendleft(request)

    # ---- after the model ran -------------------------------------------------------------
    def update_from_output(
        self, sched: SchedulerOutput, result: ModelRunnerOutput
    ) -> list[EngineCoreOutput]:
        outputs: list[EngineCoreOutput] = []
        for rid, tokens, logprobs in zip(
            result.req_ids, result.sampled_token_ids, result.logprobs, strict=True
        ):
            request = self.requests.get(RequestId(rid))
            if request is None:  # finished meanwhile
                continue
            prompt_logprobs = self._new_prompt_logprobs(request, result)
            if not tokens:  # a prefill chunk
                if prompt_logprobs:
                    outputs.append(EngineCoreOutput(rid, [], new_prompt_logprobs=prompt_logprobs))
                continue
            request.num_output_placeholders -= 1
            status = None
            if request.max_tokens == 0:  # only its prompt was asked for: the sample is dropped
                tokens, logprobs, status = [], None, RequestStatus.FINISHED_LENGTH_CAPPED
            for i, token in enumerate(tokens):
                grammar = request.grammar
                if grammar is not None and not grammar.accept(token):
                    # the mask left nothing to sample: a whole grammar allows only its stop
                    # token, which min_tokens bans (it ends there; the token is dropped), or
                    # the grammar and allowed_token_ids/bad_words exclude each other
                    tokens, logprobs = tokens[:i], None
                    status = RequestStatus.FINISHED_STOPPED
                    if not grammar.completed:
                        status = RequestStatus.FINISHED_ERROR
                        request.error = f"the grammar does not allow the sampled token {token}"
                    break
                request.append_output_token(token)
                status = request.check_stop()
                if status is not None:
                    break
            handle = None
            if status is not None:
                # a later step may have preempted it already (async scheduling)
                queue = self.running if request.status == RequestStatus.RUNNING else self.waiting
                queue.remove(request)
                handle = self._free(request, status)
            outputs.append(
                EngineCoreOutput(
                    request_id=rid,
                    new_token_ids=tokens,
                    new_logprobs=[logprobs] if logprobs is not None else None,
                    new_prompt_logprobs=prompt_logprobs,
                    finish_reason=FINISH_REASONS[status] if status is not None else None,
                    error=request.error,
                    stop_reason=request.stop_reason,
                    num_cached_tokens=request.num_cached_tokens or 0,
                    queued_seconds=request.queued_seconds,
                    kv_handle=handle,
                )
            )
        return outputs

    @staticmethod
    def _new_prompt_logprobs(
        request: Request, result: ModelRunnerOutput
    ) -> list[SampleLogprobs] | None:
        """The prompt logprobs a step computed for ``request`` that were not reported yet (a
        chunk recomputed after a preemption was)."""
        chunk = result.prompt_logprobs.get(request.request_id)
        if chunk is None:
            return None
        fresh = chunk.entries[max(request.num_prompt_logprobs - chunk.start, 0) :]
        reported = chunk.start + len(chunk.entries)
        request.num_prompt_logprobs = max(request.num_prompt_logprobs, reported)
        return fresh or None

    def _free(self, request: Request, status: RequestStatus) -> RemoteKV | None:
        """End a request. A prefill leg that finished normally keeps its blocks under a lease
        and returns the KV handle for the decode side."""
        request.status = status
        request.grammar = None  # (its matcher's memory)
        handle = None
        remote_decode = request.kv_transfer is not None and request.kv_transfer.do_remote_decode
        if self.transfer is not None and remote_decode and status in _LEASABLE:
            # (what a continuation from the prompt's end needs: a window's blocks in a
            # windowed group; the rest is freed now)
            block_ids = self.kv.hand_over(request, request.num_prompt_tokens)
            handle = self.transfer.lease(request, block_ids, self.kv.null_block_id)
        else:
            self.kv.free(request)
        del self.requests[request.request_id]
        self._finished_since_last_step.add(request.request_id)
        return handle

    # ---- introspection -------------------------------------------------------------------
    def take_kv_events(self) -> list[KVEvent]:
        return self.kv.take_events()

    def stats(self) -> EngineStats:
        pool = self.kv.pool
        return EngineStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_blocks=pool.num_blocks,
            num_free_blocks=pool.num_free_blocks,
            num_cached_blocks=pool.num_cached_blocks,
            kv_usage=pool.usage,
            num_preemptions=self._num_preemptions,
            prefix_hit_tokens=self._prefix_hit_tokens,
            prompt_tokens=self._prompt_tokens,
            computed_tokens=self._computed_tokens,
            num_steps=self._num_steps,
            context_tokens_read=self._context_tokens_read,
            pending_prefill_tokens=sum(
                max(r.num_prompt_tokens - r.num_computed_tokens, 0)
                for r in (*self.running, *self.waiting)
            ),
        )
