"""``EngineCore``: the scheduler and the executor, driven one step at a time.

    step():  schedule → submit → wait for the tokens → update → emit outputs

With async scheduling (the default on a GPU) the host runs one step ahead of the device:

    step():  schedule N+1 → submit N+1 (queued behind N) → wait for N's tokens → update N → emit

(``_run_step`` is both: without async scheduling nothing is submitted behind the step.)

so scheduling, input building and output handling overlap the device's work instead of leaving
it idle between steps. The scheduler counts the tokens of steps in flight as placeholders
(``Request.num_output_placeholders``) and the runner feeds them to the next step on the device.
A request that stops at step N has already been scheduled in N+1: that token is dropped.

It validates what it is given (a request it cannot run ends at once with finish reason "error"
instead of raising into the loop) and answers a small set of named utility calls.
"""

import logging
import time

import msgspec

from services.worker.engine.config import EngineConfig
from services.worker.engine.executor.executor import StepResult
from services.worker.engine.executor.factory import make_executor
from services.worker.engine.kv_cache.groups import KVCacheGroups
from services.worker.engine.kv_transfer.params import KVTransferParams
from services.worker.engine.kv_transfer.scheduler_side import KVTransferBookkeeping
from services.worker.engine.messages import (
    UTILITY_METHODS,
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreUtility,
    EngineStats,
    ErrorCode,
    UtilityResult,
)
from services.worker.engine.request import FinishReason, Request, RequestStatus
from services.worker.engine.sched.output import SchedulerOutput
from services.worker.engine.sched.scheduler import Scheduler
from services.worker.engine.structured.manager import StructuredOutputManager
from shared.ids import RequestId
from shared.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

