"""``EngineCore``: the scheduler and the executor, driven one step at a time.

    step():  schedule → execute → update → emit outputs

It validates what it is given (a request it cannot run ends at once with finish reason "error"
instead of raising into the loop) and answers a small set of named utility calls.
"""

import logging
import time

import msgspec

from services.worker.engine.config import EngineConfig
from services.worker.engine.executor.executor import UniprocExecutor
from services.worker.engine.messages import (
    EngineCoreOutput,
    EngineCoreOutputs,
    EngineCoreRequest,
    EngineCoreUtility,
    EngineStats,
    ModelInfo,
    UtilityResult,
)
from services.worker.engine.request import FinishReason, Request, RequestStatus
from services.worker.engine.sched.scheduler import Scheduler
from shared.ids import RequestId
from shared.kv_events import KVEventBatch

logger = logging.getLogger(__name__)

# Named calls a client may make on the core, with what each returns (decoded with this type).
UTILITY_METHODS: dict[str, type] = {
    "get_stats": EngineStats,
    "get_model_info": ModelInfo,
    "reset_prefix_cache": bool,
    "resync_kv_events": bool,
}


class EngineCore:
    def __init__(self, config: EngineConfig, show_progress: bool = True):
        self.config = config
        self.executor = UniprocExecutor(config, show_progress)
        self.num_blocks = self.executor.determine_num_blocks()
        self.executor.initialize_cache(self.num_blocks)
        self.scheduler = Scheduler(config.scheduler, config.cache, self.num_blocks)
        self._rejected: list[EngineCoreOutput] = []
        self._kv_event_seq = 0
        self._model_seconds = 0.0
        logger.info(
            "engine core ready: %d KV blocks of %d tokens", self.num_blocks, config.cache.block_size
        )

    def step(self) -> EngineCoreOutputs:
        outputs, self._rejected = self._rejected, []
        if self.scheduler.has_requests():
            scheduler_output = self.scheduler.schedule()
            start = time.perf_counter()
            model_output = self.executor.execute_model(scheduler_output)
            self._model_seconds += time.perf_counter() - start
            outputs += self.scheduler.update_from_output(scheduler_output, model_output)
        return EngineCoreOutputs(outputs=outputs, kv_events=self._take_kv_events())

    def add_request(self, req: EngineCoreRequest) -> None:
        try:
            self.scheduler.add_request(self._make_request(req))
        except ValueError as e:
            self._rejected.append(
                EngineCoreOutput(req.request_id, [], finish_reason=FinishReason.ERROR, error=str(e))
            )

    def abort_requests(self, request_ids: list[str]) -> None:
        self.scheduler.finish_requests(request_ids, RequestStatus.FINISHED_ABORTED)

    def has_work(self) -> bool:
        return self.scheduler.has_requests() or bool(self._rejected)

    def call_utility(self, call: EngineCoreUtility) -> UtilityResult:
        if call.method == "get_stats":
            stats = self.scheduler.stats()
            result: object = msgspec.structs.replace(stats, model_seconds=self._model_seconds)
        elif call.method == "get_model_info":
            result = self.executor.model_info()
        elif call.method == "reset_prefix_cache":
            result = self.scheduler.kv.reset_prefix_cache()
        elif call.method == "resync_kv_events":
            self.scheduler.kv.pool.announce_all()
            result = True
        else:
            known = ", ".join(sorted(UTILITY_METHODS))
            return UtilityResult(
                call.call_id, error=f"unknown method {call.method!r}; known: {known}"
            )
        return UtilityResult(call.call_id, result=msgspec.Raw(msgspec.msgpack.encode(result)))

    def shutdown(self) -> None:
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
        return Request(
            RequestId(req.request_id),
            list(prompt),
            req.sampling_params,
            cfg.arch.eos_token_ids,
            self.config.cache.block_size,
            cfg.max_model_len,
            req.cache_salt,
        )

    def _take_kv_events(self) -> KVEventBatch | None:
        events = self.scheduler.take_kv_events()
        if not events:
            return None
        self._kv_event_seq += 1
        return KVEventBatch(seq=self._kv_event_seq, events=events)
