"""KV cache groups: a model's attention layers grouped by the state they keep, so that each
group has its own block table and allocation rule over one shared block pool.

    kind            keeps, per request                           (``KVCacheGroup.window``)
    full attention  every token's K and V                         None
    sliding window  the last W tokens' K and V: older blocks go   W

A model whose layers are all alike has one group of all its layers: the cache is what it was
before groups (one block spans every layer). A hybrid model's layers are cut into groups of
``page_layers`` layers of one kind, ``page_layers`` being the smallest kind's layer count (as
vLLM's hybrid allocator does): gpt-oss-20b (12 windowed + 12 full layers) has two groups of 12;
Gemma-3-12B (40 windowed + 8 full) one full group and five windowed groups of 8. A block (a
"page") then holds ``page_layers`` layers of ``block_size`` tokens, and every group draws its
pages from the one pool: a windowed group's request holds a window's worth of pages whatever
the context, a full group's as many as the context needs.

Layer ``l`` lives in group ``group_of[l]`` at slot ``slot_of[l]`` of that group's pages: its
K and V are ``kv[block, slot_of[l]]`` for the blocks of its group's table (``layout.py``).
Torch-free: the scheduler's process plans the same groups from the model's config.
"""

from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention; W: the query at p sees the keys in (p - W, p]
    layers: tuple[int, ...]  # attention layers, in slot order (at most page_layers)

    @property
    def kind(self) -> str:
        return "full" if self.window is None else f"window {self.window}"

    def blocks_needed(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks a request of ``num_tokens`` holds at most while a step computes ``chunk`` of
        its tokens (1: decoding): all of them, or those that the chunk's keys and the W - 1
        before them can touch (positions c - W + 1 … c + chunk - 1)."""
        blocks = -(-num_tokens // block_size)
        if self.window is None:
            return blocks
        return min(blocks, -(-(self.window + chunk - 2) // block_size) + 1)


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]
    page_layers: int  # layers per block

    @staticmethod
    def plan(windows: Sequence[int | None]) -> "KVCacheGroups":
        """Group layers by their window (``ArchConfig.attention_windows()``)."""
        if not windows:
            raise ValueError("a model without attention layers has no KV cache")
        kinds: dict[int | None, list[int]] = {}
        for layer, window in enumerate(windows):
            kinds.setdefault(window, []).append(layer)
        # full attention first: group 0 is the one the prefix directory hears of
        order = sorted(kinds, key=lambda w: (w is not None, w or 0))
        page = min(len(layers) for layers in kinds.values())
        groups = tuple(
            KVCacheGroup(w, tuple(kinds[w][i : i + page]))
            for w in order
            for i in range(0, len(kinds[w]), page)
        )
        return KVCacheGroups(groups, page)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        return len({g.window for g in self.groups}) > 1

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    def place(self, layer: int) -> tuple[int, int]:
        """(group, slot) of attention layer ``layer``."""
        for g, group in enumerate(self.groups):
            if layer in group.layers:
                return g, group.layers.index(layer)
        raise KeyError(f"layer {layer} is in no KV cache group")

    def blocks_per_request(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks (pages) one request of ``num_tokens`` tokens holds at most, over all groups,
        while a step computes ``chunk`` of its tokens (1: decoding; a prefill chunk holds a
        windowed group's blocks under the whole chunk as well)."""
        return sum(g.blocks_needed(num_tokens, block_size, chunk) for g in self.groups)

    @property
    def num_layers(self) -> int:
        return sum(len(g.layers) for g in self.groups)

    def request_bytes(self, num_tokens: int, block_size: int, bytes_per_block: int) -> int:
        """Cache bytes one request of ``num_tokens`` tokens holds at most."""
        return self.blocks_per_request(num_tokens, block_size) * bytes_per_block

    def full_attention_bytes(self, num_tokens: int, block_size: int, bytes_per_block: int) -> int:
        """What the same request would hold were every layer to keep every token (a cache
        without groups): the saving the groups buy is the ratio of the two."""
        per_layer = bytes_per_block // self.page_layers
        return -(-num_tokens // block_size) * self.num_layers * per_layer

    def describe(self) -> str:
        """e.g. ``2 groups of 12 layers: full, window 128`` (the KV handshake compares it)."""
        kinds = ", ".join(g.kind for g in self.groups)
        n = len(self.groups)
        return f"{n} group{'s' if n > 1 else ''} of {self.page_layers} layers: {kinds}"
