"""KV-cache events: what the engine's block pool tells the world about its prefix index.

Workers forward these, in order, to the global scheduler's prefix directory. They are msgspec
structs (a tagged union) so they cross ZMQ and gRPC as plain msgpack, never pickle.
"""

import msgspec

from shared.ids import BlockHash


class BlockStored(msgspec.Struct, tag="stored", frozen=True):
    """Blocks entered the prefix index; ``parent`` is the hash before the first one (or None)."""

    block_hashes: list[BlockHash]
    parent: BlockHash | None
    block_size: int


class BlockRemoved(msgspec.Struct, tag="removed", frozen=True):
    """Blocks left the prefix index (evicted for reuse)."""

    block_hashes: list[BlockHash]


class AllBlocksCleared(msgspec.Struct, tag="cleared", frozen=True):
    """The whole prefix index was dropped (reset, or a fresh engine)."""


KVEvent = BlockStored | BlockRemoved | AllBlocksCleared


class KVEventBatch(msgspec.Struct, frozen=True):
    """Events from one engine step, with a sequence number per engine incarnation."""

    seq: int
    events: list[KVEvent]
