"""The torch reference backend: plain PyTorch, one request at a time, float32 math.

Simple by design and easy to check: it is the oracle that faster backends are tested against, and
it runs on both CPU and GPU. Prefill chunks are attended one request at a time; decode rows (one
query each) go through one padded, masked call, since a per-request loop of tiny calls is what
dominated CPU decode time (60 % of a step in a profile of the tiny model).

A sliding window and sinks (backend.py) are masks and one more column of the same calls: the
sinks as a key whose score is the head's sink logit (an additive mask on a zero key) and whose
value is zero.
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
        out: torch.Tensor | None = None,
        store_kv: bool = True,
    ) -> torch.Tensor:
        if store_kv:
            write_kv(k, v, kv_cache, metadata.slot_mapping[: metadata.num_tokens])
        out = torch.empty_like(q) if out is None else out
        qsl = metadata.query_start_loc_cpu
        decode = [i for i in range(len(metadata.seq_lens_cpu)) if qsl[i + 1] - qsl[i] == 1]
        if len(decode) > 1:
            self._decode_batched(q, kv_cache, metadata, decode, out)
            rest = sorted(set(range(len(metadata.seq_lens_cpu))) - set(decode))
        else:
            rest = list(range(len(metadata.seq_lens_cpu)))
        for i in rest:
            start, end, seq_len = qsl[i], qsl[i + 1], metadata.seq_lens_cpu[i]
            if end > start:
                keys, values = self._gather(kv_cache, metadata.block_tables[i : i + 1], seq_len)
                out[start:end] = self._attend(q[start:end], keys[0], values[0], seq_len).to(q.dtype)
        return out

    def _gather(
        self, kv_cache: LayerKVCache, tables: torch.Tensor, seq_len: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of the first ``seq_len`` positions of each row's blocks: [rows, len, H, D]."""
        bs = kv_cache.block_size
        blocks = tables[:, : -(-seq_len // bs)].long()
        rows = blocks.shape[0]
        shape = (rows, -1, self.num_kv_heads, self.head_dim)
        keys = kv_cache.key[blocks].reshape(shape)[:, :seq_len]
        values = kv_cache.value[blocks].reshape(shape)[:, :seq_len]
        return kv_cache.read(keys, values)

    def _decode_batched(
        self,
        q: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
        rows: list[int],
        out: torch.Tensor,
    ) -> None:
        """Every one-query request in one padded call; positions past a row's length are masked."""
        token_idx = torch.tensor([metadata.query_start_loc_cpu[i] for i in rows], device=q.device)
        lens = torch.tensor([metadata.seq_lens_cpu[i] for i in rows], device=q.device)
        max_len = max(metadata.seq_lens_cpu[i] for i in rows)
        row_idx = torch.tensor(rows, device=q.device)
        keys, values = self._gather(kv_cache, metadata.block_tables[row_idx], max_len)
        k_pos = torch.arange(max_len, device=q.device)[None, :]
        mask = self._visible(k_pos, lens[:, None] - 1)  # each row's query: its last position
        res = self._sdpa(
            q[token_idx].float().unsqueeze(2),  # [B, H, 1, D]
            keys.float().transpose(1, 2),  # [B, H_kv, L, D]
            values.float().transpose(1, 2),
            mask[:, None, None, :],
        )
        out[token_idx] = res.squeeze(2).to(q.dtype)

    def _attend(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        q_len = q.shape[0]
        # Query j sits at absolute position seq_len - q_len + j and sees keys 0..that position
        # (those of its window only, with a sliding window).
        q_pos = torch.arange(seq_len - q_len, seq_len, device=q.device)
        k_pos = torch.arange(seq_len, device=q.device)
        out = self._sdpa(
            q.float().transpose(0, 1),  # [H, q_len, D]
            keys.float().transpose(0, 1),
            values.float().transpose(0, 1),
            self._visible(k_pos[None, :], q_pos[:, None])[None],  # [1, q_len, seq_len]
        )
        return out.transpose(0, 1)

    def _visible(self, k_pos: torch.Tensor, q_pos: torch.Tensor) -> torch.Tensor:
        """Which keys a query sees: causal, and inside its window (positions broadcast)."""
        mask = k_pos <= q_pos
        if self.sliding_window is not None:
            mask &= k_pos > q_pos - self.sliding_window
        return mask

    def _sdpa(
        self, q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor
    ) -> torch.Tensor:
        """Attention of q [..., H, n, D] over keys/values [..., H_kv, L, D] where ``mask``
        [..., 1, n, L] allows; with sinks, over one more key of score sink_h and value 0."""
        if self.sinks is not None:
            zero = keys.new_zeros((*keys.shape[:-2], 1, keys.shape[-1]))
            keys, values = torch.cat([keys, zero], -2), torch.cat([values, zero], -2)
            bias = torch.zeros(mask.shape, device=q.device).masked_fill(~mask, float("-inf"))
            sink = self.sinks.float().to(q.device)[:, None, None]  # [H, 1, 1]
            rows = q.shape[:-1]  # [..., H, n]
            mask = torch.cat([bias.expand(*rows, -1), sink.expand(*rows, 1)], -1)
        return F.scaled_dot_product_attention(
            q, keys, values, attn_mask=mask, scale=self.scale, enable_gqa=True
        )
