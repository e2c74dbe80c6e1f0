"""``KVCacheManager``: per-request block tables on top of the block pool — prefix lookup,
allocation for the tokens a step will compute, and freeing. Pure bookkeeping.

What a request's blocks cover when the scheduler asks for room:

    | computed | prefix hits (new_computed) | external (num_external) | this step (num_new) |
    0   num_computed_tokens   + hits * block_size      + num_external = c       + num_new = total
    └ existing ┘└──────── touched ─────────┘└──────────── fresh blocks from the pool ───────────┘

``c`` is the first position the engine computes itself: external tokens are filled from
outside (a KV pull) and precede it. Blocks whose tokens are all known by the end of the step
are indexed by hash at allocation time, so a request admitted later in the same step can
already share them.

KV cache groups (``groups.py``): a request has one block table per group, all as long, drawn
from one shared pool. A full-attention group holds a block for every position. A group with a
window W holds only what a computation from ``c`` can read, positions from c - W + 1 on:
before each allocation the blocks wholly behind that are released (their entries become None,
sent to the worker as ``null_block_id``), so a decoding request holds a bounded number of a
windowed group's blocks (``KVCacheGroup.blocks_needed``) however long it runs. The worker is
not told of a release: its stale id sits behind the window, where no kernel reads unmasked.
A prefix hit must satisfy every group at once (as vLLM's hybrid coordinator): full groups need
every block of the prefix cached, windowed groups the blocks of the window before its end.

A recurrent group (a Gated DeltaNet layer's fixed-size state, ``groups.py``) keeps its state in
the page of the block of the last computed token: a step from ``c`` to ``total`` reads the page
at block (c - 1) // bs and writes the one at (total - 1) // bs, a fresh page when that is a new
block (the entries between are None: no state is kept there). Its bookkeeping is otherwise a
window of 2's: the page behind the one a step reads is released. A page a step began on at a
block boundary holds the state there, a checkpoint: it is indexed under that block's hash when
the next step starts (not when the step that writes it is scheduled: a request admitted in the
same step would read it before it is written) or when the request is freed. A prefix hit then
needs a checkpoint at its last block, and the attention groups' blocks before it. Prefill
steps stop at block boundaries so that checkpoints are left where later requests can use them
(``checkpoint_aligned``): at a prompt's last boundary, and where a prefix shared with cached
blocks ends.
"""

from dataclasses import dataclass, field

from services.worker.engine.kv_cache.block_pool import BlockPool, KVCacheBlock
from services.worker.engine.kv_cache.groups import RECURRENT, KVCacheGroups
from services.worker.engine.request import Request
from shared.ids import BlockHash, RequestId
from shared.kv_events import KVEvent

BlockIds = tuple[list[int], ...]  # one block table per KV cache group, in group order

_Table = list[KVCacheBlock | None]  # None: a position this group holds no block for


@dataclass
class KVCacheBlocks:
    """An allocation result, opaque to the scheduler except for its block ids: a list per KV
    cache group, all as long. None (behind a window) becomes ``null_block_id``, the id of the
    spare block the model runner keeps past the pool."""

    blocks: tuple[_Table, ...]
    null_block_id: int
    # (computed once: the manager's shared empty result is read for every decode row a step)
    _ids: BlockIds | None = field(default=None, repr=False, compare=False)

    def block_ids(self) -> BlockIds:
        """The ids, per group; shared with every caller, who must not change them."""
        if self._ids is None:
            null = self.null_block_id
            self._ids = tuple([null if b is None else b.block_id for b in t] for t in self.blocks)
        return self._ids

    def __len__(self) -> int:
        return len(self.blocks[0])


