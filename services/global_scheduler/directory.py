"""The prefix directory: which live worker holds which KV blocks, fed by the engines' KV events.

    apply(worker, incarnation, batch)      events of one engine step, in order
    longest_prefix(hashes, live)           → {worker: number of leading blocks it holds}
    forget(worker, incarnation)            that incarnation is gone: its entries stop counting

``live`` maps each candidate worker to its current incarnation: entries of any other
incarnation (a dead or restarted process) never count, whatever a backend still stores. Blocks
count only as a prefix from block 0, as the engine's own lookup does: a worker that holds
blocks 0, 1 and 3 matches 2.

Backends (a registry keyed by name, imported lazily): ``memory`` (embedded, the default) and
``redis`` (``redis_directory.py``, shared by scheduler replicas). Both pass
``tests/unit/test_directory.py``. A backend raises ``DirectoryUnavailable`` when it cannot
answer; ``resilient.ResilientDirectory`` turns that into routing on load alone.
"""

import importlib
import logging
from typing import Any, Protocol

from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)


class DirectoryUnavailable(RuntimeError):
    """The backend cannot be reached (Redis down); the caller routes without it."""


class PrefixDirectory(Protocol):
    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None: ...

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, int]: ...

    async def forget(self, worker: WorkerId, incarnation: str) -> None: ...

    async def num_blocks(self, worker: WorkerId, incarnation: str) -> int: ...

    async def ping(self) -> None:
        """Raise ``DirectoryUnavailable`` unless the backend answers."""

    async def close(self) -> None: ...


BACKENDS = {
    "memory": "services.global_scheduler.directory:InMemoryDirectory",
    "redis": "services.global_scheduler.redis_directory:RedisDirectory",
}


def create_directory(name: str, **kwargs: Any) -> PrefixDirectory:
    if name not in BACKENDS:
        raise ValueError(f"unknown directory backend {name!r}; known: {', '.join(BACKENDS)}")
    module, cls = BACKENDS[name].split(":")
    directory: PrefixDirectory = getattr(importlib.import_module(module), cls)(**kwargs)
    return directory


class InMemoryDirectory:
    """Everything in this process: a hash → {(worker, incarnation)} index."""

    def __init__(self) -> None:
        self._holders: dict[BlockHash, set[tuple[WorkerId, str]]] = {}
        self._held: dict[tuple[WorkerId, str], set[BlockHash]] = {}
        self._seq: dict[tuple[WorkerId, str], int] = {}

    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None:
        key = (worker, incarnation)
        last = self._seq.get(key)
        if last is not None and batch.seq <= last:
            return  # already applied (a replayed batch)
        if last is not None and batch.seq != last + 1:
            logger.warning("worker %s: KV events %d..%d lost", worker, last + 1, batch.seq - 1)
        self._seq[key] = batch.seq
        held = self._held.setdefault(key, set())
        for event in batch.events:
            if isinstance(event, BlockStored):
                for h in event.block_hashes:
                    held.add(h)
                    self._holders.setdefault(h, set()).add(key)
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.discard(h)
                    self._unhold(h, key)
            elif isinstance(event, AllBlocksCleared):
                for h in held:
                    self._unhold(h, key)
                held.clear()

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, int]:
        matched = dict.fromkeys(live, 0)
        alive = set(live.items())
        for h in hashes:
            alive &= self._holders.get(h, set())
            if not alive:
                break
            for w, _ in alive:
                matched[w] += 1
        return matched

    async def forget(self, worker: WorkerId, incarnation: str) -> None:
        key = (worker, incarnation)
        for h in self._held.pop(key, set()):
            self._unhold(h, key)
        self._seq.pop(key, None)

    async def num_blocks(self, worker: WorkerId, incarnation: str) -> int:
        return len(self._held.get((worker, incarnation), ()))

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _unhold(self, h: BlockHash, key: tuple[WorkerId, str]) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[h]
