"""The block pool: every KV block, its reference count, the LRU free queue, and the
(group, hash) → block index that makes prefix caching work. Pure bookkeeping: ints and lists.

A block is in exactly one of three situations:
    in use       ref_cnt > 0                 (held by one or more requests)
    free+cached  ref_cnt == 0, has a hash    (in the free queue, still findable by hash)
    free         ref_cnt == 0, no hash       (in the free queue)
Allocation pops the head of the free queue (the least recently freed), evicting its hash if it
has one; freed blocks go to the tail. A prefix hit on a free+cached block takes it out of the
queue ("touch"). Every change to the index is recorded as a KV event for the prefix directory.

KV cache groups (``groups.py``) share the pool's blocks, each with an index of its own: one
token prefix has a block per group, each holding that group's layers, under the same hash. The
prefix directory routes on group 0 alone (full attention: ``KVCacheGroups.plan`` puts it
first), so only group 0's index changes become events, and ``num_cached_blocks`` counts it
alone (the directory's count of this worker's blocks must match it). With recurrent groups it
promises more than a hit gives (a hit there also needs a checkpoint at its end), but not more
than the worker soon holds: the first request sent there for a prefix cached in group 0 stops
a step at its end and leaves the checkpoint (``KVCacheManager.checkpoint_aligned``).

Not thread-safe: the engine core owns it and calls it from its one loop.
"""

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from shared.ids import BlockHash
from shared.kv_events import AllBlocksCleared, BlockRemoved, BlockStored, KVEvent


@dataclass(eq=False)
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None  # set while the block is in the prefix index
    group: int = 0  # whose index holds it (with block_hash, its key there): eviction's entry


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool, num_groups: int = 1):
        if num_blocks < 1:
            raise ValueError("the KV cache needs at least one block")
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict(
            (b.block_id, b) for b in self.blocks
        )
        self._cached: list[dict[BlockHash, KVCacheBlock]] = [{} for _ in range(num_groups)]
        self._events: list[KVEvent] = []

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    @property
    def num_cached_blocks(self) -> int:
        """Group 0's indexed blocks: what the prefix directory knows of."""
        return len(self._cached[0])

    def get_cached_block(self, block_hash: BlockHash, group: int = 0) -> KVCacheBlock | None:
        return self._cached[group].get(block_hash) if self.enable_caching else None

    def get_new_blocks(self, n: int) -> list[KVCacheBlock]:
        """Take ``n`` blocks from the head of the free queue; the caller owns one ref to each."""
        if n > len(self._free):
            raise ValueError(f"asked for {n} blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, block = self._free.popitem(last=False)
            self._evict(block)
            block.ref_cnt = 1
            out.append(block)
        return out

    def touch(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Add a reference to each (prefix hits); free+cached blocks leave the free queue."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def free_blocks(self, blocks: Iterable[KVCacheBlock]) -> None:
        """Drop one reference from each; blocks reaching zero join the free queue's tail in the
        given order, so pass them in the order they should be evicted (tail of a sequence first).
        """
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"double free of block {block.block_id}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block

    def cache_full_blocks(
        self,
        blocks: Sequence[KVCacheBlock | None],
        hashes: Sequence[BlockHash],
        start: int,
        end: int,
        group: int = 0,
    ) -> None:
        """Index ``blocks[start:end]`` under ``hashes[start:end]`` (full blocks of one request)
        in ``group``'s index. None entries (a windowed group's blocks behind its window) are
        skipped: there is nothing to index.

        A hash already indexed by another block (two requests computed the same prefix at once)
        leaves this block unindexed; it is freed as a plain block later.
        """
        if not self.enable_caching or start >= end:
            return
        index = self._cached[group]
        stored: list[KVEvent] = []
        run: list[BlockHash] = []
        parent = hashes[start - 1] if start > 0 else None
        for i in range(start, end):
            block, block_hash = blocks[i], hashes[i]
            if block is not None and block.block_hash is None and block_hash not in index:
                block.block_hash, block.group = block_hash, group
                index[block_hash] = block
                run.append(block_hash)
                continue
            if run:
                stored.append(BlockStored(run, parent, self.block_size))
                run = []
            parent = block_hash
        if run:
            stored.append(BlockStored(run, parent, self.block_size))
        if group == 0:
            self._events += stored

    def reset_prefix_cache(self) -> bool:
        """Forget every hash. Only allowed when no request holds a block; returns success."""
        if self.num_free_blocks != self.num_blocks:
            return False
        for block in self.blocks:
            block.block_hash, block.group = None, 0
        for index in self._cached:
            index.clear()
        if self.enable_caching:
            self._events.append(AllBlocksCleared())
        return True

    def announce_all(self) -> None:
        """Queue AllBlocksCleared and then every hash of group 0's index, so a consumer that
        lost track (a restarted directory) converges to the exact index by applying events in
        order."""
        if not self.enable_caching:
            return
        self._events.append(AllBlocksCleared())
        if self._cached[0]:
            self._events.append(BlockStored(list(self._cached[0]), None, self.block_size))

    def take_events(self) -> list[KVEvent]:
        events, self._events = self._events, []
        return events

    def _evict(self, block: KVCacheBlock) -> None:
        if block.block_hash is None:
            return
        index = self._cached[block.group]
        if index.get(block.block_hash) is block:
            del index[block.block_hash]
            if block.group == 0:
                self._events.append(BlockRemoved([block.block_hash]))
        block.block_hash, block.group = None, 0
