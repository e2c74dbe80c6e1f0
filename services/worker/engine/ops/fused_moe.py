"""A mixture-of-experts layer's experts in Triton: every (token, slot) pair of the router's
top-k multiplied by its expert's weights, grouped by expert so each expert's rows meet its
weights on the tensor cores, in four launches (six with FP8) and no host sync, which CUDA
graphs capture.

    align      the pairs sorted by local expert into runs padded to BLOCK_M rows (below)
    GEMM 1     each M-block's token rows of x times its expert's gate and up rows, two float32
               accumulators, silu(gate) · up in the epilogue → h [T·k, I] (gpt-oss: the gate
               and up biases added, its clamped SwiGLU in place of SiLU·mul)
    GEMM 2     h's rows times the expert's w2 (+ its down bias), each row times its routing
               weight → y [T·k, H]
    sum        out[t] = Σ_j y[t·k + j] over the token's local slots, in slot order (deterministic)

The align step's layout (``BLOCK_M`` = 4; expert 0 has pairs 3 and 6, expert 1 none, expert 2
pairs 0, 1, 5, 7 and 8; ``·`` = the sentinel T·k, a padding row):

    sorted_ids    | 3  6  ·  · | 0  1  5  7 | 8  ·  ·  · |  (unwritten up to max_blocks · 4)
    block_expert  |     0      |     2      |     2      |
    num_padded = 12: the programs of M-blocks from 12 / BLOCK_M on return at once

At a few tokens (``GEMV_TOKENS``) the pairs are too few to fill an M-block and the layer is a
read of the chosen experts' weights: ``ops/moe_gemv.py`` runs it as two matrix-vector launches
instead, with no align step and no slot sum, rounding at the same points
(``ops/moe_common.py``).

A pair's row of x is ``pair // k``; its rows of h and y are ``pair``. Pairs whose expert is not
on this rank (``expert_map`` → -1) are in no run and add nothing: the layer all-reduces after.
At a few tokens the grid holds only the chosen experts' blocks, so only their weights are read.

FP8 (e4m3 weights, a float32 scale per output channel or per 128 × 128 block): x is quantized
once per token (``fp8_linear.quantize_rows``) or per token and 128 columns
(``fp8_block.quantize_groups``), h likewise (by GEMM 1's epilogue where a tile's gate columns
are one block, else by a pass after it), exactly as ``fp8_math.quantize_activations`` rounds
for the dense layers; the tensor cores multiply codes and the sums are float32, promoted a K
tile at a time. ``fused_moe_reference`` is the plain-PyTorch oracle, one GEMM per expert.
"""

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from services.worker.engine.ops.fp8_block import group_codes_out
from services.worker.engine.ops.fp8_linear import _quantize, _scale_of
from services.worker.engine.ops.moe_common import (
    TL_DTYPES,
    activate,
    operand,
    quantize_input,
    weight_scales,
    weighted,
)
from services.worker.engine.ops.moe_gemv import moe_gemv
from services.worker.engine.quantization.fp8_math import (
    FP8,
    Codes,
    dequantize,
    quantize_activations,
)

# the most tokens the GEMV path takes by default (its pairs read their experts apart: two tokens
# that chose one expert read it twice, through L2). On an H100 at Qwen3-30B-A3B's expert shape,
# the GEMVs' tiles tuned per token count (benchmarks/moe_layer.py; docs/results/h100-2026-12-05d):
# bf16 0.0445 / 0.0678 / 0.110 ms at 1 / 2 / 4 tokens against the grouped GEMMs' 0.0482 /
# 0.0729 / 0.1168 (level at 8 in an earlier run); FP8 blocks 0.0369 / 0.0517 / 0.0811 against
# 0.0430 / 0.0556 / 0.0809
GEMV_TOKENS = 4


@dataclass(frozen=True, slots=True)
class MoELaunch:
    """One call's tiles: both GEMMs take ``block_m`` rows of one expert a program (the align
    step pads each expert's run to it) and ``block_n`` of its weight rows: GEMM 2 that many
    output columns, GEMM 1 half as many gate and as many up rows (one tile of vLLM's unfused
    GEMM 1, whose tuned launches carry over)."""

    block_m: int
    block_n: int
    block_k: int  # FP8 block checkpoints: the block (a K tile is one scale group)
    num_warps: int = 4
    num_stages: int = 3