@dataclass(slots=True)
class _Held:
    """One request's block tables, one per group, all as long."""

    tables: tuple[_Table, ...]
    start: list[int]  # per group: its entries before this index are None (behind the window)
    num_indexed: int = 0  # leading blocks already offered to the prefix index


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool,
        groups: KVCacheGroups | None = None,
    ):
        """``groups=None``: one full-attention group, the cache of a model without windows
        (only the groups' windows matter here, not their layers)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._groups = groups if groups is not None else KVCacheGroups.plan([None])
        # a recurrent group reads the page of the token before the first it computes: what a
        # window of 2 holds (its own rules: the fresh pages, the checkpoints)
        self._windows = tuple(2 if k == RECURRENT else w
                              for k, w in zip(self._groups.kinds, self._groups.windows,
                                              strict=True))  # fmt: skip
        self._windowed = tuple((g, w) for g, w in enumerate(self._windows) if w is not None)
        self._recurrent = tuple(g for g, k in enumerate(self._groups.kinds) if k == RECURRENT)
        self.pool = BlockPool(num_blocks, block_size, enable_caching, len(self._windows))
        self._null_block_id = num_blocks
        self._no_blocks = self._empty()  # never mutated: callers only read block_ids()
        self._held: dict[RequestId, _Held] = {}

    @property
    def groups(self) -> KVCacheGroups:
        return self._groups

    @property
    def null_block_id(self) -> int:
        return self._null_block_id

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

        The hit is the longest whole-block prefix every group agrees on. A full group's valid
        lengths are those up to its first uncached block; a windowed group's are those whose
        last window is cached, which is not monotone (a later window may survive an earlier
        one's eviction), so the windowed groups are asked in turn until none shortens it.
        """
        if not self.enable_caching or request.params.prompt_logprobs is not None:
            return self._empty(), 0
        hashes = request.block_hashes
        num = max(0, min((request.num_tokens - 1) // self.block_size, len(hashes)))
        for g, window in enumerate(self._windows):
            if window is None:
                num = self._full_hit(hashes, g, num)
        settled = False
        while not settled:
            settled = True
            for g, window in self._windowed:
                shorter = self._window_hit(hashes, g, window, num)
                settled, num = settled and shorter == num, shorter
        hits: list[_Table] = []
        for g, window in enumerate(self._windows):
            first = self._first_needed(window, num * self.block_size)
            table: _Table = [None] * first
            table += [self.pool.get_cached_block(h, g) for h in hashes[first:num]]
            hits.append(table)
        return KVCacheBlocks(tuple(hits), self._null_block_id), num * self.block_size

    def checkpoint_aligned(self, request: Request, start: int, num_new: int) -> int:
        """How many of ``num_new`` tokens from position ``start`` a step of ``request`` should
        compute. With a recurrent group (and prefix caching) a step of several tokens stops at
        a block boundary, so that the state there is kept as a checkpoint (vLLM's "align"
        mode): a chunk inside the prompt at the last boundary it crosses; the chunk that ends
        the prompt at the last boundary before its last token (the longest hit the prompt can
        give a repeat of itself: the last token is never a hit), its tail then a step of its
        own. Otherwise all of them. The scheduler asks; what a group keeps stays here.

        Before those, a step stops where a prefix other requests share ends: the end of the
        run of blocks from ``start`` on that the attention groups hold cached (another request
        computed them), when no checkpoint is held there. A prompt computed in one step leaves
        no state inside it, so the first request to share a prefix with it (a system prompt)
        hits nothing in the recurrent groups; stopping there leaves the checkpoint every later
        sharer resumes from."""
        if not self._recurrent or not self.enable_caching or num_new <= 1:
            return num_new
        end, bs = start + num_new, self.block_size
        boundary = ((end - 1) if end >= request.num_tokens else end) // bs * bs
        shared = self._shared_end(request, start, boundary) * bs
        if shared > start:
            boundary = shared
        return boundary - start if boundary > start else num_new

    def _shared_end(self, request: Request, start: int, limit: int) -> int:
        """The index of the first block from the one holding ``start`` that some attention
        group does not hold cached, when that is a boundary before ``limit`` that a cached run
        ends at and no checkpoint holds yet; 0 otherwise (no run, one reaching ``limit``, or
        its checkpoint there already: a request that takes no hit, asking its prompt's
        logprobs, need not write it again)."""
        hashes, bs, cached = request.block_hashes, self.block_size, self.pool.get_cached_block
        first = start // bs
        stop = min(limit // bs, len(hashes))
        full = [g for g, w in enumerate(self._windows) if w is None]
        i = first
        while i < stop and all(cached(hashes[i], g) is not None for g in full):
            i += 1
        if not first < i < stop or all(cached(hashes[i - 1], g) for g in self._recurrent):
            return 0
        return i

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        new_computed: KVCacheBlocks | None = None,
        index: bool = True,
        num_external: int = 0,
    ) -> KVCacheBlocks | None:
        """Make room for ``num_new_tokens`` more tokens after any prefix hits and ``num_external``
        tokens filled from outside. Returns the entries appended to each group's table after the
        hits, or None — changing nothing — when the pool cannot supply every group's blocks.

        A windowed group needs blocks for positions from ``c - W + 1`` on (``c``: the first
        position the engine computes, see the module docstring): blocks behind that are
        released first (their freed blocks count as supply), hits behind it are not taken, and
        positions behind it that have no block yet (after a hit or an external fill) get None.
        A pull (``num_new_tokens=0, num_external=prompt - hits``) so holds only the last window
        of the prompt in a windowed group: what the first decoded token reads.

        ``index=False`` leaves the new full blocks out of the prefix index: their content arrives
        later (a KV pull), and no other request may hit them before ``index_blocks``.
        """
        bs = self.block_size
        held = self._held.get(request.request_id)
        hits = new_computed.blocks if new_computed is not None else None
        num_hit = len(hits[0]) if hits else 0
        first_computed = request.num_computed_tokens + num_hit * bs + num_external
        total = first_computed + num_new_tokens
        if (
            held is not None
            and not num_hit
            and not num_external
            and total % bs
            and total <= len(held.tables[0]) * bs
            and (
                not self._windowed
                or all(held.start[g] >= (first_computed - w + 1) // bs for g, w in self._windowed)
            )
        ):
            return self._no_blocks  # decode inside a partly filled block: nothing to do (hot path)
        tables = held.tables if held is not None else self._empty().blocks
        start = held.start if held is not None else [0] * len(tables)
        firsts = [self._first_needed(w, first_computed) for w in self._windows]
        num_held = len(tables[0])
        end = num_held + num_hit  # table length after the hits
        num_blocks = -(-total // bs)
        release = [
            b for g, t in enumerate(tables) for b in t[start[g] : firsts[g]] if b is not None
        ]
        kept: list[_Table] = []  # per group: the hits it takes (None behind its window)
        appended: list[tuple[int, int]] = []  # per group: (None entries, fresh blocks) to append
        for g, first in enumerate(firsts):
            group_hits = hits[g] if hits and num_hit else []
            kept.append([None if num_held + j < first else b for j, b in enumerate(group_hits)])
            fill = max(first, num_blocks - 1) if g in self._recurrent else first  # (last page)
            appended.append(
                (max(0, min(fill, num_blocks) - end), max(0, num_blocks - max(end, fill)))
            )
        touched = [b for t in kept for b in t if b is not None]
        supply = (
            self.pool.num_free_blocks
            - sum(1 for b in touched if b.ref_cnt == 0)
            + sum(1 for b in release if b.ref_cnt == 1)
        )
        num_fresh = sum(fresh for _, fresh in appended)
        if num_fresh > supply:
            return None
        self.pool.free_blocks(release)  # oldest first: the first to be evicted
        self.pool.touch(touched)
        fresh_blocks = self.pool.get_new_blocks(num_fresh)
        new: list[_Table] = []
        for g, (table, (nones, fresh)) in enumerate(zip(tables, appended, strict=True)):
            for i in range(start[g], min(firsts[g], num_held)):
                table[i] = None
            start[g] = max(start[g], firsts[g])
            add: _Table = [None] * nones
            add += fresh_blocks[:fresh]
            del fresh_blocks[:fresh]
            table += kept[g]
            table += add
            new.append(add)
        if held is None:
            held = self._held[request.request_id] = _Held(tables, start)
        if index:
            self._index_full_blocks(request, held, total)
            self._index_checkpoint(request, held, first_computed)
        return KVCacheBlocks(tuple(new), self._null_block_id)

    def index_blocks(self, request: Request, num_tokens: int) -> None:
        """Index the full blocks among the first ``num_tokens`` (their content is now valid)."""
        held = self._held.get(request.request_id)
        if held is not None:
            self._index_full_blocks(request, held, num_tokens)
            self._index_checkpoint(request, held, num_tokens)

    def _index_full_blocks(self, request: Request, held: _Held, total: int) -> None:
        if not self.enable_caching:
            return
        start = held.num_indexed
        end = min(total // self.block_size, len(request.block_hashes), len(held.tables[0]))
        for g, table in enumerate(held.tables):
            if g not in self._recurrent:
                self.pool.cache_full_blocks(table, request.block_hashes, start, end, g)
        held.num_indexed = max(start, end)

    def _index_checkpoint(self, request: Request, held: _Held, computed: int) -> None:
        """Index the recurrent groups' pages that hold the state after ``computed`` tokens,
        written by a step that has run (or runs before any reader), when that is a block
        boundary: the checkpoints a prefix hit resumes from."""
        if not self._recurrent or not self.enable_caching or computed % self.block_size:
            return
        i = computed // self.block_size - 1
        if i < 0 or i >= min(len(request.block_hashes), len(held.tables[0])):
            return
        for g in self._recurrent:
            self.pool.cache_full_blocks(held.tables[g], request.block_hashes, i, i + 1, g)

    def hand_over(self, request: Request, num_tokens: int) -> BlockIds:
        """A prefill leg finished with ``num_tokens`` computed: release, in windowed groups, the
        blocks a continuation from position ``num_tokens`` cannot read, and return the tables
        the decode side pulls (None entries as the null id). The rest stay held, a lease, until
        ``free``."""
        held = self._held.get(request.request_id)
        if held is None:
            return self._empty().block_ids()
        release = []
        for g, window in self._windowed:
            table, first = held.tables[g], self._first_needed(window, num_tokens)
            for i in range(held.start[g], min(first, len(table))):
                block, table[i] = table[i], None
                if block is not None:
                    release.append(block)
            held.start[g] = max(held.start[g], min(first, len(table)))
        self.pool.free_blocks(release)
        return self.get_block_ids(request.request_id)

    def free(self, request: Request) -> None:
        """Release every block of ``request``, position by position from the tail across the
        groups: its tail blocks become the first to be evicted, so what stays cached longest is
        a prefix in every group."""
        held = self._held.pop(request.request_id, None)
        if held is None:
            return
        self._index_checkpoint(request, held, request.num_computed_tokens)
        tail_first = (t[i] for i in reversed(range(len(held.tables[0]))) for t in held.tables)
        self.pool.free_blocks(b for b in tail_first if b is not None)

    def get_block_ids(self, request_id: RequestId) -> BlockIds:
        held = self._held.get(request_id)
        if held is None:
            return self._empty().block_ids()
        return KVCacheBlocks(held.tables, self._null_block_id).block_ids()

    def reset_prefix_cache(self) -> bool:
        return self.pool.reset_prefix_cache()

    def take_events(self) -> list[KVEvent]:
        return self.pool.take_events()

    def _empty(self) -> KVCacheBlocks:
        return KVCacheBlocks(tuple([] for _ in self._windows), self._null_block_id)

    def _first_needed(self, window: int | None, position: int) -> int:
        """Index of the first block a computation from ``position`` reads in a group."""
        return 0 if window is None else max(0, (position - window + 1) // self.block_size)

    def _full_hit(self, hashes: list[BlockHash], group: int, limit: int) -> int:
        for i in range(limit):
            if self.pool.get_cached_block(hashes[i], group) is None:
                return i
        return limit

    def _window_hit(self, hashes: list[BlockHash], group: int, window: int, limit: int) -> int:
        """Longest hit of at most ``limit`` blocks this windowed group can serve: ``n`` blocks
        such that the blocks touching positions [n*bs - W + 1, n*bs) are all cached (the last
        ``min(n, ceil((W - 1) / bs))`` of them). Scans down from ``limit``: an uncached block
        ``i`` rules out every candidate whose window holds it, so the next candidate is ``i``."""
        need = -(-(window - 1) // self.block_size)
        top, run = limit, 0
        for i in range(limit - 1, -1, -1):
            if run >= need:
                break
            if self.pool.get_cached_block(hashes[i], group) is None:
                top, run = i, 0
            else:
                run += 1
        return top
