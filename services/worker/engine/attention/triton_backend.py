"""The Triton paged-attention backend (the GPU default). Requests with more than one query
(prefill chunks) go through ``_prefill``; requests with one (decode rows: the whole batch of a
decode step, the trailing rows of a mixed one) through ``_decode``, which reads each kv head's
K/V once for its whole query group, split over the context when the rows are too few to fill
the GPU, then ``_combine``.

It needs only device values from the metadata plus ``max_query_len`` and ``max_seq_len`` —
which the CUDA-graph path pins to 1 and ``max_model_len`` — so decode can be captured.
On CPU the same kernels run in Triton's interpreter (``TRITON_INTERPRET=1``), which is how CI
checks them on every commit.
"""

import torch
import triton

from services.worker.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
)
from services.worker.engine.attention.triton_kernels import (
    LOG2E,
    _combine,
    _decode,
    _prefill,
    _write_kv,
)
from services.worker.engine.dependent_launch import launch_options

MAX_SPLITS = 16
TOKENS_PER_SPLIT = 512  # below this a split's work is too small to pay for the combine step


def num_decode_splits(num_reqs: int, num_kv_heads: int, max_seq_len: int, num_sms: int) -> int:
    """A power of two: enough programs to fill the GPU, none shorter than TOKENS_PER_SPLIT."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and num_reqs * num_kv_heads * splits < num_sms
        and max_seq_len > 2 * splits * TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits


class TritonAttentionBackend(AttentionBackend):
    name = "triton"
    supports_cuda_graphs = True
    # GPU launch configuration (benchmarks/attention_sweep.py measures the alternatives)
    DECODE_BLOCK_N = 64
    DECODE_WARPS = 4
    DECODE_STAGES = 2

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, scale)
        self.group = num_heads // num_kv_heads
        self.block_d = max(16, triton.next_power_of_2(head_dim))  # tl.dot needs K >= 16
        self._num_sms: int | None = None

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: LayerKVCache,
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        self._write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)
        if metadata.max_query_len == 1:
            self._decode(q, kv_cache, metadata, out)
            return out
        num_reqs = metadata.seq_lens.shape[0]
        decodes = metadata.num_decodes
        self._prefill(q, kv_cache, metadata, out, num_reqs - decodes)
        if decodes:
            self._decode(q, kv_cache, metadata, out, num_reqs - decodes)
        return out

    def _write_kv(
        self, k: torch.Tensor, v: torch.Tensor, kv: LayerKVCache, slot_mapping: torch.Tensor
    ) -> None:
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("new keys and values need a contiguous head dimension")
        _write_kv[(k.shape[0], self.num_kv_heads)](
            k, v, kv.key, kv.value, slot_mapping,
            k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            kv.key.stride(0), kv.key.stride(1), kv.key.stride(2),
            KV_BLOCK=kv.block_size, HEAD_DIM=self.head_dim, BLOCK_D=self.block_d,
            **launch_options(k),
        )  # fmt: skip

    def _common(
        self, q: torch.Tensor, kv: LayerKVCache, meta: AttentionMetadata, out: torch.Tensor
    ) -> dict[str, object]:
        if q.stride(-1) != 1 or kv.key.stride(-1) != 1 or kv.key.stride() != kv.value.stride():
            raise ValueError("the Triton backend needs a contiguous head dimension")
        return {
            "stride_qt": q.stride(0), "stride_qh": q.stride(1),
            "stride_ot": out.stride(0), "stride_oh": out.stride(1),
            "stride_kb": kv.key.stride(0), "stride_ks": kv.key.stride(1),
            "stride_kh": kv.key.stride(2), "stride_bt": meta.block_tables.stride(0),
            "qk_scale": self.scale * LOG2E, "KV_BLOCK": kv.block_size, "GROUP": self.group,
            "HEAD_DIM": self.head_dim, "BLOCK_D": self.block_d,
            "PRECISION": "ieee" if q.dtype == torch.float32 else "tf32",
        }  # fmt: skip

    def _prefill(
        self,
        q: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        num_reqs: int,
    ) -> None:
        """The first ``num_reqs`` requests of the batch."""
        block_m, block_n = (64, 64) if q.is_cuda else (16, 16)
        grid = (triton.cdiv(meta.max_query_len, block_m), num_reqs, self.num_heads)
        _prefill[grid](
            q, kv.key, kv.value, out, meta.block_tables, meta.query_start_loc, meta.seq_lens,
            BLOCK_M=block_m, BLOCK_N=block_n, **self._common(q, kv, meta, out),
            **({"num_warps": 4, "num_stages": 2} if q.is_cuda else {}),
        )  # fmt: skip

    def _decode(
        self,
        q: torch.Tensor,
        kv: LayerKVCache,
        meta: AttentionMetadata,
        out: torch.Tensor,
        first: int = 0,
    ) -> None:
        """The requests from ``first`` on, one query each, in ``meta.decode_order``."""
        num_reqs = meta.seq_lens.shape[0] - first
        splits = num_decode_splits(
            num_reqs, self.num_kv_heads, meta.max_decode_seq_len, self._sms(q)
        )
        part_acc = part_ml = out  # unused placeholders when there is a single split
        if splits > 1:
            shape = (num_reqs, self.num_heads, splits)
            part_acc = torch.empty((*shape, self.block_d), dtype=torch.float32, device=q.device)
            part_ml = torch.empty((*shape, 2), dtype=torch.float32, device=q.device)
        common = self._common(q, kv, meta, out)
        order = meta.decode_order
        grid = (num_reqs, self.num_kv_heads, splits)
        if order is not None:
            grid = (self.num_kv_heads, num_reqs, splits)
        _decode[grid](
            q, kv.key, kv.value, out, part_acc, part_ml,
            meta.block_tables, meta.query_start_loc, meta.seq_lens, first,
            order if order is not None else meta.seq_lens, ORDERED=order is not None,
            GROUP_PAD=max(16, triton.next_power_of_2(self.group)),
            BLOCK_N=self.DECODE_BLOCK_N if q.is_cuda else 16, NUM_SPLITS=splits, **common,
            **self._decode_launch(q),
        )  # fmt: skip
        if splits > 1:
            _combine[(num_reqs, self.num_heads)](
                out, part_acc, part_ml, meta.query_start_loc, first, out.stride(0),
                out.stride(1),
                HEAD_DIM=self.head_dim, BLOCK_D=self.block_d, NUM_SPLITS=splits,
                **launch_options(q),
            )  # fmt: skip

    def _decode_launch(self, q: torch.Tensor) -> dict[str, int | bool]:
        if not q.is_cuda:
            return {}
        return {
            "num_warps": self.DECODE_WARPS, "num_stages": self.DECODE_STAGES,
            **launch_options(q),
        }  # fmt: skip

    def _sms(self, q: torch.Tensor) -> int:
        if self._num_sms is None:
            self._num_sms = (
                torch.cuda.get_device_properties(q.device).multi_processor_count if q.is_cuda else 8
            )
        return self._num_sms
