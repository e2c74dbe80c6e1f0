"""The block hash must be identical in every process and on every machine: golden vectors."""

import struct
import subprocess
import sys

import pytest
import xxhash

from shared.block_hash import ROOT_HASH, hash_block, hash_blocks

TOKENS = list(range(40))


def test_golden_vectors() -> None:
    # Recorded once; changing the encoding or the function breaks every deployed directory.
    hashes = hash_blocks(TOKENS, 16)
    assert [h.hex() for h in hashes] == GOLDEN
    assert ROOT_HASH.hex() == GOLDEN_ROOT


GOLDEN_ROOT = "96db356425719d29e0256c4905ba2eaa"
GOLDEN = [
    "f3ba7b5f6921fcef7f3fe8a68b8b9293",
    "37e4093ca6c3749becaae903a4e57f2f",
]


def test_encoding_is_the_documented_one() -> None:
    """xxh3-128 over: parent (16 bytes) ‖ u32 count ‖ u32 token ids ‖ u32 #extra keys (LE)."""
    root = xxhash.xxh3_128_digest(b"baton.block_hash.v1")
    raw = root + struct.pack("<I16I", 16, *TOKENS[:16]) + struct.pack("<I", 0)
    assert hash_blocks(TOKENS, 16)[0] == xxhash.xxh3_128_digest(raw)


def test_only_full_blocks_are_hashed() -> None:
    assert len(hash_blocks(TOKENS[:15], 16)) == 0
    assert len(hash_blocks(TOKENS[:16], 16)) == 1
    assert len(hash_blocks(TOKENS, 16)) == 2


def test_chain_means_equal_prefix() -> None:
    a = hash_blocks(TOKENS, 16)
    b = hash_blocks([*TOKENS[:16], 999, *TOKENS[17:]], 16)
    assert a[0] == b[0] and a[1] != b[1]
    c = hash_blocks([1000, *TOKENS[1:]], 16)  # first block differs → every later hash differs
    assert c[1] != a[1]


def test_extra_keys_change_every_block() -> None:
    plain, salted = hash_blocks(TOKENS, 16), hash_blocks(TOKENS, 16, extra_keys=("salt",))
    assert all(p != s for p, s in zip(plain, salted, strict=True))


def test_incremental_extension_equals_full() -> None:
    first = hash_blocks(TOKENS[:16], 16)
    more = hash_blocks(TOKENS, 16, start=1, parent=first[-1])
    assert first + more == hash_blocks(TOKENS, 16)


def test_same_in_a_fresh_process() -> None:
    code = (
        "from shared.block_hash import hash_blocks;print(hash_blocks(list(range(40)), 16)[1].hex())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == hash_blocks(TOKENS, 16)[1].hex()


def test_bad_arguments() -> None:
    with pytest.raises(ValueError):
        hash_blocks(TOKENS, 0)
    with pytest.raises(ValueError):
        hash_block(b"short", [1, 2])
