"""Typed identifiers used across services, so a request id is never mixed up with a worker id."""

from typing import NewType

RequestId = NewType("RequestId", str)
WorkerId = NewType("WorkerId", str)
# 16-byte digest of one full block of tokens and everything before it; see shared/block_hash.py.
BlockHash = NewType("BlockHash", bytes)