# (most tokens, launch): the first row whose bound is at least T. Taken from vLLM's tuned
# launches on an H200 for this expert shape (Qwen3-30B-A3B: E 128, H 2048, I 768; its
# configs/E=128,N=768,device_name=NVIDIA_H200[,dtype=fp8_w8a8,block_shape=[128,128]].json),
# not yet measured with these kernels: ``benchmarks/moe_layer.py --sweep`` does
_TABLE_16BIT = [
    (1, MoELaunch(16, 64, 64, 4, 5)),
    (32, MoELaunch(16, 64, 128, 4, 3)),
    (128, MoELaunch(16, 128, 128, 4, 2)),
    (256, MoELaunch(32, 256, 128, 4, 2)),
    (512, MoELaunch(64, 128, 64, 4, 3)),
    (math.inf, MoELaunch(128, 256, 64, 8, 4)),
]
_TABLE_FP8 = [
    (128, MoELaunch(16, 128, 128, 4, 3)),
    (math.inf, MoELaunch(64, 128, 128, 4, 4)),
]


def launch_for(tokens: int, w13: torch.Tensor, block: int | None) -> MoELaunch:
    """The table's tiles for ``tokens`` and these weights (FP8 block checkpoints: K tiles of
    one block; float32, the tests' dtype: small tiles, whose stages fit in shared memory; in
    Triton's interpreter, small fixed tiles)."""
    if not w13.is_cuda or w13.dtype == torch.float32:
        return MoELaunch(16, 32, block or 32, num_stages=2)
    table = _TABLE_FP8 if w13.dtype == FP8 else _TABLE_16BIT
    config = next(c for bound, c in table if tokens <= bound)
    if block is not None and config.block_k != block:
        config = MoELaunch(config.block_m, config.block_n, block, config.num_warps,
                           config.num_stages)  # fmt: skip
    return config


@dataclass(frozen=True, slots=True)
class Alignment:
    """The pairs grouped by expert (``_align_kernel``; the module docstring draws it)."""

    sorted_ids: torch.Tensor  # int32 [max_blocks · block_m]: pair indices, T·k = padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the local expert of each M-block
    num_padded: torch.Tensor  # int32 [1]: rows in use (a multiple of block_m)
    max_blocks: int  # the grid's M-blocks: T·k + min(E, T·k)·(block_m − 1) rows at most
    block_m: int


@triton.jit
def _local_expert(IDS, MAP, pairs, n_pairs, HAS_MAP: tl.constexpr):
    """The local expert of each pair (−1: not on this rank or past the pairs)."""
    ok = pairs < n_pairs
    e = tl.load(IDS + pairs, mask=ok, other=0).to(tl.int32)
    if HAS_MAP:
        e = tl.load(MAP + e, mask=ok, other=-1)
    return tl.where(ok, e, -1)


