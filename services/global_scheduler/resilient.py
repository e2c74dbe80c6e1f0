"""``ResilientDirectory``: a directory whose backend may go away (Redis) without failing a
single request. When a call raises ``DirectoryUnavailable`` it goes *degraded*:

- lookups answer "no worker holds anything", so routing runs on load alone;
- KV events and pending entries are dropped (nothing to apply them to), so the picture would
  be stale later;
- a metric (``baton_scheduler_directory_degraded``) says so and one log line is written;
- a probe pings the backend every ``probe_interval_s``; when it answers, the directory is
  healthy again and ``on_recover`` runs: the server asks every worker to re-announce its
  blocks, so the directory converges to the exact picture again.
"""

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import TypeVar

from services.global_scheduler import metrics
from services.global_scheduler.directory import DirectoryUnavailable, Match, PrefixDirectory
from shared.ids import BlockHash, WorkerId
from shared.kv_events import KVEventBatch

logger = logging.getLogger(__name__)
T = TypeVar("T")


class ResilientDirectory:
    def __init__(self, inner: PrefixDirectory, probe_interval_s: float = 0.5):
        self.inner = inner
        self.probe_interval_s = probe_interval_s
        self.degraded = False
        self.on_recover: Callable[[], None] = lambda: None
        metrics.DIRECTORY_DEGRADED.set(0)

    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None:
        await self._guarded(lambda: self.inner.apply(worker, incarnation, batch), None)

    async def record_pending(
        self, holders: list[tuple[WorkerId, str]], hashes: list[BlockHash], ttl_s: float
    ) -> None:
        await self._guarded(lambda: self.inner.record_pending(holders, hashes, ttl_s), None)

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, Match]:
        no_hits = dict.fromkeys(live, Match())
        return await self._guarded(lambda: self.inner.longest_prefix(hashes, live), no_hits)

    async def forget(self, worker: WorkerId, incarnation: str) -> None:
        # (while degraded its entries stay: they never count again, being of no live worker)
        await self._guarded(lambda: self.inner.forget(worker, incarnation), None)

    async def num_blocks(self, worker: WorkerId, incarnation: str) -> int:
        return await self._guarded(lambda: self.inner.num_blocks(worker, incarnation), 0)

    async def _guarded(self, call: Callable[[], Awaitable[T]], fallback: T) -> T:
        """``call()`` unless degraded; its failure degrades the directory. Either way the
        caller gets ``fallback`` instead of an error."""
        if not self.degraded:
            try:
                return await call()
            except DirectoryUnavailable as e:
                self._degrade(e)
        return fallback

    async def ping(self) -> None:
        await self.inner.ping()

    async def close(self) -> None:
        await self.inner.close()

    async def probe_forever(self) -> None:
        while True:
            await asyncio.sleep(self.probe_interval_s)
            if not self.degraded:
                continue
            try:
                await self.inner.ping()
            except DirectoryUnavailable:
                continue
            self.degraded = False
            metrics.DIRECTORY_DEGRADED.set(0)
            logger.warning("prefix directory is back: cache-aware routing again; resyncing")
            self.on_recover()

    def _degrade(self, e: Exception) -> None:
        if not self.degraded:
            self.degraded = True
            metrics.DIRECTORY_DEGRADED.set(1)
            logger.error("prefix directory unreachable (%s): routing on load alone", e)
