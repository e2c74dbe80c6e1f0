"""What the gateway knows about the cluster: for each served model its tokenizer (loaded here,
torch-free) and, from the global scheduler's live worker list, its context length and block
size. The list is refreshed by a background task (``refresh_forever``) and on demand when a
model has no entry, so a request normally never waits for it."""

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc

from shared.protos.baton.v1 import common_pb2, scheduler_pb2, scheduler_pb2_grpc
from shared.rpc import auth
from shared.text.tokenizer import TextTokenizer

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    block_size: int
    num_workers: int
    vocab_size: int = 0  # the smallest its workers report (0: none reported)
    quantization: str = ""  # what its workers say they serve ("a, b" when they differ)
    kv_cache_dtype: str = ""
    num_decode_workers: int = 0  # of role decode or both: where a decode leg can run


class ModelCatalog:
    def __init__(
        self,
        tokenizers: dict[str, TextTokenizer],
        scheduler: scheduler_pb2_grpc.GlobalSchedulerStub,
        refresh_s: float = 1.0,
        clock: Callable[[], float] = time.monotonic,
    ):
        self.tokenizers = tokenizers
        self.scheduler = scheduler
        self.refresh_s = refresh_s
        self.clock = clock
        self._limits: dict[str, ModelLimits] = {}
        self._fetched_at = -1e9  # when the scheduler last answered (by clock)
        self._lock = asyncio.Lock()

    def ready(self, model: str) -> bool:
        """The scheduler answered within the last ``3 × refresh_s`` and named a live worker of
        ``model``: what ``/ready`` reports. A list older than that is stale, whatever it says
        (the scheduler is down, so every request would fail)."""
        fresh = self.clock() - self._fetched_at <= 3 * self.refresh_s
        return fresh and model in self._limits

    async def readiness(self) -> dict[str, bool]:
        """``ready`` for every served model, from a list fetched now when the one held says
        some model is not ready: a worker that registered since the last refresh (after a
        scheduler restart, say) makes ``/ready`` true at once, not a refresh period later."""
        models = {m: self.ready(m) for m in self.served}
        if not all(models.values()):
            await self.refresh()
            models = {m: self.ready(m) for m in self.served}
        return models

    @property
    def served(self) -> list[str]:
        return sorted(self.tokenizers)

    def card(self, model: str) -> dict[str, Any] | None:
        """OpenAI's Model object for a served model (``GET /v1/models`` lists them, ``GET
        /v1/models/{id}`` returns one), with what its live workers serve as vLLM reports it;
        None when this gateway does not serve ``model``."""
        if model not in self.tokenizers:
            return None
        card: dict[str, Any] = {"id": model, "object": "model", "created": 0, "owned_by": "baton"}
        known = self._limits.get(model)
        if known is not None:
            card.update(max_model_len=known.max_model_len, quantization=known.quantization
                        or None, kv_cache_dtype=known.kv_cache_dtype or None)  # fmt: skip
        return card

    def known(self, model: str) -> ModelLimits | None:
        """The model's entry from the last worker list, without refreshing it."""
        return self._limits.get(model)

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
            if self.clock() - self._fetched_at < 0.05:
                return  # another request just refreshed
            try:
                resp = await self.scheduler.ListWorkers(
                    scheduler_pb2.ListWorkersRequest(), timeout=2.0, metadata=auth()
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
                quant = _joined(old.quantization if old else None, reg.quantization)
                kv = _joined(old.kv_cache_dtype if old else None, reg.kv_cache_dtype)
                decoders = (old.num_decode_workers if old else 0) + (
                    reg.role != common_pb2.WORKER_ROLE_PREFILL
                )
                limits[reg.model] = ModelLimits(max_len, reg.block_size, count, vocab, quant, kv,
                                                decoders)  # fmt: skip
            self._limits, self._fetched_at = limits, self.clock()


def _joined(seen: str | None, new: str) -> str:
    """Workers' values of one field: one value, or the distinct ones joined (a mixed pool)."""
    if seen is None or seen == new:
        return new
    values = sorted(set(seen.split(", ")) | {new})
    return ", ".join(v for v in values if v)
