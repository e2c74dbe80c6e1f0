"""Multi-head latent attention (MLA, DeepSeek-V2/V3) decode over the paged latent cache, with
the projections absorbed: one query a request, many query heads, and one shared cache row a
token that serves as every head's key (all of it) and value (its latent part).

    cache row of token t:  | latent c[t, :Lr] (key and value) | k_pe c[t, Lr:] (key only) |
    score[h, t] = scale * (q_lat[h] · c[t, :Lr] + q_pe[h] · c[t, Lr:])
    out[h]      = sum_t softmax_t(score[h]) * c[t, :Lr]        (the caller applies W_UV)

Two kernels (flash-decoding):

- ``_mla_split``: grid (head groups, splits, requests). A program takes BLOCK_H heads of one
  request (packed into the M dimension of its products, so a cache tile is read once for them
  all) over one range of the request's context; the head groups of one range run side by side
  and share its tiles through L2, so the cache is read from memory about once a step:

      context of request b:  | split 0 | split 1 | ... | split s: [lo, hi) | ... |
      each range per_split tokens (a multiple of BLOCK_N); the last short, some maybe empty
      token t lives in block block_tables[b, t // block_size], row t % block_size

  With one split it writes the output; otherwise each range's normalized partial output and
  its log-sum-exp (base 2) go to float32 scratch, and
- ``_mla_combine``: grid (heads, requests) merges a head's ranges by their log-sum-exp.

The grid depends only on the batch, the head count and a host bound on the context (never on
the device's ``seq_lens``), so a CUDA graph can capture a step and replay it with new lengths.
Softmax statistics and accumulators are float32. An FP8 (e4m3) cache takes one scale, folded
into the scores' scale and the output.
"""

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from services.worker.engine.ops.attention import _compute_dtype, _widen_values
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options

LOG2E = 1.4426950408889634
MAX_SPLITS = 128
TOKENS_PER_SPLIT = 256  # below this a range is too short to pay for its partial output
QUERY_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class MLALaunch:
    """How ``mla_decode`` launches (benchmarks/kernels/mla_decode.py measures alternatives)."""

    block_h: int = 16  # query heads a program takes (>= 16: the M of tl.dot)
    block_n: int = 32  # tokens a tile
    num_warps: int = 4
    num_stages: int = 2
    splits: int | None = None  # context ranges a request is cut into; None: ``num_splits``


def default_launch(q_lat: torch.Tensor, cache: torch.Tensor) -> MLALaunch:
    """The launch ``mla_decode`` takes when given none. As compiled for sm_90 (Lr 512, R 64,
    bf16 queries): 16 heads a program in 4 warps is 208 registers a thread (241 over e4m3),
    no spills, 55 KiB of shared memory, on mma.sync; 64 heads in 8 warps is the shape that
    Triton gives Hopper's wgmma (218 registers, no spills, 144 KiB), taken at 64 heads or
    more, where a step is compute-bound (a token's 1,152 bytes meet 2 × heads × 1,088 FLOPs),
    except over e4m3 (it spills there). 64 tokens a tile spills at 16 heads. Not yet timed
    on a GPU: benchmarks/kernels/mla_decode.py --sweep measures the alternatives."""
    if not q_lat.is_cuda:
        return MLALaunch(block_n=16)  # Triton's interpreter: small tiles run fastest
    if q_lat.shape[1] >= 64 and cache.dtype != torch.float8_e4m3fn:
        return MLALaunch(block_h=64, block_n=32, num_warps=8, num_stages=2)
    return MLALaunch()


def supported(q_lat: torch.Tensor, cache: torch.Tensor) -> bool:
    """Whether ``mla_decode`` takes these on the GPU: CUDA tensors, queries in float32, float16
    or bfloat16, a cache in the queries' dtype or e4m3, rows contiguous. (On CPU it runs only
    in Triton's interpreter; a layer takes ``mla_decode_reference`` there.)"""
    return (
        q_lat.is_cuda
        and cache.is_cuda
        and q_lat.dtype in QUERY_DTYPES
        and cache.dtype in (q_lat.dtype, torch.float8_e4m3fn)
        and cache.stride(-1) == 1
    )


