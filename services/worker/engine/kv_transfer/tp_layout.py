"""Which KV heads each tensor-parallel rank holds, and where a decode rank reads its heads from
when the prefill and decode workers have different TP sizes (pure arithmetic: no torch).

A rank of a TP-``n`` engine with ``H`` KV heads holds heads ``[r·H/n, (r+1)·H/n)`` (n ≤ H), or
the one head ``r // (n/H)`` (n > H: each head replicated on n/H consecutive ranks) — the split
of ``models/layers/linear.QKVParallelLinear``. Its cache block is
``[layers, K|V, block_size, local_heads, head_dim]`` (``kv_cache/layout.py``).

    p = d (e.g. 2 → 2)   decode rank r reads all of prefill rank r's heads: one descriptor per block
    p ≠ d (1 → 2, 2 → 1) a decode rank reads a sub-range of heads from one or more prefill
                         ranks; in this layout a sub-range of heads is not contiguous in a
                         block: one descriptor per block, layer, K|V and token (``head_runs``
                         gives the ranges, ``run_descriptors`` the byte spans)
"""

from dataclasses import dataclass

import numpy as np


def global_kv_heads(rank: int, tp_size: int, num_kv_heads: int) -> range:
    """The KV heads (global indices) rank ``rank`` of a TP-``tp_size`` engine holds."""
    if tp_size <= num_kv_heads:
        n = num_kv_heads // tp_size
        return range(rank * n, (rank + 1) * n)
    head = rank // (tp_size // num_kv_heads)
    return range(head, head + 1)


@dataclass(frozen=True)
class HeadRun:
    """``count`` heads read from prefill rank ``src_rank``: its local heads from ``src_start``
    into this rank's local heads from ``dst_start``."""

    src_rank: int
    src_start: int
    dst_start: int
    count: int


def head_runs(dst_rank: int, dst_tp: int, src_tp: int, num_kv_heads: int) -> list[HeadRun]:
    """Where decode rank ``dst_rank`` (of ``dst_tp``) reads each of its heads from a prefill
    engine of ``src_tp`` ranks: one run per source rank, each head read once (from the first
    rank that holds it, when the prefill side replicates heads). With equal TP sizes, from the
    same rank: it holds the same heads, and a page of a recurrent state (a Gated DeltaNet
    model's, whose value heads split over every rank even where KV heads are replicated) is
    that rank's own."""
    need = global_kv_heads(dst_rank, dst_tp, num_kv_heads)
    if dst_tp == src_tp:
        return [HeadRun(dst_rank, 0, 0, len(need))]
    runs, covered = [], need.start
    for src in range(src_tp):
        have = global_kv_heads(src, src_tp, num_kv_heads)
        start, stop = max(covered, have.start), min(need.stop, have.stop)
        if start < stop:
            runs.append(HeadRun(src, start - have.start, start - need.start, stop - start))
            covered = stop
    assert covered == need.stop, "every head of a decode rank is held by some prefill rank"
    return runs


@dataclass(frozen=True)
class BlockGeometry:
    """One rank's cache block: ``[rows, local_heads, head_dim]`` with rows = layers·2·block_size."""

    rows: int
    local_heads: int
    head_bytes: int  # head_dim × element size

    @property
    def block_bytes(self) -> int:
        return self.rows * self.local_heads * self.head_bytes


def run_descriptors(
    base: int, geom: BlockGeometry, blocks: list[int], head_start: int, count: int, device: int,
    per_row: bool = False,
) -> np.ndarray:  # fmt: skip
    """(address, length, device) of ``count`` heads from ``head_start`` in every row of every
    block in ``blocks``, in block-major order: one span per block when the run is the block's
    every head, else (or with ``per_row``: the other side of the READ needs rows) one per row."""
    b = np.asarray(blocks, dtype=np.int64)
    if head_start == 0 and count == geom.local_heads and not per_row:  # the whole block
        addr = base + b * geom.block_bytes
        size = geom.block_bytes
    else:
        row = geom.local_heads * geom.head_bytes
        rows = np.arange(geom.rows, dtype=np.int64) * row + head_start * geom.head_bytes
        addr = (base + b[:, None] * geom.block_bytes + rows[None, :]).reshape(-1)
        size = count * geom.head_bytes
    out = np.empty((addr.shape[0], 3), dtype=np.int64)
    out[:, 0], out[:, 1], out[:, 2] = addr, size, device
    return out
