"""THE block-hash function. The gateway, the global scheduler's prefix directory and the
engine's block pool must agree on it byte for byte, in every process and on every machine.

Block *i* of a token sequence is the token ids ``[i*block_size, (i+1)*block_size)``. Only full
blocks are hashed. Its hash chains the hash of block *i-1*, so equal hashes mean equal prefixes:

    tokens:  | t0 .. t15 | t16 .. t31 | t32 .. t40 (partial, not hashed)
    hashes:  |    h0     |    h1      |
             h0 = H(ROOT, tokens[0:16], extra)      h1 = H(h0, tokens[16:32])

H is xxh3-128 over a fixed little-endian encoding (never Python's ``hash()``, which is salted per
process). 128 bits keep accidental collisions, which would hand one request another's KV cache,
out of reach. ``extra_keys`` (a cache salt, a LoRA name, …) are mixed into the first block only;
the chain carries them to every later block.
"""

import struct
from collections.abc import Sequence

import xxhash

from shared.ids import BlockHash

_VERSION = b"baton.block_hash.v1"
ROOT_HASH = BlockHash(xxhash.xxh3_128_digest(_VERSION))


def _encode_extra(extra_keys: Sequence[str]) -> bytes:
    parts = []
    for key in extra_keys:
        raw = key.encode("utf-8")
        parts.append(struct.pack("<I", len(raw)) + raw)
    return struct.pack("<I", len(extra_keys)) + b"".join(parts)


def hash_block(
    parent: BlockHash, token_ids: Sequence[int], extra_keys: Sequence[str] = ()
) -> BlockHash:
    """Hash one full block given its parent's hash (``ROOT_HASH`` for the first block)."""
    if len(parent) != 16:
        raise ValueError(f"parent hash must be 16 bytes, got {len(parent)}")
    h = xxhash.xxh3_128()
    h.update(parent)
    h.update(struct.pack(f"<I{len(token_ids)}I", len(token_ids), *token_ids))
    h.update(_encode_extra(extra_keys))
    return BlockHash(h.digest())


def hash_blocks(
    token_ids: Sequence[int],
    block_size: int,
    extra_keys: Sequence[str] = (),
    start: int = 0,
    parent: BlockHash = ROOT_HASH,
) -> list[BlockHash]:
    """Hashes of every full block of ``token_ids`` from block index ``start`` on.

    ``parent`` must be the hash of block ``start - 1`` (``ROOT_HASH`` when ``start == 0``), so a
    caller can extend an existing hash list as tokens arrive without rehashing the prefix.
    """
    if block_size <= 0:
        raise ValueError(f"block_size must be positive, got {block_size}")
    hashes: list[BlockHash] = []
    for i in range(start, len(token_ids) // block_size):
        block = token_ids[i * block_size : (i + 1) * block_size]
        parent = hash_block(parent, block, extra_keys if i == 0 else ())
        hashes.append(parent)
    return hashes
