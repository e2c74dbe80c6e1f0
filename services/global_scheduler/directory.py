"""The prefix directory: which live worker holds which KV blocks, fed by the engines' KV events,
and which blocks a worker is about to hold because a request was just routed to it.

    apply(worker, incarnation, batch)           events of one engine step, in order
    record_pending(holders, hashes, ttl_s)      a route's prompt blocks, expected on these workers
    longest_prefix(hashes, live)                → {worker: Match(confirmed, pending)}
    forget(worker, incarnation)                 that incarnation is gone: its entries stop counting

**Pending entries** close the gap between a route and the KV events that confirm it (events
ride on heartbeats, every 0.5 s): a request sent right after another one over the same prefix
must go where that prefix is about to be, not where the events last said. A pending entry
counts like a held block until a ``BlockStored`` of that worker confirms it (it becomes held),
a ``BlockRemoved`` or ``AllBlocksCleared`` drops it, its worker's incarnation is forgotten, or
``ttl_s`` passes without confirmation (the request failed, was aborted, or its blocks were
evicted at once).

    prompt blocks:   | 0 | 1 | 2 | 3 | 4 |
    worker A holds:    ■   ■               events said so          Match(confirmed=2, pending=3)
    A pending:         ·   ·   ·   ·   ·   a route just went there   (5 leading blocks in all)

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
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, Protocol

from shared.ids import BlockHash, WorkerId
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch

logger = logging.getLogger(__name__)


class DirectoryUnavailable(RuntimeError):
    """The backend cannot be reached (Redis down); the caller routes without it."""


@dataclass(frozen=True)
class Match:
    """A worker's leading blocks of a prompt: held (confirmed by its KV events), and how many
    more it is expected to hold (pending entries, past the confirmed ones)."""

    confirmed: int = 0
    pending: int = 0

    @property
    def blocks(self) -> int:
        """Leading blocks held or pending: what routing counts."""
        return self.confirmed + self.pending


def count_prefixes(
    live: dict[WorkerId, str], blocks: Iterable[tuple[set[str], set[str]]]
) -> dict[WorkerId, Match]:
    """The matches from each block's holders and pending holders ("{incarnation}:{worker}"
    members), in prompt order: a prefix ends at the first block a worker neither holds nor
    expects; its confirmed part ends at the first block it does not hold. ``blocks`` is read
    only up to the block where every worker's prefix has ended."""
    member = {f"{inc}:{w}": w for w, inc in live.items()}
    total = dict.fromkeys(live, 0)
    confirmed = dict.fromkeys(live, 0)
    either, held = set(member), set(member)
    for holders, pending in blocks:
        held &= holders
        either &= holders | pending
        if not either:
            break
        for m in either:
            total[member[m]] += 1
        for m in held:
            confirmed[member[m]] += 1
    return {w: Match(confirmed[w], total[w] - confirmed[w]) for w in live}


class PrefixDirectory(Protocol):
    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None: ...

    async def record_pending(
        self, holders: list[tuple[WorkerId, str]], hashes: list[BlockHash], ttl_s: float
    ) -> None: ...

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, Match]: ...

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
    """Everything in this process: hash → holders, hash → pending holders with their expiry."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self.clock = clock
        self._holders: dict[BlockHash, set[str]] = {}  # members "{incarnation}:{worker}"
        self._held: dict[str, set[BlockHash]] = {}
        self._seq: dict[str, int] = {}
        self._pending: dict[BlockHash, dict[str, float]] = {}  # hash → member → expiry
        self._pending_of: dict[str, set[BlockHash]] = {}
        self._expiries: deque[tuple[float, str, BlockHash]] = deque()  # in recording order

    async def apply(self, worker: WorkerId, incarnation: str, batch: KVEventBatch) -> None:
        key = f"{incarnation}:{worker}"
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
                    self._unpend(h, key)  # confirmed: held from now on
            elif isinstance(event, BlockRemoved):
                for h in event.block_hashes:
                    held.discard(h)
                    self._unhold(h, key)
                    self._unpend(h, key)
            elif isinstance(event, AllBlocksCleared):
                for h in held:
                    self._unhold(h, key)
                held.clear()
                for h in list(self._pending_of.get(key, ())):
                    self._unpend(h, key)

    async def record_pending(
        self, holders: list[tuple[WorkerId, str]], hashes: list[BlockHash], ttl_s: float
    ) -> None:
        self._expire()
        expiry = self.clock() + ttl_s
        for worker, incarnation in holders:
            key = f"{incarnation}:{worker}"
            for h in hashes:
                self._pending.setdefault(h, {})[key] = expiry
                self._pending_of.setdefault(key, set()).add(h)
                self._expiries.append((expiry, key, h))

    async def longest_prefix(
        self, hashes: list[BlockHash], live: dict[WorkerId, str]
    ) -> dict[WorkerId, Match]:
        self._expire()
        return count_prefixes(  # (a generator: past the longest prefix nothing is copied)
            live, ((self._holders.get(h, set()), set(self._pending.get(h, ()))) for h in hashes)
        )

    async def forget(self, worker: WorkerId, incarnation: str) -> None:
        key = f"{incarnation}:{worker}"
        for h in self._held.pop(key, set()):
            self._unhold(h, key)
        for h in list(self._pending_of.get(key, ())):
            self._unpend(h, key)
        self._seq.pop(key, None)

    async def num_blocks(self, worker: WorkerId, incarnation: str) -> int:
        return len(self._held.get(f"{incarnation}:{worker}", ()))

    async def ping(self) -> None:
        pass

    async def close(self) -> None:
        pass

    def _unhold(self, h: BlockHash, key: str) -> None:
        holders = self._holders.get(h)
        if holders is not None:
            holders.discard(key)
            if not holders:
                del self._holders[h]

    def _unpend(self, h: BlockHash, key: str) -> None:
        pending = self._pending.get(h)
        if pending is not None and pending.pop(key, None) is not None:
            if not pending:
                del self._pending[h]
            of = self._pending_of[key]
            of.discard(h)
            if not of:
                del self._pending_of[key]

    def _expire(self) -> None:
        """Drop the entries past their expiry, oldest first (a re-recorded entry keeps its
        later expiry: only an entry whose recorded expiry has passed goes)."""
        now = self.clock()
        while self._expiries and self._expiries[0][0] <= now:
            expiry, key, h = self._expiries.popleft()
            if self._pending.get(h, {}).get(key) == expiry:
                self._unpend(h, key)
