"""What the gateway knows about the cluster: for each served model its tokenizer (loaded here,
torch-free) and, from the global scheduler's live worker list, its context length and block
size. The list is refreshed by a background task (``refresh_forever``) and on demand when a
model has no entry, so a request normally never waits for it."""

import asyncio
import logging
import time
from dataclasses import dataclass

import grpc

from shared.protos.baton.v1 import scheduler_pb2, scheduler_pb2_grpc
from shared.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    block_size: int
    num_workers: int
    vocab_size: int = 0  # the smallest its workers report (0: none reported)


class ModelCatalog:
    def __init__(
        self,
        tokenizers: dict[str, TextTokenizer],
        scheduler: scheduler_pb2_grpc.GlobalSchedulerStub,
        refresh_s: float = 1.0,
    ):
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.refresh_s = refresh_s
        self._limits: dict[str, ModelLimits] = {}
        self._fetched_at = 0.0
        self._lock = asyncio.Lock()

    @property
    def served(self) -> list[str]:
        return sorted(self.tokenizers)

    async def limits(self, model: str) -> ModelLimits | None:
        """The model's limits from live workers; None when no worker serves it."""
        if model not in self._limits:
            await self.refresh()
        return self._limits.get(model)

    async def refresh_forever(self) -> None:
        while True:
            await self.refresh()
            await asyncio.sleep(self.refresh_s)

    async def refresh(self) -> None:
        async with self._lock:
            if time.monotonic() - self._fetched_at < 0.05:
                return  # another request just refreshed
            try:
                resp = await self.scheduler.ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=2.0
                )
            except grpc.aio.AioRpcError as e:
                logger.warning("cannot list workers: %s", e.code().name)
                return
            limits: dict[str, ModelLimits] = {}
            for w in resp.workers:
                reg = w.registration
                old = limits.get(reg.model)
                max_len = min(reg.max_model_len, old.max_model_len) if old else reg.max_model_len
                count = old.num_workers + 1 if old else 1
                vocabs = [v for v in (reg.vocab_size, old.vocab_size if old else 0) if v]
                vocab = min(vocabs, default=0)
                limits[reg.model] = ModelLimits(max_len, reg.block_size, count, vocab)
            self._limits, self._fetched_at = limits, time.monotonic()
