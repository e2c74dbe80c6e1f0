"""KV cache groups: a model's attention layers grouped by the state they keep, so that each
group has its own block table and allocation rule over one shared block pool.

    kind            keeps, per request                           (``KVCacheGroup``)
    full attention  every token's K and V                         window None
    sliding window  the last W tokens' K and V: older blocks go   window W
    recurrent       a fixed-size state (Gated DeltaNet: the       recurrent
                    convolution's last inputs and the delta
                    rule's matrices), one page at the block of
                    the last computed token; pages left behind
                    at block boundaries are prefix checkpoints

A model whose layers are all alike has one group of all its layers: the cache is what it was
before groups (one block spans every layer). A hybrid model's layers are cut into groups of
``page_layers`` layers of one kind, ``page_layers`` being the smallest kind's layer count (as
vLLM's hybrid allocator does): gpt-oss-20b (12 windowed + 12 full layers) has two groups of 12;
Gemma-3-12B (40 windowed + 8 full) one full group and five windowed groups of 8. A block (a
"page") then holds ``page_layers`` layers of ``block_size`` tokens, and every group draws its
pages from the one pool: a windowed group's request holds a window's worth of pages whatever
the context, a full group's as many as the context needs.

A recurrent layer's state lives in one layer slot of a page (the worker makes the block size
large enough for it to fit, ``state_block_size``): a request's recurrent group holds the page
of the block its last computed token is in, which each step reads and then writes (a step that
crosses into a new block writes a new page and leaves the old one, at the boundary the step
began on, as a checkpoint of the state there). So a recurrent group holds one or two pages of
a request whatever the context; the manager's rules are in ``manager.py``.

Layer ``l`` lives in group ``group_of[l]`` at slot ``slot_of[l]`` of that group's pages: its
K and V are ``kv[block, slot_of[l]]`` for the blocks of its group's table (``layout.py``).
Torch-free: the scheduler's process plans the same groups from the model's config.
"""

from collections.abc import Sequence
from dataclasses import dataclass

RECURRENT = "recurrent"  # a layer kind of ``plan`` (as ``ArchConfig.layer_cache_kinds``)


@dataclass(frozen=True)
class KVCacheGroup:
    window: int | None  # None: full attention; W: the query at p sees the keys in (p - W, p]
    layers: tuple[int, ...]  # the model's layers, in slot order (at most page_layers)
    recurrent: bool = False  # a fixed-size state per request (``window`` is then None)

    @property
    def kind(self) -> str:
        if self.recurrent:
            return RECURRENT
        return "full" if self.window is None else f"window {self.window}"

    def blocks_needed(self, num_tokens: int, block_size: int, chunk: int = 1) -> int:
        """Blocks a request of ``num_tokens`` holds at most while a step computes ``chunk`` of
        its tokens (1: decoding): all of them, or those that the chunk's keys and the W - 1
        before them can touch (positions c - W + 1 … c + chunk - 1)."""
        blocks = -(-num_tokens // block_size)
        if self.recurrent:  # the page it reads and the page it writes
            return min(blocks, 2)
        if self.window is None:
            return blocks
        return min(blocks, -(-(self.window + chunk - 2) // block_size) + 1)


@dataclass(frozen=True)
class KVCacheGroups:
    groups: tuple[KVCacheGroup, ...]
    page_layers: int  # layers per block

    @staticmethod
    def plan(kinds: Sequence[int | str | None]) -> "KVCacheGroups":
        """Group layers by what they keep (``ArchConfig.layer_cache_kinds()``: a window, None
        for full attention, ``RECURRENT``)."""
        if not kinds:
            raise ValueError("a model without layers has no KV cache")
        layers_of: dict[int | str | None, list[int]] = {}
        for layer, kind in enumerate(kinds):
            layers_of.setdefault(kind, []).append(layer)
        # full attention first: group 0 is the one the prefix directory hears of; then the
        # windows, widest last; recurrent last
        order = sorted(layers_of, key=lambda k: (k == RECURRENT, k is not None,
                                                 k if isinstance(k, int) else 0))  # fmt: skip
        page = min(len(layers) for layers in layers_of.values())
        groups = tuple(
            KVCacheGroup(
                k if isinstance(k, int) else None,
                tuple(layers_of[k][i : i + page]),
                recurrent=k == RECURRENT,
            )
            for k in order
            for i in range(0, len(layers_of[k]), page)
        )
        return KVCacheGroups(groups, page)

    @property
    def num_groups(self) -> int:
        return len(self.groups)

    @property
    def hybrid(self) -> bool:
        return len({g.kind for g in self.groups}) > 1

    @property
    def windows(self) -> tuple[int | None, ...]:
        return tuple(g.window for g in self.groups)

    @property
    def kinds(self) -> tuple[int | str | None, ...]:
        """Each group's kind as ``plan`` takes it: None, a window, or ``RECURRENT``."""
        return tuple(RECURRENT if g.recurrent else g.window for g in self.groups)

    @property
    def has_recurrent(self) -> bool:
        return any(g.recurrent for g in self.groups)

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

    @property
    def num_attention_layers(self) -> int:
        """The layers that keep K and V (not a recurrent state)."""
        return sum(len(g.layers) for g in self.groups if not g.recurrent)

    def full_attention_bytes(self, num_tokens: int, block_size: int, bytes_per_block: int) -> int:
        """What the same request would hold were every layer to keep every token's K and V (a
        cache without groups, which treats a recurrent layer as attention too): the saving the
        groups buy is the ratio of the two."""
        per_layer = bytes_per_block // self.page_layers
        return -(-num_tokens // block_size) * self.num_layers * per_layer

    def kv_bytes_per_token(self, block_size: int, bytes_per_block: int) -> int:
        """One token's K and V over the attention layers (a windowed layer's for the tokens
        inside its window)."""
        return bytes_per_block // self.page_layers * self.num_attention_layers // block_size

    def state_bytes(self, bytes_per_block: int) -> int:
        """One request's recurrent state over every recurrent layer: a page slot each (what a
        step reads, and then writes)."""
        per_layer = bytes_per_block // self.page_layers
        return sum(len(g.layers) for g in self.groups if g.recurrent) * per_layer

    def describe(self) -> str:
        """e.g. ``2 groups of 12 layers: full, window 128`` (the KV handshake compares it)."""
        kinds = ", ".join(g.kind for g in self.groups)
        n = len(self.groups)
        return f"{n} group{'s' if n > 1 else ''} of {self.page_layers} layers: {kinds}"