@triton.jit
def _align_kernel(
    IDS, MAP, SORTED, BLOCK_EXPERT, NUM_PADDED, CURSOR, n_pairs, E, max_blocks,
    HAS_MAP: tl.constexpr, BLOCK_M: tl.constexpr, BINS: tl.constexpr, CHUNK: tl.constexpr,
):  # fmt: skip
    """One program: count each expert's pairs, lay out the padded runs, fill them with the
    sentinel, then place each pair at its expert's cursor (an atomic a pair: the order within
    a run varies between runs, the rows' results do not)."""
    bins = tl.arange(0, BINS)
    counts = tl.zeros([BINS], tl.int32)
    for c0 in range(0, n_pairs, CHUNK):
        e = _local_expert(IDS, MAP, c0 + tl.arange(0, CHUNK), n_pairs, HAS_MAP)
        counts += tl.histogram(tl.maximum(e, 0), BINS, mask=e >= 0)
    padded = tl.where(bins < E, (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M, 0)
    ends = tl.cumsum(padded, 0)
    total = tl.max(ends, 0)
    tl.store(NUM_PADDED, total)
    tl.store(CURSOR + bins, ends - padded)  # each run's first row
    for b0 in range(0, max_blocks, CHUNK // 16):  # a block's expert: the runs ending before it
        b = b0 + tl.arange(0, CHUNK // 16)
        before = (ends[None, :] <= (b * BLOCK_M)[:, None]).to(tl.int32)
        tl.store(BLOCK_EXPERT + b, tl.sum(before, axis=1), mask=b < max_blocks)
    for p0 in range(0, total, CHUNK):
        p = p0 + tl.arange(0, CHUNK)
        tl.store(SORTED + p, n_pairs, mask=p < total)
    tl.debug_barrier()  # the sentinels and cursors written before any pair is placed
    for c0 in range(0, n_pairs, CHUNK):
        pairs = c0 + tl.arange(0, CHUNK)
        e = _local_expert(IDS, MAP, pairs, n_pairs, HAS_MAP)
        dest = tl.atomic_add(CURSOR + tl.maximum(e, 0), 1, mask=e >= 0)
        tl.store(SORTED + dest, pairs, mask=e >= 0)


def align(
    topk_ids: torch.Tensor, expert_map: torch.Tensor | None, num_experts: int, block_m: int
) -> Alignment:
    """The (token, slot) pairs of ``topk_ids`` [T, k] grouped by local expert, each run padded
    to ``block_m`` rows: one Triton launch, no host sync."""
    ids = topk_ids.reshape(-1)
    n = ids.numel()
    max_blocks = triton.cdiv(n + min(num_experts, n) * (block_m - 1), block_m)
    dev = ids.device
    out = Alignment(
        torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev),
        torch.empty(max_blocks, dtype=torch.int32, device=dev),
        torch.empty(1, dtype=torch.int32, device=dev), max_blocks, block_m,
    )  # fmt: skip
    bins = triton.next_power_of_2(num_experts + 1)
    cursor = torch.empty(bins, dtype=torch.int32, device=dev)
    chunk = max(256, min(1024, triton.next_power_of_2(n)))
    _align_kernel[(1,)](
        ids, expert_map if expert_map is not None else ids, out.sorted_ids, out.block_expert,
        out.num_padded, cursor, n, num_experts, max_blocks, HAS_MAP=expert_map is not None,
        BLOCK_M=block_m, BINS=bins, CHUNK=chunk, num_warps=8 if dev.type == "cuda" else 1,
    )  # fmt: skip
    return out


@triton.jit
def _dot(a, w, acc, IEEE: tl.constexpr, BLOCK_K: tl.constexpr):
    """acc + a·w in float32: float32 inputs exactly (not TF32), FP8 sums promoted once a K
    tile (cuBLASLt's precise mode, as ``fp8_linear.fp8_gemm`` without fast accumulation)."""
    if a.dtype.is_fp8():
        return tl.dot(a, w, acc, max_num_imprecise_acc=BLOCK_K)
    if IEEE:
        return tl.dot(a, w, acc, input_precision="ieee")
    return tl.dot(a, w, acc)


@triton.jit
def _moe_gemm_kernel(
    A, AS, W, WS, C, CS, SORTED, BLOCK_EXPERT, NUM_PADDED, WEIGHTS, BIAS,
    N, K, n_pairs, row_div, up_rows, stride_am, stride_asm, stride_asg, stride_we, stride_wn,
    stride_wse, stride_wsn, stride_wsk, stride_cm, stride_csm, stride_csg, stride_be,
    alpha, limit,
    GATED: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, QUANT_OUT: tl.constexpr,
    IEEE: tl.constexpr, GPU: tl.constexpr, DTYPE: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):  # fmt: skip
    """One M-block of one expert × BLOCK_N output columns. A's row of pair p is p // row_div
    (x: the token; h: the pair); W [E, rows, K] (GATED: gate rows n, up rows up_rows + n).
    FP8: A and W are codes, AS the rows' scales (a column per GROUP columns, or one) and WS
    the expert's ([E, rows, 1], or a scale per GROUP × GROUP block). GATED: C[p] = silu(gate)
    · up, rounded where the dense SiLU·mul rounds (with QUANT_OUT: its codes, the tile one
    group, and their scales to CS); else C[p] = (A·Wᵀ)[p] · WEIGHTS[p], each rounded to C's
    dtype as Hugging Face's experts round. ``HAS_BIAS``: the expert's bias row (BIAS [E, rows])
    added to the product before it is rounded; ``CLAMPED``: gpt-oss's SwiGLU in place of SiLU·mul
    (gate ≤ limit, |up| ≤ limit, (up + 1) · gate · σ(alpha · gate)), rounded where
    ``FusedMoE.activate`` rounds."""
    n_tiles = tl.cdiv(N, BLOCK_N)
    pid_m, pid_n = tl.program_id(0) // n_tiles, tl.program_id(0) % n_tiles
    if pid_m * BLOCK_M >= tl.load(NUM_PADDED):
        return
    expert = tl.load(BLOCK_EXPERT + pid_m).to(tl.int64)
    pairs = tl.load(SORTED + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
    m_ok = pairs < n_pairs
    a_rows = (pairs // row_div).to(tl.int64)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    rk = tl.arange(0, BLOCK_K)
    a_ptrs = A + a_rows[:, None] * stride_am + rk[None, :]
    w_ptrs = W + expert * stride_we + rn[None, :].to(tl.int64) * stride_wn + rk[:, None]
    ws_ptrs = WS + expert * stride_wse
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)  # (GATED only)
    for k0 in range(0, K, BLOCK_K):
        k_ok = (k0 + rk) < K
        a = tl.load(a_ptrs, mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if GROUP:  # block checkpoints: each K tile's product times its two scales
            g = k0 // GROUP
            xs = tl.load(AS + a_rows * stride_asm + g * stride_asg, mask=m_ok, other=0.0)
            ws = tl.load(ws_ptrs + (rn // GROUP) * stride_wsn + g * stride_wsk, mask=n_ok,
                         other=0.0)  # fmt: skip
            acc += _dot(a, w, tl.zeros_like(acc), IEEE, BLOCK_K) * (xs[:, None] * ws[None, :])
        else:
            acc = _dot(a, w, acc, IEEE, BLOCK_K)
        if GATED:
            w = tl.load(w_ptrs + up_rows * stride_wn, mask=k_ok[:, None] & n_ok[None, :],
                        other=0.0)  # fmt: skip
            if GROUP:
                ws = tl.load(ws_ptrs + ((up_rows + rn) // GROUP) * stride_wsn + g * stride_wsk,
                             mask=n_ok, other=0.0)  # fmt: skip
                acc_up += _dot(a, w, tl.zeros_like(acc), IEEE, BLOCK_K) * (
                    xs[:, None] * ws[None, :]
                )
            else:
                acc_up = _dot(a, w, acc_up, IEEE, BLOCK_K)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if FP8 and not GROUP:  # per channel: the row's and the column's scale, once
        xs = tl.load(AS + a_rows * stride_asm, mask=m_ok, other=0.0)[:, None]
        acc *= xs * tl.load(ws_ptrs + rn * stride_wsn, mask=n_ok, other=0.0)[None, :]
        if GATED:
            up_ws = tl.load(ws_ptrs + (up_rows + rn) * stride_wsn, mask=n_ok, other=0.0)
            acc_up *= xs * up_ws[None, :]
    if HAS_BIAS:
        b_ptrs = BIAS + expert * stride_be + rn
        acc += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if GATED:
            acc_up += tl.load(b_ptrs + up_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    _moe_epilogue(acc, acc_up, pairs, m_ok, rn, n_ok, pid_n, C, CS, WEIGHTS, stride_cm,
                  stride_csm, stride_csg, alpha, limit, GATED, QUANT_OUT, GPU, DTYPE,
                  CLAMPED)  # fmt: skip


@triton.jit
def _moe_epilogue(
    acc, acc_up, pairs, m_ok, rn, n_ok, pid_n, C, CS, WEIGHTS, stride_cm, stride_csm, stride_csg,
    alpha, limit, GATED: tl.constexpr, QUANT_OUT: tl.constexpr, GPU: tl.constexpr,
    DTYPE: tl.constexpr, CLAMPED: tl.constexpr,
):  # fmt: skip
    """The tile's outputs to their pairs' rows of C (see ``_moe_gemm_kernel``)."""
    if GATED:
        y = activate(acc, acc_up, alpha, limit, DTYPE, CLAMPED)
    else:
        y = weighted(acc, tl.load(WEIGHTS + pairs, mask=m_ok, other=0.0)[:, None], DTYPE)
    ok = m_ok[:, None] & n_ok[None, :]
    c_ptrs = C + pairs[:, None].to(tl.int64) * stride_cm + rn[None, :]
    if QUANT_OUT:  # the tile's columns are one group: per token and group, as quantize_groups
        y = tl.where(ok, y.to(tl.float32), 0.0)
        xs = _scale_of(tl.max(tl.abs(y), 1))
        codes = _quantize(y, xs[:, None], tl.math.div_rn(1.0, xs)[:, None], GPU)
        tl.store(c_ptrs, codes, mask=ok)
        tl.store(CS + pairs.to(tl.int64) * stride_csm + pid_n * stride_csg, xs, mask=m_ok)
    else:
        tl.store(c_ptrs, y, mask=ok)


@triton.jit
def _sum_slots_kernel(
    Y, IDS, MAP, OUT, H, top_k, stride_ym, stride_out,
    HAS_MAP: tl.constexpr, BLOCK_H: tl.constexpr,
):  # fmt: skip
    """out[t] = Σ_j Y[t·k + j] over the token's slots on this rank, in slot order."""
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = cols < H
    acc = tl.zeros([BLOCK_H], tl.float32)
    for j in range(top_k):
        e = tl.load(IDS + t * top_k + j).to(tl.int32)
        if HAS_MAP:
            e = tl.load(MAP + e)
        y = tl.load(Y + (t * top_k + j) * stride_ym + cols, mask=ok & (e >= 0), other=0.0)
        acc += y.to(tl.float32)
    tl.store(OUT + t * stride_out + cols, acc.to(OUT.dtype.element_ty), mask=ok)


def supported(x: torch.Tensor, w13: torch.Tensor) -> bool:
    """The kernels take these: CUDA tensors, x [T, H] in bf16, fp16 or float32, w13 [E, 2I, H]
    in x's dtype or e4m3 (FP8 tensor cores: compute capability 8.9 and up)."""
    if not (x.is_cuda and w13.is_cuda) or x.dim() != 2 or w13.dim() != 3:
        return False
    if x.dtype not in TL_DTYPES or w13.shape[2] != x.shape[1] or w13.shape[1] % 2:
        return False
    if w13.dtype == FP8:
        return torch.cuda.get_device_capability(x.device) >= (8, 9)
    return w13.dtype == x.dtype


def fused_moe(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: int | None = None,
    out: torch.Tensor | None = None,
    config: MoELaunch | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
    gemv: bool | None = None,
) -> torch.Tensor:
    """out[t] = Σ_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t]) over this rank's experts,
    expert(x) = w2 · (silu(gate · x) · (up · x)), in x's dtype (the module docstring has the
    steps; ``fused_moe_reference`` the arithmetic). gpt-oss's experts: ``w13_bias`` [E, 2I] and
    ``w2_bias`` [E, H] added to each product, and with ``swiglu_limit`` its clamped SwiGLU
    ((up + 1) · gate · σ(``swiglu_alpha`` · gate), gate ≤ limit, |up| ≤ limit) for SiLU·mul.

    x [T, H]; w13 [E, 2I, H] (gate rows, then up rows) and w2 [E, H, I], in x's dtype or e4m3
    with ``w13_scale``/``w2_scale``: a scale per output channel ([E, 2I, 1], [E, H, 1]) or, with
    ``block``, per block × block ([E, ⌈2I/b⌉, ⌈H/b⌉], [E, ⌈H/b⌉, ⌈I/b⌉]). topk_ids [T, k]:
    global expert ids; ``expert_map`` (int32 [E_global]) maps them to rows of w13/w2, −1 for
    experts on other ranks. ``config``: the grouped GEMMs' tiles (``launch_for``'s by default).
    ``gemv``: the few-token path (two GEMV launches) or the grouped GEMMs; by default the GEMVs
    up to ``GEMV_TOKENS`` tokens unless ``config`` is given."""
    t, hidden = x.shape
    num_experts, top_k = w13.shape[0], topk_ids.shape[1]
    out = out if out is not None else torch.empty_like(x)
    if t == 0:
        return out
    fp8 = w13.dtype == FP8
    if gemv if gemv is not None else (config is None and t <= GEMV_TOKENS):
        return moe_gemv(x, w13, w2, topk_weights, topk_ids, expert_map, w13_scale, w2_scale,
                        block if fp8 else None, out, w13_bias, w2_bias, swiglu_limit,
                        swiglu_alpha)  # fmt: skip
    config = config or launch_for(t, w13, block if fp8 else None)
    al = align(topk_ids, expert_map, num_experts, config.block_m)
    pairs = t * top_k
    inter = w2.shape[2]
    h: torch.Tensor | Codes
    if fp8 and block is not None and config.block_n // 2 == block:  # GEMM 1 writes h's codes
        h = group_codes_out(pairs, inter, block, x)
    elif fp8 and expert_map is not None:  # (the pairs of other ranks' experts, which GEMM 1
        # never writes, are quantized with the rest below: zeros, not whatever was there)
        h = torch.zeros((pairs, inter), dtype=x.dtype, device=x.device)
    else:
        h = torch.empty((pairs, inter), dtype=x.dtype, device=x.device)
    a = quantize_input(x, block) if fp8 else x
    weights = topk_weights.reshape(-1).float()
    act = (swiglu_alpha, swiglu_limit)
    _gemm(al, a, w13, w13_scale, h, weights, row_div=top_k, gated=True, block=block,
          config=config, bias=w13_bias, act=act)  # fmt: skip
    if fp8 and isinstance(h, torch.Tensor):
        h = quantize_input(h, block)
    y = torch.empty((pairs, hidden), dtype=x.dtype, device=x.device)
    _gemm(al, h, w2, w2_scale, y, weights, row_div=1, gated=False, block=block, config=config,
          bias=w2_bias)  # fmt: skip
    block_h = min(1024, triton.next_power_of_2(hidden))
    ids = topk_ids.contiguous()
    _sum_slots_kernel[(t, triton.cdiv(hidden, block_h))](
        y, ids, expert_map if expert_map is not None else ids, out, hidden, top_k, y.stride(0),
        out.stride(0), HAS_MAP=expert_map is not None, BLOCK_H=block_h,
    )  # fmt: skip
    return out


def _gemm(
    al: Alignment,
    a: torch.Tensor | Codes,
    w: torch.Tensor,
    w_scale: torch.Tensor | None,
    c: torch.Tensor | Codes,
    weights: torch.Tensor,
    *,
    row_div: int,
    gated: bool,
    block: int | None,
    config: MoELaunch,
    bias: torch.Tensor | None = None,
    act: tuple[float, float | None] = (1.0, None),
) -> None:
    """One of the two GEMMs over the aligned pairs: GEMM 1 (``gated``, ``row_div`` = k: A's
    rows are tokens, W's rows gate then up; ``act``: (alpha, limit) of a clamped SwiGLU, limit
    None for SiLU·mul) or GEMM 2 (``row_div`` 1: A's rows are pairs)."""
    n, k = (w.shape[1] // 2 if gated else w.shape[1]), w.shape[2]
    block_n = config.block_n // 2 if gated else config.block_n  # (output columns)
    aq, a_scales, a_scale_strides = operand(a)
    cq, c_scales, c_scale_strides = operand(c)
    assert aq.stride(-1) == 1 and w.stride(-1) == 1 and cq.stride(-1) == 1, "rows contiguous"
    dtype = a.dtype  # (x's: Codes keep it)
    ws, ws_strides = weight_scales(w, w_scale)
    group = (block or 0) if isinstance(a, Codes) else 0
    grid = (al.max_blocks * triton.cdiv(n, block_n),)
    _moe_gemm_kernel[grid](
        aq, a_scales, w, ws, cq, c_scales, al.sorted_ids, al.block_expert, al.num_padded,
        weights, bias if bias is not None else weights, n, k, weights.numel(), row_div, n,
        aq.stride(0), *a_scale_strides, w.stride(0), w.stride(1), *ws_strides, cq.stride(0),
        *c_scale_strides, bias.stride(0) if bias is not None else 0, float(act[0]),
        float(act[1] if act[1] is not None else 0.0),
        GATED=gated, FP8=isinstance(a, Codes), GROUP=group,
        QUANT_OUT=isinstance(c, Codes), IEEE=dtype == torch.float32, GPU=aq.is_cuda,
        DTYPE=TL_DTYPES[dtype], HAS_BIAS=bias is not None, CLAMPED=gated and act[1] is not None,
        BLOCK_M=config.block_m, BLOCK_N=block_n,
        BLOCK_K=config.block_k, num_warps=config.num_warps, num_stages=config.num_stages,
    )  # fmt: skip


def fused_moe_reference(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    *,
    expert_map: torch.Tensor | None = None,
    w13_scale: torch.Tensor | None = None,
    w2_scale: torch.Tensor | None = None,
    block: int | None = None,
    out: torch.Tensor | None = None,
    w13_bias: torch.Tensor | None = None,
    w2_bias: torch.Tensor | None = None,
    swiglu_limit: float | None = None,
    swiglu_alpha: float = 1.702,
) -> torch.Tensor:
    """``fused_moe`` in plain PyTorch, one GEMM per local expert over its tokens, rounding as
    Hugging Face's experts do (each product in x's dtype, times its routing weight, rounded)
    and adding a token's slots in float32; FP8 as the dense layers' reference path
    (``fp8_math``: the activations rounded through e4m3, the weights dequantized). The oracle
    of the kernels' tests, and the loop ``benchmarks/moe_layer.py`` times them against."""
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]
    acc = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for e in range(w13.shape[0]):
        tokens, slots = torch.where(ids == e)
        if tokens.numel() == 0:
            continue
        gate_up = _linear(x[tokens], w13[e], w13_scale, e, block, w13_bias, e)
        gate, up = gate_up.chunk(2, dim=-1)
        if swiglu_limit is None:
            h = F.silu(gate) * up
        else:  # (as FusedMoE.activate)
            gate, up = gate.clamp(max=swiglu_limit), up.clamp(-swiglu_limit, swiglu_limit)
            h = (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))
        y = _linear(h, w2[e], w2_scale, e, block, w2_bias, e)
        acc.index_add_(0, tokens, (y * topk_weights[tokens, slots, None]).to(x.dtype).float())
    if out is None:
        return acc.to(x.dtype)
    return out.copy_(acc)


def _linear(
    x: torch.Tensor,
    w: torch.Tensor,
    scale: torch.Tensor | None,
    e: int,
    block: int | None,
    bias: torch.Tensor | None = None,
    expert: int = 0,
) -> torch.Tensor:
    """x · wᵀ (+ expert ``expert``'s row of ``bias``) in x's dtype; an e4m3 ``w`` dequantized
    with expert ``e``'s scales, x rounded through e4m3 as the FP8 GEMM sees it."""
    b = bias[expert] if bias is not None else None
    if w.dtype != FP8:
        return F.linear(x, w, b)
    assert scale is not None
    if block is None:
        xq = quantize_activations(x, "token", 0, None)
        wd = dequantize(w, scale[e].reshape(-1, 1), None)
    else:
        xq = quantize_activations(x, "token_group", block, None)
        rows = scale[e].repeat_interleave(block, 0)[: w.shape[0]]
        wd = dequantize(w, rows, torch.arange(w.shape[1], device=w.device) // block)
    return F.linear(xq, wd.to(x.dtype), b)


__all__ = [
    "GEMV_TOKENS", "Alignment", "MoELaunch", "align", "fused_moe", "fused_moe_reference",
    "launch_for", "quantize_input", "supported",
]  # fmt: skip