GRAMMAR_WAIT_S = 0.01  # an engine with only requests whose grammars compile: how long it waits


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        self.executor = make_executor(config, show_progress)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(self.num_blocks)
        transfer = None
        if config.kv_transfer.enabled:
            transfer = KVTransferBookkeeping(
                config.kv_transfer, config.cache.block_size,
                self.executor.transfer_info().side_channel,
            )  # fmt: skip
        groups = KVCacheGroups.plan(config.model.arch.layer_cache_kinds())  # (the runner's)
        self.scheduler = Scheduler(
            config.scheduler, config.cache, self.num_blocks, transfer, groups
        )
        self._ended: list[EngineCoreOutput] = []  # requests that ended outside a step
        self.async_scheduling = config.scheduler.async_scheduling
        self._in_flight: tuple[SchedulerOutput, StepResult] | None = None  # submitted, not done
        self._kv_event_seq = 0
        self._model_seconds = 0.0
        self.structured: StructuredOutputManager | None = None  # made for the first grammar
        if config.structured.warmup:  # (its pool reads the vocabulary meanwhile)
            self._structured()
        logger.info(
            "engine core ready: %d KV blocks of %d tokens", self.num_blocks, config.cache.block_size
        )

    def step(self) -> EngineCoreOutputs:
        outputs, self._ended = self._ended, []
        busy = self.scheduler.has_requests() or self.scheduler.needs_polling()
        outputs += self._run_step(busy)
        if not outputs and self.structured is not None:
            compiling = self.scheduler.waiting_for_grammars()
            if compiling:  # nothing can run before a grammar is ready: wait, briefly
                self.structured.wait_any(compiling, GRAMMAR_WAIT_S)
        return EngineCoreOutputs(outputs=outputs, kv_events=self.take_kv_events())

    def _run_step(self, busy: bool) -> list[EngineCoreOutput]:
        """Finish the step in flight (submitting one first when none is), having submitted the
        next one behind it with async scheduling (at most two are ever out).

        A step with rows that sample under a grammar waits for their bitmask before it
        samples: the one submitted first gets it at once (its requests' tokens are all known);
        the one submitted behind a step in flight runs its forward pass while that step's
        tokens come back and advance the matchers, then gets its bitmask."""
        outputs: list[EngineCoreOutput] = []
        if self._in_flight is None:
            if not busy:
                return outputs
            self._in_flight = self._submit(outputs)
            self._sample(self._in_flight[0])
        following = self._submit(outputs) if busy and self.async_scheduling else None
        sched, pending = self._in_flight
        self._in_flight = following
        start = time.perf_counter()
        result = pending.result()
        self._model_seconds += time.perf_counter() - start
        outputs += self.scheduler.update_from_output(sched, result)
        if following is not None:
            self._sample(following[0])
        return outputs

    def _sample(self, sched: SchedulerOutput) -> None:
        """Give a submitted step with constrained rows their bitmask (now that every token
        before this step's is known), so that it samples."""
        if not sched.structured_req_ids:
            return
        assert self.structured is not None
        requests = self.scheduler.requests
        grammars = [
            r.grammar if (r := requests.get(RequestId(rid))) is not None else None
            for rid in sched.structured_req_ids
        ]
        self.executor.sample(self.structured.fill(sched.structured_req_ids, grammars))

    def _submit(self, outputs: list[EngineCoreOutput]) -> tuple[SchedulerOutput, StepResult]:
        """Schedule and submit a step; the KV transfer progress seen meanwhile is applied now
        (a finished pull is scheduled by the very next step), its failures go to ``outputs``."""
        sched = self.scheduler.schedule()
        start = time.perf_counter()
        pending = self.executor.submit(sched)
        self._model_seconds += time.perf_counter() - start
        outputs += self.scheduler.update_from_transfers(pending.transfers)
        return sched, pending

    def add_request(self, req: EngineCoreRequest) -> None:
        try:
            self.scheduler.add_request(self._make_request(req))
        except ValueError as e:
            self._ended.append(
                EngineCoreOutput(
                    req.request_id, [], finish_reason=FinishReason.ERROR, error=str(e),
                    error_code=ErrorCode.INVALID_REQUEST,
                )
            )  # fmt: skip

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self._ended) or self._in_flight is not None

    def needs_polling(self) -> bool:
        """KV pulls in flight or prefill leases held: step now and then even when idle."""
        return self.scheduler.needs_polling()

    def needs_idle_progress(self) -> bool:
        """A NIXL agent without a progress thread (CPU): it must be progressed even when this
        engine is idle, or a peer's READ or notification waits for our next request."""
        return self.executor.transfer_info().needs_idle_progress

    def progress_transfers(self) -> None:
        """Idle: let the agent answer its peers. A decode engine may still be reading blocks
        whose lease an abort has just ended (its request was aborted too, but the pull must
        end before its blocks are free); a late release notification ends nothing. What it
        reports goes the way a step's transfers go; outputs leave with the next step."""
        self._ended += self.scheduler.update_from_transfers(self.executor.poll_transfers())

    def stats(self) -> EngineStats:
        """The scheduler's counts with the model time and the KV transfers' counters."""
        extra: dict[str, object] = {"model_seconds": self._model_seconds}
        extra.update(self.executor.transfer_info().stats)
        transfer = self.scheduler.transfer
        if transfer is not None:
            extra["kv_leases_released"] = transfer.num_released
            extra["kv_leases_expired"] = transfer.num_expired
            extra["kv_stale_handles"] = transfer.num_stale
            extra["kv_leases_held"] = len(transfer.leases)
        return msgspec.structs.replace(self.scheduler.stats(), **extra)

    def call_utility(self, call: EngineCoreUtility) -> UtilityResult:
        result: object
        if call.method == "get_stats":
            result = self.stats()
        elif call.method == "get_model_info":
            result = self.executor.model_info()
            if self.config.kv_transfer.enabled:
                channel = self.executor.transfer_info().side_channel
                result = msgspec.structs.replace(result, kv_side_channel=channel)
        elif call.method == "reset_prefix_cache":
            result = self.scheduler.kv.reset_prefix_cache()
        elif call.method == "resync_kv_events":  # the events leave with this call's answer
            self.scheduler.kv.pool.announce_all()
            result = True
        else:
            known = ", ".join(sorted(UTILITY_METHODS))
            return UtilityResult(
                call.call_id, error=f"unknown method {call.method!r}; known: {known}"
            )
        return UtilityResult(call.call_id, result=msgspec.Raw(msgspec.msgpack.encode(result)))

    def shutdown(self) -> None:
        if self.structured is not None:
            self.structured.shutdown()
        self.executor.shutdown()

    def _make_request(self, req: EngineCoreRequest) -> Request:
        cfg = self.config.model
        prompt = req.prompt_token_ids
        if not prompt:
            raise ValueError("the prompt is empty")
        if len(prompt) >= cfg.max_model_len:
            raise ValueError(
                f"the prompt has {len(prompt)} tokens; the context length is {cfg.max_model_len}, "
                "which must leave room for at least one generated token"
            )
        vocab = cfg.arch.vocab_size
        bad = next((t for t in prompt if not 0 <= t < vocab), None)
        if bad is not None:
            raise ValueError(f"token id {bad} is outside the vocabulary [0, {vocab})")
        request = Request(
            RequestId(req.request_id),
            list(prompt),
            req.sampling_params,
            cfg.arch.eos_token_ids,
            self.config.cache.block_size,
            cfg.max_model_len,
            req.cache_salt,
        )
        if req.kv_transfer is not None:
            self._attach_kv_transfer(request, req.kv_transfer)
        structured = req.sampling_params.structured_outputs
        if structured is not None:  # its grammar compiles while it waits (and pulls its KV)
            request.grammar = self._structured().request_grammar(structured, list(prompt))
        return request

    def _structured(self) -> StructuredOutputManager:
        """The grammar compiler, made for the first request that has a grammar (an engine
        that never gets one never reads the tokenizer's vocabulary for it)."""
        if self.structured is None:
            cfg, s = self.config.model, self.config.structured
            self.structured = StructuredOutputManager(
                cfg.tokenizer, cfg.arch.vocab_size, cfg.arch.eos_token_ids,
                self.config.scheduler.max_num_seqs, s.compile_threads, s.compile_timeout_s,
                s.cache_bytes, s.max_whitespace,
                pin_memory=self.config.device.device == "cuda"
                and self.config.parallel.distributed_executor_backend == "uni",
            )  # fmt: skip
        return self.structured

    def _attach_kv_transfer(self, request: Request, params: KVTransferParams) -> None:
        if not self.config.kv_transfer.enabled:
            raise ValueError("this engine was started without KV transfer (kv_transfer=True)")
        request.attach_kv_transfer(params)

    def take_kv_events(self) -> KVEventBatch | None:
        """The KV events since the last call, as one numbered batch (None when there are none)."""
        events = self.scheduler.take_kv_events()
        if not events:
            return None
        self._kv_event_seq += 1
        return KVEventBatch(seq=self._kv_event_seq, events=events)
