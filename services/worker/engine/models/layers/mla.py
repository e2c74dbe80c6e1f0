"""Multi-head latent attention (MLA: DeepSeek-V2/V3) over a paged cache of latents.

A token's cache entry per layer is one vector, the same for every head and every rank:

    cache row (kv_lora_rank + qk_rope_head_dim):  | c: the normed latent | k_pe: rotated key |

Each head's key is ``[k_nope | k_pe]`` and its value ``v``, where ``k_nope | v`` is the head's
slice of ``kv_b_proj(c)``. Two ways to attend over the cache, the same math:

- the rows of a prefill chunk (several queries of one request): the request's whole context of
  latents is gathered from the paged cache and decompressed into per-head keys and values, and
  the queries (the context's last positions) attend causally, as in a dense model, through
  the model's attention backend (``AttentionBackend.attend_contiguous``);
- decode rows (the batch's trailing requests of one query each): ``kv_b_proj``'s key and
  value halves (W_UK, W_UV, derived once after loading) are absorbed into the query and the
  output, so the step reads one latent row a token instead of a key and a value a head:

      q_lat[h]    = W_UK[h] q_nope[h]                                   [kv_lora_rank]
      score[h, t] = scale · (q_lat[h] · c[t] + q_pe[h] · k_pe[t])
      out[h]      = W_UV[h] Σ_t softmax_t(score[h, t]) c[t]              [v_head_dim]

  on CUDA through the Triton kernel ``ops/mla_decode.py``, elsewhere in plain PyTorch.

DeepSeek's rotary pairs are adjacent dimensions (x0, x1), (x2, x3), ...: q_pe and k_pe are
de-interleaved to [x0, x2, ... | x1, x3, ...] and rotated "rotate half" style, which is
Hugging Face's DeepSeek-V3 arithmetic; the cache keeps k_pe in that order (q_pe and k_pe are
only ever dotted with each other, so the order is this module's business alone).

Tensor parallelism splits the heads (q_proj / q_b_proj and kv_b_proj by rows, o_proj by
columns); the latent projections are replicated, and every rank caches the whole latent.
"""

from collections.abc import Callable

import torch
from torch import nn

from services.worker.engine.attention.backend import (
    AttentionBackend,
    AttentionMetadata,
    LayerKVCache,
)
from services.worker.engine.distributed import tp_size
from services.worker.engine.model_config import ArchConfig, MLAConfig
from services.worker.engine.models.context import ModelContext
from services.worker.engine.models.layers.linear import (
    ColumnParallelLinear,
    LinearBase,
    RowParallelLinear,
)
from services.worker.engine.models.layers.norm import RMSNorm
from services.worker.engine.models.layers.rotary import RotaryEmbedding, yarn_mscale
from services.worker.engine.quantization.fp8_math import Codes

LATENT_NORM_EPS = 1e-6  # q_a_layernorm's and kv_a_layernorm's (DeepSeek's code gives none)

