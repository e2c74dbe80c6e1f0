"""``KVCacheManager``: per-request block tables on top of the block pool — prefix lookup,
allocation for the tokens a step will compute, and freeing. Pure bookkeeping.

What a request's blocks cover when the scheduler asks for room:

    | already computed | prefix hits (new_computed) | tokens this step (num_new) | (unused) |
    0        num_computed_tokens          + hits * block_size           + num_new
    └───── existing blocks ─────┘└─ touched ─┘└──────── fresh blocks from the pool ────────┘

Blocks whose tokens are all known by the end of the step are indexed by hash at allocation
time, so a request admitted later in the same step can already share them.
"""

from dataclasses import dataclass, field

from services.worker.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from services.worker.engine.request import Request
from shared.ids import RequestId
from shared.kv_events import KVEvent


@dataclass
class KVCacheBlocks:
    """An allocation result, opaque to the scheduler except for its block ids."""

    blocks: list[KVCacheBlock] = field(default_factory=list)

    def block_ids(self) -> list[int]:
        return [b.block_id for b in self.blocks]

    def __len__(self) -> int:
        return len(self.blocks)


_NO_BLOCKS = KVCacheBlocks()  # never mutated: callers only read block_ids()


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool):
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.pool = BlockPool(num_blocks, block_size, enable_caching)
        self._blocks: dict[RequestId, list[KVCacheBlock]] = {}
        self._num_indexed: dict[RequestId, int] = {}  # leading blocks already in the index

    @property
    def usage(self) -> float:
        return self.pool.usage

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    def get_computed_blocks(self, request: Request) -> tuple[KVCacheBlocks, int]:
        """Longest cached prefix of ``request`` as (blocks, tokens). The last prompt token is
        never a hit: its logits are needed to sample the first output token. A request that asks
        for its prompt's logprobs gets no hit at all (as in vLLM): a cached block holds keys and
        values, not the logits its positions need; the blocks it computes are cached for others.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return KVCacheBlocks(), 0
        hits: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[: (request.num_tokens - 1) // self.block_size]:
            block = self.pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return KVCacheBlocks(hits), len(hits) * self.block_size

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: KVCacheBlocks | None = None,
        index: bool = True,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens (after any prefix hits). Returns the fresh
        blocks, or None — changing nothing — when the pool cannot supply them.

        ``index=False`` leaves the new full blocks out of the prefix index: their content arrives
        later (a KV pull), and no other request may hit them before ``index_blocks``.
        """
        hits = new_computed.blocks if new_computed else []
        held = self._blocks.setdefault(request.request_id, [])
        total = request.num_computed_tokens + len(hits) * self.block_size + num_new_tokens
        if not hits and total <= len(held) * self.block_size and total % self.block_size:
            return _NO_BLOCKS  # decode inside a partly filled block: nothing to do (hot path)
        needed = max(0, -(-total // self.block_size) - len(held) - len(hits))
        hits_in_free_queue = sum(1 for b in hits if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - hits_in_free_queue:
            if not held:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(hits)
        held.extend(hits)
        fresh = self.pool.get_new_blocks(needed)
        held.extend(fresh)
        if index:
            self._index_full_blocks(request, held, total)
        return KVCacheBlocks(fresh)

    def index_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the full blocks among the first ``num_tokens`` (their content is now valid)."""
        self._index_full_blocks(request, self._blocks.get(request.request_id, []), num_tokens)

    def _index_full_blocks(self, request: Request, held: list[KVCacheBlock], total: int) -> None:
        if not self.enable_caching:
            return
        start = self._num_indexed.get(request.request_id, 0)
        end = min(total // self.block_size, len(request.block_hashes))
        self.pool.cache_full_blocks(held, request.block_hashes, start, end)
        self._num_indexed[request.request_id] = max(start, end)

    def free(self, request: Request) -> None:
        """Release every block of ``request``; its tail blocks become the first to be evicted."""
        blocks = self._blocks.pop(request.request_id, [])
        self._num_indexed.pop(request.request_id, None)
        self.pool.free_blocks(reversed(blocks))

    def get_block_ids(self, request_id: RequestId) -> list[int]:
        return [b.block_id for b in self._blocks.get(request_id, [])]

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()
