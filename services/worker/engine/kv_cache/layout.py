"""The physical KV-cache layout: ONE tensor in which a block is contiguous across all layers.

    kv[num_blocks, num_layers, 2 (K|V), block_size, num_kv_heads, head_dim]
       └─ block b ──────────────────────────────────────────────────────┘  one span of memory

Moving a request's KV to another worker is then one descriptor per block (or per run of
consecutive blocks), not one per layer per block: NIXL's speed is decided by the descriptor
count (between two H200s over NVLink, 8,192 descriptors of 32 KiB — one layer's K or V of a
16-token block — moved at 5.8 GB/s, one 256 MiB descriptor at 362 GB/s). Each layer sees its
K and V as a strided view [num_blocks, block_size, num_kv_heads, head_dim].
"""

from dataclasses import dataclass

import torch

from services.worker.engine.attention.backend import LayerKVCache


@dataclass(frozen=True)
class KVCacheLayout:
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim)

    @property
    def bytes_per_block(self) -> int:
        elems = self.num_layers * 2 * self.block_size * self.num_kv_heads * self.head_dim
        return elems * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.shape(num_blocks), dtype=self.dtype, device=device)


def layer_views(kv: torch.Tensor, layer: int) -> LayerKVCache:
    return LayerKVCache(key=kv[:, layer, 0], value=kv[:, layer, 1])