# (the layer, q, the latent as k and v, the step's metadata) → [tokens, heads, v_head_dim]
MLASplit = Callable[
    ["MLAAttention", torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor
]


def softmax_scale(arch: ArchConfig) -> float:
    """``qk_head_dim ** -0.5``, times YaRN's ``mscale(factor, mscale_all_dim)²`` where the
    config asks (Hugging Face's ``yarn_apply_mscale``: any scaled rope with mscale_all_dim)."""
    assert arch.mla is not None
    scale: float = arch.mla.qk_head_dim**-0.5
    rope = arch.rope
    if rope.rope_type != "default" and rope.mscale_all_dim:
        m = yarn_mscale(rope.factor, rope.mscale_all_dim)
        scale = scale * m * m
    return scale


class MLAAttention(nn.Module):
    """One decoder layer's attention; the model runner binds ``kv_cache`` (the latent view)."""

    def __init__(self, arch: ArchConfig, ctx: ModelContext):
        super().__init__()
        mla = arch.mla
        if mla is None:
            raise ValueError(f"{arch.architecture} has no kv_lora_rank: not an MLA model")
        self.mla = mla
        hidden, heads, bias = arch.hidden_size, arch.num_heads, arch.attention_bias
        self.num_heads = heads // tp_size()  # this rank's
        # what a piecewise CUDA graph's buffers are sized by (worker/piecewise_graphs.py): the
        # attention's output heads; the latent is one "KV head"
        self.num_kv_heads, self.head_dim = 1, mla.v_head_dim
        qk = mla.qk_head_dim
        self.q_proj: ColumnParallelLinear | None = None
        self.q_a_proj: LinearBase | None = None
        self.q_a_layernorm: RMSNorm | None = None
        self.q_b_proj: ColumnParallelLinear | None = None
        if mla.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(hidden, heads * qk, False, ctx.linear)
        else:
            rank = mla.q_lora_rank
            self.q_a_proj = LinearBase(hidden, rank, bias, None, ctx.linear)  # replicated
            self.q_b_proj = ColumnParallelLinear(rank, heads * qk, False, ctx.linear)
            self.q_a_layernorm = RMSNorm(rank, LATENT_NORM_EPS, ctx.kernels, feeds=self.q_b_proj)
        self.kv_a_proj_with_mqa = LinearBase(hidden, mla.cache_dim, bias, None, ctx.linear)
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS, ctx.kernels)
        kv_out = heads * (mla.qk_nope_head_dim + mla.v_head_dim)
        self.kv_b_proj = ColumnParallelLinear(mla.kv_lora_rank, kv_out, False, ctx.linear)
        self.o_proj = RowParallelLinear(heads * mla.v_head_dim, hidden, bias, ctx.linear)
        # with the engine's kernels one launch rotates q's and the latent's rotary parts in
        # place (DeepSeek's adjacent pairs written in halves), where PyTorch's ops take ~16
        self.rotary = RotaryEmbedding(mla.qk_rope_head_dim, ctx.max_positions, arch.rope,
                                      ctx.kernels, interleaved=mla.rope_interleave)  # fmt: skip
        # registered after kv_b_proj: the runner's after_load (children in order) reaches it
        # once kv_b_proj's own has run
        scale = softmax_scale(arch)
        # the prefill chunks' attention over the decompressed context: the model's backend's
        prefill = ctx.attention(self.num_heads, self.num_heads, qk, scale)
        self.attn = LatentAttention(self.num_heads, mla, scale, self.kv_b_proj, prefill)
        self.stores_kv = False  # the attention writes the latent (store_kv=True)
        self.kv_cache: LayerKVCache | None = None  # bound by the worker after cache allocation
        self.kv_group = 0  # its KV cache group (kv_cache/groups.py), bound with the cache
        # set by a piecewise CUDA graph runner while it captures or runs the forward: called in
        # place of ``attn``, and the graph splits there (as ``LlamaAttention.split``)
        self.split: MLASplit | None = None

    def kv_scales(self) -> tuple[float, float]:
        """An FP8 latent cache is refused (``EngineArgs``): no scales but 1."""
        return 1.0, 1.0

    def forward(
        self, positions: torch.Tensor, x: torch.Tensor | Codes, meta: AttentionMetadata
    ) -> torch.Tensor:
        meta = meta.group(self.kv_group)
        q, latent = self.project(positions, x)
        assert self.kv_cache is not None, "KV cache not bound"
        if self.split is not None:
            out = self.split(self, q, latent, latent, meta)
        else:
            out = self.attn.forward(q, latent, latent, self.kv_cache, meta)
        return self.o_proj(out.reshape(-1, self.num_heads * self.mla.v_head_dim))

    def project(
        self, positions: torch.Tensor, x: torch.Tensor | Codes
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(q [T, H, qk_head_dim], the cache rows [T, 1, cache_dim]), both rotated."""
        mla = self.mla
        if self.q_proj is not None:
            q = self.q_proj(x)
        else:
            assert self.q_a_proj and self.q_a_layernorm and self.q_b_proj
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(-1, self.num_heads, mla.qk_head_dim)
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        c, k_pe = self.kv_a_proj_with_mqa(x).split([mla.kv_lora_rank, mla.qk_rope_head_dim], -1)
        c = self.kv_a_layernorm(c)
        assert isinstance(c, torch.Tensor)  # (it feeds no layer: no codes)
        q_pe, k_pe = self.rotary(positions, q_pe, k_pe.unsqueeze(1))
        if not self.rotary.fused:  # (fused, q's rotary part was rotated where it lies in q)
            q = torch.cat((q_nope, q_pe), dim=-1)
        return q, torch.cat((c.unsqueeze(1), k_pe), dim=-1)


class LatentAttention(nn.Module):
    """The attention between an MLA layer's projections and its ``o_proj``, with an attention
    backend's ``forward`` signature (so a piecewise CUDA graph runner runs it between its
    pieces as it runs a backend): q [T, H, qk_head_dim], k = v = the step's cache rows
    [T, 1, cache_dim]; returns [T, H, v_head_dim]. Rows past ``query_start_loc[-1]`` are
    padding: their latents go to the slots ``slot_mapping`` names, their output is left."""

    def __init__(
        self,
        num_heads: int,
        mla: MLAConfig,
        scale: float,
        kv_b_proj: LinearBase,
        prefill: AttentionBackend,
    ):
        """``prefill``: an attention backend of this rank's heads at the keys' width, whose
        ``attend_contiguous`` attends a prefill chunk over its decompressed context (the
        FlashAttention backend's: FlashAttention-4 at DeepSeek's widths; the Triton backend's:
        its prefill kernel; PyTorch's attention on the CPU)."""
        super().__init__()
        self.num_heads, self.mla, self.scale = num_heads, mla, scale
        self.prefill = prefill
        # the up-projection of latents to this rank's heads' [k_nope | v] (a bound method:
        # kv_b_proj is the layer's child, not this one's)
        self.decompress: Callable[[torch.Tensor], torch.Tensor] = kv_b_proj.forward
        lr, heads = mla.kv_lora_rank, num_heads
        # W_UK [H, nope, Lr] and W_UVᵀ [H, Lr, v]: kv_b_proj's rows, filled by ``after_load``
        self.w_uk: torch.Tensor
        self.w_uv: torch.Tensor
        self.register_buffer("w_uk", torch.empty(heads, mla.qk_nope_head_dim, lr), False)
        self.register_buffer("w_uv", torch.empty(heads, lr, mla.v_head_dim), False)

    @torch.no_grad()
    def after_load(self) -> None:
        """Absorb: kv_b_proj's weight, read through its own product (so that any linear method
        gives it, a quantized one dequantized), split into W_UK and W_UV."""
        mla = self.mla
        eye = torch.eye(mla.kv_lora_rank, dtype=self.w_uk.dtype, device=self.w_uk.device)
        w = self.decompress(eye).view(mla.kv_lora_rank, self.num_heads, -1)  # [Lr, H, nope + v]
        w_k, w_v = w.split([mla.qk_nope_head_dim, mla.v_head_dim], dim=-1)
        self.w_uk.copy_(w_k.permute(1, 2, 0))
        self.w_uv.copy_(w_v.permute(1, 0, 2))

    def decode_graph_contexts(
        self, num_reqs: int, max_model_len: int, device: torch.device
    ) -> tuple[int, ...]:
        """One decode graph a batch size, captured for the longest context (the kernel's
        split count then suits it; a shorter context only leaves ranges empty)."""
        return (max_model_len,)

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
        cache = kv_cache.key  # [num_blocks, block_size, 1, cache_dim]; the value view is it
        if store_kv:
            write_latent(k, cache, metadata.slot_mapping[: k.shape[0]])
        if out is None:
            out = q.new_empty(q.shape[0], self.num_heads, self.mla.v_head_dim)
        qsl, lens = metadata.query_start_loc_cpu, metadata.seq_lens_cpu
        first_decode = len(lens) - metadata.num_decodes
        for i in range(first_decode):
            if qsl[i + 1] > qsl[i]:
                rows = slice(qsl[i], qsl[i + 1])
                out[rows] = self._prefill(q[rows], cache, metadata.block_tables[i], lens[i])
        if metadata.num_decodes:
            rows = slice(qsl[first_decode], qsl[-1])
            out[rows] = self._decode(q[rows], cache, metadata, first_decode)
        return out

    def _prefill(
        self, q: torch.Tensor, cache: torch.Tensor, table: torch.Tensor, seq_len: int
    ) -> torch.Tensor:
        """One request's queries, the last ``len(q)`` of its ``seq_len`` positions, over its
        whole context decompressed: [q_len, H, v_head_dim].

            context:  0 ............................. seq_len
            queries:                    | seq_len - q_len ... seq_len - 1 |
            query j sees positions 0 .. seq_len - q_len + j
        """
        mla, heads = self.mla, self.num_heads
        rows = gather_latents(cache, table, seq_len)  # [L, cache_dim]
        c, k_pe = rows.split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        # kv_b_proj's weight as ``after_load`` read it (an FP8 one dequantized), the latent
        # unrounded: the product decode's absorbed form computes, so that a token attends alike
        # in a prefill chunk and in a decode step (a resumed request equals one that was not)
        c = c.to(q.dtype)
        k_nope = torch.einsum("lr,hnr->lhn", c, self.w_uk)
        v = torch.einsum("lr,hrv->lhv", c, self.w_uv)
        k_pe = k_pe.to(q.dtype).unsqueeze(1).expand(seq_len, heads, mla.qk_rope_head_dim)
        return self.prefill.attend_contiguous(q, torch.cat((k_nope, k_pe), dim=-1), v)

    def _decode(
        self, q: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, first: int
    ) -> torch.Tensor:
        """The decode rows (requests ``first`` .. the last, one query each), absorbed:
        [D, H, v_head_dim]. Reads no device value back (a CUDA graph captures it)."""
        mla = self.mla
        q_nope, q_pe = q.split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_lat = torch.bmm(q_nope.transpose(0, 1), self.w_uk).transpose(0, 1)  # [D, H, Lr]
        tables, lens = meta.block_tables[first:], meta.seq_lens[first:]
        bound = meta.max_decode_seq_len
        if q.is_cuda:
            from services.worker.engine.ops import mla_decode

            if mla_decode.supported(q_lat, cache):
                lat = mla_decode.mla_decode(q_lat, q_pe, cache, tables, lens, self.scale,
                                            max_seq_len=bound)  # fmt: skip
                return torch.bmm(lat.transpose(0, 1), self.w_uv).transpose(0, 1)
        lat = latent_decode(q_lat, q_pe, cache, tables, lens, bound, self.scale).to(q.dtype)
        return torch.bmm(lat.transpose(0, 1), self.w_uv).transpose(0, 1)


def write_latent(rows: torch.Tensor, cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Scatter the step's cache rows [T, 1, cache_dim] to their slots (a strided view, in
    place): on a GPU one launch (``ops/attention.store_rows``)."""
    if rows.is_cuda:
        from services.worker.engine.ops.attention import store_rows

        store_rows(rows, cache, slot_mapping)
        return
    block_size = cache.shape[1]
    blocks = torch.div(slot_mapping, block_size, rounding_mode="floor")
    cache[blocks, slot_mapping % block_size] = rows.to(cache.dtype)


def gather_latents(cache: torch.Tensor, table: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The first ``seq_len`` cache rows of one request's blocks: [seq_len, cache_dim]."""
    blocks = table[: -(-seq_len // cache.shape[1])].long()
    return cache[blocks].reshape(-1, cache.shape[-1])[:seq_len]


def latent_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    max_seq_len: int,
    scale: float,
) -> torch.Tensor:
    """``ops/mla_decode.mla_decode``'s math in PyTorch, float32: every request padded to
    ``max_seq_len`` (a host bound) and masked by ``seq_lens`` on the device. [B, H, Lr].
    The padding's rows are zeroed first: a slot past a context may hold anything (a weight of
    0 times NaN is NaN)."""
    lr = q_lat.shape[-1]
    width = -(-max_seq_len // cache.shape[1])
    blocks = block_tables[:, :width].long()
    rows = cache[blocks].reshape(blocks.shape[0], -1, cache.shape[-1])[:, :max_seq_len].float()
    valid = torch.arange(rows.shape[1], device=rows.device)[None, :] < seq_lens[:, None]
    rows = rows.masked_fill(~valid[..., None], 0.0)
    scores = q_lat.float() @ rows[..., :lr].transpose(1, 2)  # [B, H, L]
    scores = (scores + q_pe.float() @ rows[..., lr:].transpose(1, 2)) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    return scores.softmax(-1) @ rows[..., :lr]
