"""The torch reference backend: plain PyTorch, one request at a time, float32 math.

Slow by design and easy to check: it is the oracle that faster backends are tested against, and
it runs on both CPU and GPU.
"""

import torch
import torch.nn.functional as F

from services.worker.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
    write_kv,
)


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        write_kv(k, v, kv_cache, metadata.slot_mapping[: metadata.num_tokens])
        out = torch.empty_like(q)
        bs = kv_cache.block_size
        qsl, seq_lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        for i, seq_len in enumerate(seq_lens):
            start, end = qsl[i], qsl[i + 1]
            if end == start:
                continue
            blocks = metadata.block_tables[i, : -(-seq_len // bs)].long()
            keys = kv_cache.key[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            values = kv_cache.value[blocks].reshape(-1, self.num_kv_heads, self.head_dim)[:seq_len]
            out[start:end] = self._attend(q[start:end], keys, values, seq_len).to(q.dtype)
        return out

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        q_len = q.shape[0]
        # Query j sits at absolute position seq_len - q_len + j and sees keys 0..that position.
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        mask = k_pos[None, :] <= q_pos[:, None]
        out = F.scaled_dot_product_attention(
            q.float().transpose(0, 1),  # [H, q_len, D]
            keys.float().transpose(0, 1),
            values.float().transpose(0, 1),
            attn_mask=mask,
            scale=self.scale,
            enable_gqa=True,
        )
        return out.transpose(0, 1)
