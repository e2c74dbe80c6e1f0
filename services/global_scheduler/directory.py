"""The prefix directory: which live worker holds which KV blocks, fed by the engines' KV events.

    apply(worker, incarnation, batch)    events of one engine step, in order
    longest_prefix(hashes, workers)      → {worker: number of leading blocks it holds}
    forget(worker)                       the worker is gone: its entries stop counting at once

The interface is async so a networked backend (Redis, the next issue) fits behind it; this
in-memory one is the embedded default. Blocks count only as a prefix from block 0, as the
engine's own lookup does: a worker that holds blocks 0, 1 and 3 matches 2.
"""

import logging
from typing import Protocol

from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)


class PrefixDirectory(Protocol):
    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None: ...

    async def longest_prefix(
        self, hashes: list[BlockHash], workers: list[WorkerId]
    ) -> dict[WorkerId, int]: ...

    async def forget(self, worker: WorkerId) -> None: ...

    async def num_blocks(self, worker: WorkerId) -> int: ...


class InMemoryDirectory:
    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[WorkerId]] = {}
        self._held: dict[WorkerId, set[BlockHash]] = {}
        self._seq: dict[WorkerId, tuple[str, int]] = {}  # worker → (incarnation, last seq)

    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None:
        last = self._seq.get(worker)
        if last is not None and last[0] == incarnation:
            if batch.seq <= last[1]:
                return  # already applied
            if batch.seq != last[1] + 1:
                logger.warning("worker %s: KV events %d..%d lost", worker, last[1] + 1, batch.seq)
        elif last is not None:
            self._drop(worker)  # a new incarnation: the old one's blocks are gone
        self._seq[worker] = (incarnation, batch.seq)
        held = self._held.setdefault(worker, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    held.add(h)
                    self._holders.setdefault(h, set()).add(worker)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.discard(h)
                    self._unhold(h, worker)
            elif isinstance(event, AllBlocksCleared):
                self._drop(worker)
                held = self._held.setdefault(worker, set())

    async def longest_prefix(
        self, hashes: list[BlockHash], workers: list[WorkerId]
    ) -> dict[WorkerId, int]:
        matched = dict.fromkeys(workers, 0)
        alive = set(workers)
        for h in hashes:
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for w in alive:
                matched[w] += 1
        return matched

    async def forget(self, worker: WorkerId) -> None:
        self._drop(worker)
        self._seq.pop(worker, None)

    async def num_blocks(self, worker: WorkerId) -> int:
        return len(self._held.get(worker, ()))

    def _drop(self, worker: WorkerId) -> None:
        for h in self._held.pop(worker, set()):
            self._unhold(h, worker)

    def _unhold(self, h: BlockHash, worker: WorkerId) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(worker)
            if not holders:
                del self._holders[h]
