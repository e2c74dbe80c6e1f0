"""The physical KV-cache layout: ONE tensor in which a block is contiguous across all layers.

    kv[num_blocks, num_layers, parts, block_size, num_kv_heads, head_dim]
       └─ block b ──────────────────────────────────────────────────────┘  one span of memory

``parts`` is 2 (K and V) for multi-head attention. Multi-head latent attention (MLA) caches one
latent vector per token and layer (``kv_lora_rank`` + the rotary key, ``ArchConfig.mla``): one
part, one "head" of that width, which every tensor-parallel rank holds whole; its blocks are
then a fraction of a dense cache's (DeepSeek-V2-Lite: 576 values per token and layer, against
2 × 16 heads × 128 for the same model with a dense cache).

Moving a request's KV to another worker is then one descriptor per block (or per run of
consecutive blocks), not one per layer per block: NIXL's speed is decided by the descriptor
count (between two H200s over NVLink, 8,192 descriptors of 32 KiB — one layer's K or V of a
16-token block — moved at 5.8 GB/s, one 256 MiB descriptor at 362 GB/s). Each layer sees its
K and V as a strided view [num_blocks, block_size, num_kv_heads, head_dim] (MLA: the latent,
as both).
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
    parts: int = 2  # K and V; 1: MLA's latent

    def shape(self, num_blocks: int) -> tuple[int, ...]:
        return (num_blocks, self.num_layers, self.parts, self.block_size, self.num_kv_heads,
                self.head_dim)  # fmt: skip

    @property
    def bytes_per_block(self) -> int:
        elems = self.num_layers * self.parts * self.block_size * self.num_kv_heads * self.head_dim
        return elems * torch.tensor([], dtype=self.dtype).element_size()

    def allocate(self, num_blocks: int, device: torch.device | str) -> torch.Tensor:
        return torch.zeros(self.shape(num_blocks), dtype=self.dtype, device=device)


def layer_views(kv: torch.Tensor, layer: int) -> LayerKVCache:
    """One layer's K and V views; with one part (MLA) the latent is both."""
    return LayerKVCache(key=kv[:, layer, 0], value=kv[:, layer, kv.shape[2] - 1])