def num_splits(num_reqs: int, head_groups: int, max_seq_len: int, num_sms: int) -> int:
    """A power of two: enough programs to fill the GPU's ``num_sms`` once, no range shorter
    than ``TOKENS_PER_SPLIT`` tokens, at most ``MAX_SPLITS``."""
    splits = 1
    while (
        splits < MAX_SPLITS
        and num_reqs * head_groups * splits < num_sms
        and max_seq_len >= 2 * splits * TOKENS_PER_SPLIT
    ):
        splits *= 2
    return splits


def mla_decode(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    kv_scale: float = 1.0,
    launch: MLALaunch | None = None,
) -> torch.Tensor:
    """Absorbed-MLA decode attention of one query per request (see the module docstring).

    q_lat [B, H, Lr] (q_nope times W_UK) and q_pe [B, H, R]; cache [num_blocks, block_size, 1,
    Lr + R], any strides but a contiguous last dimension (one layer's view of the shared
    cache); block_tables int32 [B, max_blocks]; seq_lens int32 [B]: each request's tokens in
    the cache, this step's included. ``max_seq_len`` bounds ``seq_lens`` on the host and
    fixes the split count (None: the block table's capacity); nothing reads device values
    back, so the call can be captured in a CUDA graph. ``kv_scale``: an e4m3 cache's scale.
    Returns ``out`` [B, H, Lr] (allocated when None) in q_lat's dtype."""
    batch, heads, lr = q_lat.shape
    r = q_pe.shape[2]
    if cache.shape[-1] != lr + r or q_lat.stride(-1) != 1 or q_pe.stride(-1) != 1:
        raise ValueError("mla_decode needs cache rows of Lr + R and contiguous query rows")
    if cache.stride(-1) != 1:
        raise ValueError("mla_decode needs a contiguous cache row")
    if out is None:
        out = torch.empty_like(q_lat)
    launch = launch or default_launch(q_lat, cache)
    block_size = cache.shape[1]
    if max_seq_len is None:
        max_seq_len = block_tables.shape[1] * block_size
    groups = triton.cdiv(heads, launch.block_h)
    splits = launch.splits or num_splits(batch, groups, max_seq_len, _sms(q_lat.device))
    if splits & (splits - 1):
        raise ValueError(f"the split count must be a power of two, not {splits}")
    if batch == 0:
        return out
    block_l = max(16, triton.next_power_of_2(lr))
    part_out = part_lse = out  # placeholders, unused with one split
    if splits > 1:
        part_out = torch.empty((batch, heads, splits, block_l), dtype=torch.float32,
                               device=q_lat.device)  # fmt: skip
        part_lse = torch.empty((batch, heads, splits), dtype=torch.float32, device=q_lat.device)
    pdl = launch_options(q_lat)
    gpu = {"num_warps": launch.num_warps, "num_stages": launch.num_stages} if q_lat.is_cuda else {}
    _mla_split[(groups, splits, batch)](
        q_lat, q_pe, cache, out, part_out, part_lse, block_tables, seq_lens,
        q_lat.stride(0), q_lat.stride(1), q_pe.stride(0), q_pe.stride(1),
        out.stride(0), out.stride(1), cache.stride(0), cache.stride(1), block_tables.stride(0),
        scale * LOG2E * kv_scale, kv_scale, heads,
        KV_BLOCK=block_size, LR=lr, R=r, BLOCK_L=block_l,
        BLOCK_R=max(16, triton.next_power_of_2(r)), BLOCK_H=launch.block_h,
        BLOCK_N=launch.block_n, NUM_SPLITS=splits,
        PRECISION="ieee" if q_lat.dtype == torch.float32 else "tf32",
        # bf16 queries over an e4m3 cache: float16 products, which e4m3 widens to directly
        DOT_F16=cache.dtype == torch.float8_e4m3fn and q_lat.dtype == torch.bfloat16,
        GPU=q_lat.is_cuda, **gpu, **pdl,
    )  # fmt: skip
    if splits > 1:
        _mla_combine[(heads, batch)](
            out, part_out, part_lse, out.stride(0), out.stride(1), heads,
            LR=lr, BLOCK_L=block_l, NUM_SPLITS=splits, CHUNK=min(splits, 16), **pdl,
        )  # fmt: skip
    return out


