"""``AsyncLLM``: the engine for asyncio servers. The core runs in a background process
(``AsyncMPClient``); one owned output task routes its outputs to per-request queues.

    async for out in engine.generate(prompt, params, request_id):
        ...
    await engine.abort(request_id)

Leaving the ``async for`` early (break, cancellation, client disconnect) aborts the request in
the core, so its KV blocks are freed at once.
"""

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable

from services.worker.engine.config import EngineArgs, EngineConfig
from services.worker.engine.core_client import AsyncMPClient, EngineDeadError
from services.worker.engine.messages import EngineStats, ModelInfo
from services.worker.engine.output_processor import OutputProcessor, fan_out
from services.worker.engine.outputs import RequestOutput
from services.worker.engine.params import SamplingParams
from services.worker.engine.processor import InputProcessor, PromptType
from shared.kv_events import KVEventBatch
from shared.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


class AsyncLLM:
    def __init__(self, config: EngineConfig):
        self.config = config
        # torch-free, as the gateway's (engine/tokenizer.py): this process runs no model.
        # config.model.tokenizer: a checkpoint directory, or a GGUF file (its metadata)
        self.tokenizer = TextTokenizer(config.model.tokenizer)
        self.processor = InputProcessor(config.model, self.tokenizer)
        self.output_processor = OutputProcessor(self.tokenizer)
        self.client = AsyncMPClient(config)
        self._queues: dict[str, asyncio.Queue[RequestOutput | BaseException]] = {}
        self._output_task: asyncio.Task[None] | None = None
        self._dead: BaseException | None = None
        # Called with every KV-event batch, in the core's order (the worker service forwards
        # them to the global scheduler). Must not block: it runs on the output task.
        self.kv_event_listener: Callable[[KVEventBatch], None] | None = None
        # The core's stats as last seen (pushed with its steps, or a get_stats answer): what a
        # load report reads, never waiting on a step (see latest_stats).
        self._stats = self.client.core.ready_stats
        # How many of the core's messages showed it moved (outputs, or stats it pushed because
        # they changed): a count that stands still while the core has work means it is hung
        # (the worker's watchdog reads it).
        self.progress = 0

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> "AsyncLLM":
        return cls(args.create_engine_config())

    async def generate(
        self, prompt: PromptType, params: SamplingParams, request_id: str
    ) -> AsyncIterator[RequestOutput]:
        """Stream outputs for one request. Raises ValueError for bad input, EngineDeadError
        if the core dies."""
        if self._dead is not None:
            raise EngineDeadError(str(self._dead))
        self._ensure_output_task()
        text, request = self.processor.process(request_id, prompt, params)
        core_requests = fan_out(request)
        self.output_processor.add_request(text, request, core_requests)
        queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()
        self._queues[request_id] = queue
        finished = False
        try:
            for r in core_requests:
                await self.client.add_request_async(r)
            while not finished:
                item = await queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            self._queues.pop(request_id, None)
            if not finished:
                await self._abort_quietly(request_id)

    async def abort(self, request_id: str) -> None:
        """Abort a request; an id this frontend no longer tracks still goes to the core, which
        ends a prefill leg's KV lease under that id."""
        core_ids = self.output_processor.abort(request_id) or [request_id]
        await self.client.abort_requests_async(core_ids)
        queue = self._queues.get(request_id)
        if queue is not None:
            queue.put_nowait(asyncio.CancelledError(f"request {request_id} aborted"))

    async def get_stats(self) -> EngineStats:
        """Exact, but answered between steps only: waits for a step in progress to end."""
        self._ensure_output_task()
        stats: EngineStats = await self.client.call_utility_async("get_stats")
        self._stats = stats
        return stats

    @property
    def latest_stats(self) -> EngineStats:
        """The stats as the core last pushed them, at once: at most ``STATS_PUSH_S`` old
        while steps run, exact while it is idle, and as the last step left them while it is
        in one long step."""
        self._ensure_output_task()
        if self._stats is None:
            raise EngineDeadError("the engine core sent no stats")  # (it sends them when ready)
        return self._stats

    async def get_model_info(self) -> ModelInfo:
        self._ensure_output_task()
        info: ModelInfo = await self.client.call_utility_async("get_model_info")
        return info

    async def reset_prefix_cache(self) -> bool:
        self._ensure_output_task()
        return bool(await self.client.call_utility_async("reset_prefix_cache"))

    async def resync_kv_events(self) -> None:
        """Have the core re-announce its whole prefix index (all-cleared, then every cached
        block) in its next KV-event batch, for a directory that has lost track."""
        self._ensure_output_task()
        await self.client.call_utility_async("resync_kv_events")

    @property
    def model_name(self) -> str:
        return self.config.model.served_model_name

    @property
    def dead(self) -> bool:
        return self._dead is not None

    @property
    def num_in_flight(self) -> int:
        """Requests given to the core whose end this front has not seen yet (work the core has
        even when its last pushed stats, from before they came, say it is idle)."""
        return len(self._queues)

    def shutdown(self, kill: bool = False) -> None:
        """Stop the core: asked to, or with ``kill`` at once (SIGKILL: a hung core, even a
        stopped one)."""
        if self._output_task is not None:
            self._output_task.cancel()
        if kill:
            self.client.core.proc.kill()
        self.client.shutdown()

    async def _abort_quietly(self, request_id: str) -> None:
        core_ids = self.output_processor.abort(request_id)
        if core_ids and self._dead is None:
            with contextlib.suppress(EngineDeadError):
                await self.client.abort_requests_async(core_ids)

    def _ensure_output_task(self) -> None:
        if self._output_task is None or self._output_task.done():
            self._output_task = asyncio.get_running_loop().create_task(
                self._run_output_handler(), name="baton-engine-outputs"
            )

    async def _run_output_handler(self) -> None:
        """The one reader of the core's output socket."""
        try:
            while True:
                outs = await self.client.get_output_async()
                if outs.stats is not None:
                    self._stats = outs.stats
                if outs.outputs or outs.stats is not None:
                    self.progress += 1
                if outs.kv_events is not None and self.kv_event_listener is not None:
                    self.kv_event_listener(outs.kv_events)
                result = self.output_processor.process_outputs(outs.outputs)
                for out in result.request_outputs:
                    queue = self._queues.get(out.request_id)
                    if queue is not None:
                        queue.put_nowait(out)
                await self.client.abort_requests_async(result.reqs_to_abort)
        except asyncio.CancelledError:
            raise
        except BaseException as e:  # the core died: fail every request in flight
            logger.error("engine output handler stopped: %s", e)
            self._dead = e
            for queue in self._queues.values():
                queue.put_nowait(e if isinstance(e, EngineDeadError) else EngineDeadError(str(e)))
