"""Paged KV cache: the physical layout, the block pool and the per-request manager."""