def mla_decode_reference(
    q_lat: torch.Tensor,
    q_pe: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    out: torch.Tensor | None = None,
    max_seq_len: int | None = None,
    kv_scale: float = 1.0,
) -> torch.Tensor:
    """``mla_decode`` in plain PyTorch, float32, a request at a time: the oracle. (It reads
    ``seq_lens`` back to the host; ``max_seq_len`` is accepted and unused.)"""
    lr = q_lat.shape[2]
    block_size = cache.shape[1]
    result = torch.empty(q_lat.shape, dtype=torch.float32, device=q_lat.device)
    for b, n in enumerate(seq_lens.tolist()):
        blocks = block_tables[b, : -(-n // block_size)].long()
        rows = cache[blocks, :, 0].reshape(-1, cache.shape[-1])[:n].float() * kv_scale
        scores = q_lat[b].float() @ rows[:, :lr].T + q_pe[b].float() @ rows[:, lr:].T
        result[b] = (scores * scale).softmax(-1) @ rows[:, :lr]
    if out is None:
        return result.to(q_lat.dtype)
    return out.copy_(result)


@functools.cache
def _sms(device: torch.device) -> int:
    if device.type != "cuda":
        return 8  # Triton's interpreter: a small machine, so tests see several splits
    return torch.cuda.get_device_properties(device).multi_processor_count


@triton.jit(do_not_specialize=["stride_bt"])
def _mla_split(
    QL, QP, C, Out, part_out, part_lse, block_tables, seq_lens,
    stride_qlb, stride_qlh, stride_qpb, stride_qph, stride_ob, stride_oh,
    stride_cb, stride_cs, stride_bt, qk_scale, v_scale, num_heads,
    KV_BLOCK: tl.constexpr, LR: tl.constexpr, R: tl.constexpr, BLOCK_L: tl.constexpr,
    BLOCK_R: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, PRECISION: tl.constexpr, DOT_F16: tl.constexpr = False,
    GPU: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    await_inputs(USE_PDL)
    split = tl.program_id(1)
    req = tl.program_id(2).to(tl.int64)
    seq_len = tl.load(seq_lens + req)
    per_split = tl.cdiv(tl.cdiv(seq_len, NUM_SPLITS), BLOCK_N) * BLOCK_N
    lo = split * per_split
    hi = tl.minimum(seq_len, lo + per_split)

    heads = tl.program_id(0) * BLOCK_H + tl.arange(0, BLOCK_H)
    offs_l = tl.arange(0, BLOCK_L)
    offs_r = tl.arange(0, BLOCK_R)
    h_ok = heads < num_heads
    l_ok = offs_l < LR
    r_ok = offs_r < R
    q_lat = tl.load(QL + req * stride_qlb + heads[:, None] * stride_qlh + offs_l[None, :],
                    mask=h_ok[:, None] & l_ok[None, :], other=0.0)  # fmt: skip
    q_pe = tl.load(QP + req * stride_qpb + heads[:, None] * stride_qph + offs_r[None, :],
                   mask=h_ok[:, None] & r_ok[None, :], other=0.0)  # fmt: skip
    q_lat, q_pe = _compute_dtype(q_lat, DOT_F16), _compute_dtype(q_pe, DOT_F16)
    table = block_tables + req * stride_bt
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], tl.float32)
    for start in range(lo, hi, BLOCK_N):
        offs_n = start + tl.arange(0, BLOCK_N)
        n_ok = offs_n < hi
        block = tl.load(table + offs_n // KV_BLOCK, mask=n_ok, other=0).to(tl.int64)
        rows = C + block * stride_cb + (offs_n % KV_BLOCK) * stride_cs
        # masked rows load zeros: a free cache slot may hold anything, NaN included
        latent = tl.load(rows[:, None] + offs_l[None, :], mask=n_ok[:, None] & l_ok[None, :],
                         other=0.0)  # fmt: skip
        latent = _widen_values(latent, q_lat.dtype, GPU)  # an e4m3 cache's, in PTX on a GPU
        k_pe = tl.load(rows[:, None] + LR + offs_r[None, :], mask=n_ok[:, None] & r_ok[None, :],
                       other=0.0).to(q_lat.dtype)  # fmt: skip
        s = tl.dot(q_lat, tl.trans(latent), input_precision=PRECISION)
        s = tl.dot(q_pe, tl.trans(k_pe), s, input_precision=PRECISION)
        # every tile has a token below hi (start < hi), so m_new is finite
        s = tl.where(n_ok[None, :], s * qk_scale, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        p = tl.exp2(s - m_new[:, None])
        alpha = tl.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p.to(latent.dtype), latent, input_precision=PRECISION)
        m_i = m_new
    safe_l = tl.where(l_i == 0.0, 1.0, l_i)  # an empty range (or request) gives zeros
    result = acc * (v_scale / safe_l)[:, None]
    if NUM_SPLITS == 1:
        tl.store(Out + req * stride_ob + heads[:, None] * stride_oh + offs_l[None, :],
                 result.to(Out.dtype.element_ty), mask=h_ok[:, None] & l_ok[None, :])  # fmt: skip
    else:
        # scratch [requests, heads, splits, BLOCK_L] and [requests, heads, splits]
        slot = (req * num_heads + heads) * NUM_SPLITS + split
        tl.store(part_out + slot[:, None] * BLOCK_L + offs_l[None, :], result,
                 mask=h_ok[:, None])  # fmt: skip
        lse = tl.where(l_i == 0.0, float("-inf"), m_i + tl.log2(safe_l))
        tl.store(part_lse + slot, lse, mask=h_ok)


@triton.jit
def _mla_combine(
    Out, part_out, part_lse, stride_ob, stride_oh, num_heads,
    LR: tl.constexpr, BLOCK_L: tl.constexpr, NUM_SPLITS: tl.constexpr, CHUNK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    await_inputs(USE_PDL)
    head = tl.program_id(0)
    req = tl.program_id(1).to(tl.int64)
    offs_l = tl.arange(0, BLOCK_L)
    first = (req * num_heads + head) * NUM_SPLITS  # this head's ranges in the scratch
    every = tl.load(part_lse + first + tl.arange(0, NUM_SPLITS))
    top = tl.max(every, 0)
    total = tl.sum(tl.where(every == float("-inf"), 0.0, tl.exp2(every - top)), 0)
    acc = tl.zeros([BLOCK_L], tl.float32)
    for start in range(0, NUM_SPLITS, CHUNK):  # CHUNK ranges at a time: bounded registers
        slot = first + start + tl.arange(0, CHUNK)
        lse = tl.load(part_lse + slot)
        w = tl.where(lse == float("-inf"), 0.0, tl.exp2(lse - top))  # empty ranges: nothing
        parts = tl.load(part_out + slot[:, None] * BLOCK_L + offs_l[None, :])
        acc += tl.sum(parts * w[:, None], 0)
    result = acc / tl.where(total == 0.0, 1.0, total)
    tl.store(Out + req * stride_ob + head * stride_oh + offs_l, result.to(Out.dtype.element_ty),
             mask=offs_l < LR)  # fmt: skip
