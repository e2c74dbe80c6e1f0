"""A mixture-of-experts layer's experts at a few tokens (``fused_moe.GEMV_TOKENS``): the
(token, slot) pairs are too few to fill an M-block of ``ops/fused_moe.py``'s grouped GEMMs and
the layer is a read of the chosen experts' weights, so it runs as two matrix-vector launches
(with FP8 at more than ``QUANTIZE_TOKENS`` tokens, x's and h's quantization besides; at fewer
each GEMV quantizes its own input, the same codes), with no align step and no slot sum (at one
token with programmatic dependent launch, as the dense layers' GEMV:
``ops/dependent_launch.py``).
Their tiles at one token are this GPU's measured launches where its table has them
(``ops/gemv_configs.py``, written by ``benchmarks/moe_layer.py --tune``: timed back to back in a
CUDA graph over experts read from HBM, as a decode step runs them), else the autotuner's, per
token count (tuned by the eager forwards before a CUDA graph captures; as the dense GEMV's, the
tiles chosen set the float32 summation order):

    GEMV 1     a program per (pair, BLOCK_N rows of I): the pair's expert's gate and up rows
               times x[token], the activation as GEMM 1's epilogue → h [T·k, I]
    GEMV 2     a program per (token, BLOCK_N columns of H): every slot's expert's w2 rows times
               h[slot], each row rounded and weighted as GEMM 2's epilogue, then summed over
               the slots in slot order as the sum step → out

The two paths round at the same points (``ops/moe_common.py``); their sums differ only in
float32 summation order.

A pair is (token t, slot j), pair index t·k + j, as in ``ops/fused_moe.py``; a pair whose expert
is on another rank (``expert_map`` → -1) reads nothing and adds nothing.
"""

import math
from typing import Any

import torch
import triton
import triton.language as tl

from services.worker.engine.ops import gemv_configs
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options
from services.worker.engine.ops.fp8_linear import _quantize, _row_scale, _scale_of
from services.worker.engine.ops.moe_common import (
    TL_DTYPES,
    activate,
    operand,
    quantize_input,
    weight_scales,
    weighted,
)
from services.worker.engine.quantization.fp8_math import FP8


@triton.jit
def _gemv_up_kernel(
    X, XS, W, WS, C, BIAS, IDS, MAP, T, K, INTER, top_k, stride_x, stride_xsm, stride_xsg,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_c, stride_be, alpha, limit,
    HAS_MAP: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    CLAMPED: tl.constexpr, DTYPE: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr = False, GPU: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """GEMV 1 (the module docstring): pair ``program_id(0)``'s rows ``BLOCK_N`` · program_id(1)
    onward of h. W [E, 2·INTER, K]: gate rows n, up rows INTER + n. FP8 as
    ``_moe_gemm_kernel``'s (X the codes, XS their scales; GROUP: BLOCK_K divides it, so a K
    tile is in one group), or with QUANT X itself, its codes made here as ``quantize_input``
    makes them (``_token_codes``). A pair
    whose expert is on another rank reads nothing and writes a row of zeros."""
    pair = tl.program_id(0)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < INTER
    await_inputs(USE_PDL)
    e = tl.load(IDS + pair).to(tl.int32)
    if HAS_MAP:
        e = tl.load(MAP + e)
    live = n_ok & (e >= 0)
    expert = tl.maximum(e, 0).to(tl.int64)
    x_row = X + (pair // top_k).to(tl.int64) * stride_x
    if QUANT and not GROUP:  # the token's scale, over its whole row first
        xs_row = _row_scale(x_row, K, x_row, False, BLOCK_K)
    gate_rows = W + expert * stride_we + rn[:, None].to(tl.int64) * stride_wn
    up_rows = gate_rows + INTER * stride_wn
    ws_row = WS + expert * stride_wse
    rk = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_K], tl.float32)
    gate = tl.zeros([BLOCK_N], tl.float32)  # (GROUP: the sums, scaled a K tile at a time)
    up = tl.zeros([BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        k_ok = cols < K
        ok = live[:, None] & k_ok[None, :]
        x = tl.load(x_row + cols, mask=k_ok, other=0.0).to(tl.float32)
        if QUANT:
            if GROUP:  # the scale of the group this tile lies in
                gcols = (k0 // GROUP) * GROUP + tl.arange(0, GROUP)
                xg = tl.load(x_row + gcols, mask=gcols < K, other=0.0).to(tl.float32)
                xs = _scale_of(tl.max(tl.abs(xg), 0))
            else:
                xs = xs_row
            x = _token_codes(x, xs, GPU)
        x = x[None, :]
        g = tl.load(gate_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32) * x
        u = tl.load(up_rows + cols[None, :], mask=ok, other=0.0).to(tl.float32) * x
        if GROUP:
            grp = k0 // GROUP
            if not QUANT:
                xs = tl.load(XS + (pair // top_k) * stride_xsm + grp * stride_xsg)
            ws_g = tl.load(ws_row + (rn // GROUP) * stride_wsn + grp * stride_wsk, mask=live,
                           other=0.0)  # fmt: skip
            ws_u = tl.load(ws_row + ((INTER + rn) // GROUP) * stride_wsn + grp * stride_wsk,
                           mask=live, other=0.0)  # fmt: skip
            gate += tl.sum(g, 1) * (xs * ws_g)
            up += tl.sum(u, 1) * (xs * ws_u)
        else:
            acc += g
            acc_up += u
    if not GROUP:
        gate = tl.sum(acc, 1)
        up = tl.sum(acc_up, 1)
        if FP8:  # per channel: the token's and the row's scale, once
            if QUANT:
                xs = xs_row
            else:
                xs = tl.load(XS + (pair // top_k) * stride_xsm)
            gate *= xs * tl.load(ws_row + rn * stride_wsn, mask=live, other=0.0)
            up *= xs * tl.load(ws_row + (INTER + rn) * stride_wsn, mask=live, other=0.0)
    if HAS_BIAS:
        b_row = BIAS + expert * stride_be
        gate += tl.load(b_row + rn, mask=live, other=0.0).to(tl.float32)
        up += tl.load(b_row + INTER + rn, mask=live, other=0.0).to(tl.float32)
    y = activate(gate, up, alpha, limit, DTYPE, CLAMPED)
    tl.store(C + pair.to(tl.int64) * stride_c + rn, y, mask=n_ok)


@triton.jit
def _gemv_down_kernel(
    A, AS, W, WS, OUT, BIAS, WEIGHTS, IDS, MAP, T, N, K, top_k, stride_a, stride_asm, stride_asg,
    stride_we, stride_wn, stride_wse, stride_wsn, stride_wsk, stride_out, stride_be,
    HAS_MAP: tl.constexpr, FP8: tl.constexpr, GROUP: tl.constexpr, HAS_BIAS: tl.constexpr,
    DTYPE: tl.constexpr, SLOTS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    QUANT: tl.constexpr = False, GPU: tl.constexpr = False, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """GEMV 2 (the module docstring): token ``program_id(0)``'s columns ``BLOCK_N`` ·
    program_id(1) onward of out, every slot at once (a [SLOTS, BLOCK_N, BLOCK_K] tile of the
    slots' experts' w2 rows a K step). A (h, or its codes with AS) [T·k, K]; W [E, N, K]. With
    QUANT and FP8, A is h and each slot's codes are made here (``_token_codes``)."""
    t = tl.program_id(0).to(tl.int64)
    rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = rn < N
    j = tl.arange(0, SLOTS)
    pairs = t * top_k + j
    await_inputs(USE_PDL)
    e = tl.load(IDS + pairs, mask=j < top_k, other=-1).to(tl.int32)
    if HAS_MAP:
        e = tl.load(MAP + tl.maximum(e, 0), mask=e >= 0, other=-1)
    live = e >= 0
    ok = live[:, None] & n_ok[None, :]  # [SLOTS, BLOCK_N]
    expert = tl.maximum(e, 0).to(tl.int64)
    w_rows = W + expert[:, None, None] * stride_we + rn[None, :, None].to(tl.int64) * stride_wn
    a_rows = A + pairs[:, None] * stride_a
    ws_rows = WS + expert[:, None] * stride_wse
    rk = tl.arange(0, BLOCK_K)
    if QUANT and not GROUP:  # each slot's scale, over its whole row of h first
        amax = tl.zeros([SLOTS], tl.float32)
        for k0 in range(0, K, BLOCK_K):
            cols = k0 + rk
            a = tl.load(a_rows + cols[None, :], mask=live[:, None] & (cols < K)[None, :],
                        other=0.0)  # fmt: skip
            amax = tl.maximum(amax, tl.max(tl.abs(a.to(tl.float32)), 1))
        xs_rows = _scale_of(amax)
    acc = tl.zeros([SLOTS, BLOCK_N], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + rk
        k_ok = cols < K
        a = tl.load(a_rows + cols[None, :], mask=live[:, None] & k_ok[None, :], other=0.0)
        a = a.to(tl.float32)
        if QUANT:
            if GROUP:
                xs = _group_scales(A + pairs * stride_a, live, k0, K, GROUP)
            else:
                xs = xs_rows
            a = _token_codes(a, xs[:, None], GPU)
        w = tl.load(w_rows + cols[None, None, :], mask=ok[:, :, None] & k_ok[None, None, :],
                    other=0.0)  # fmt: skip
        part = tl.sum(w.to(tl.float32) * a[:, None, :], 2)
        if GROUP:
            grp = k0 // GROUP
            if QUANT:
                xs = tl.where(live, xs, 0.0)
            else:
                xs = tl.load(AS + pairs * stride_asm + grp * stride_asg, mask=live, other=0.0)
            ws = tl.load(ws_rows + (rn // GROUP)[None, :] * stride_wsn + grp * stride_wsk,
                         mask=ok, other=0.0)  # fmt: skip
            acc += part * (xs[:, None] * ws)
        else:
            acc += part
    if FP8 and not GROUP:
        if QUANT:
            xs = tl.where(live, xs_rows, 0.0)
        else:
            xs = tl.load(AS + pairs * stride_asm, mask=live, other=0.0)
        acc *= xs[:, None] * tl.load(ws_rows + rn[None, :] * stride_wsn, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(BIAS + expert[:, None] * stride_be + rn[None, :], mask=ok,
                       other=0.0).to(tl.float32)  # fmt: skip
    weight = tl.load(WEIGHTS + pairs, mask=live, other=0.0)
    y = tl.where(ok, weighted(acc, weight[:, None], DTYPE).to(tl.float32), 0.0)
    total = tl.zeros([BLOCK_N], tl.float32)
    for slot in tl.static_range(SLOTS):  # in slot order, as the sum step (the rest add zeros)
        total += tl.sum(tl.where(j[:, None] == slot, y, 0.0), 0)
    tl.store(OUT + t * stride_out + rn, total.to(OUT.dtype.element_ty), mask=n_ok)


@triton.jit
def _group_scales(rows, row_ok, k0, K, GROUP: tl.constexpr):
    """The scales of the scale group holding column ``k0`` of each row of ``rows`` (pointers
    [R]; rows not ``row_ok`` read as 0): max |x| over the group / FP8_MAX (at least
    MIN_SCALE), as ``quantize_groups``."""
    gcols = (k0 // GROUP) * GROUP + tl.arange(0, GROUP)
    x = tl.load(rows[:, None] + gcols[None, :], mask=row_ok[:, None] & (gcols < K)[None, :],
                other=0.0)  # fmt: skip
    return _scale_of(tl.max(tl.abs(x.to(tl.float32)), 1))


@triton.jit
def _token_codes(x, xs, GPU: tl.constexpr):
    """x's e4m3 codes under scale ``xs`` as float32 values: ``quantize_input``'s (the same
    rounding, ``fp8_linear._quantize``), so that quantizing in the GEMV changes no code."""
    return _quantize(x, xs, tl.math.div_rn(1.0, xs), GPU).to(tl.float32)


_GEMV_UP_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (2, 512, 4, 3), (4, 128, 4, 3), (4, 256, 4, 3), (4, 512, 4, 3), (4, 1024, 8, 3),
        (8, 128, 4, 3), (8, 256, 4, 3), (8, 512, 8, 3), (16, 128, 4, 4), (16, 256, 8, 3),
    ]
]  # fmt: skip
_GEMV_DOWN_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (1, 256, 4, 3), (2, 128, 4, 3), (2, 256, 4, 3), (4, 64, 4, 4), (4, 128, 4, 3),
        (4, 256, 8, 3), (8, 64, 4, 3), (8, 128, 8, 3),
    ]
]  # fmt: skip


def k_tiles_fit(block_k: int, block: int | None) -> bool:
    """A launch's K tiles each lie in one of ``block``'s scale groups (FP8 blocks; any tile
    fits without them)."""
    return not block or block % block_k == 0


def _k_tiles_in_a_group(
    configs: list[triton.Config], named_args: dict[str, object], **kwargs: object
) -> list[triton.Config]:
    """FP8 blocks: only the launches whose K tiles each lie in one block (none: K tiles of
    one block)."""
    group = int(kwargs.get("GROUP", named_args.get("GROUP", 0)))  # type: ignore[call-overload]
    if not group:
        return configs
    kept = [c for c in configs if k_tiles_fit(c.kwargs["BLOCK_K"], group)]
    return kept or [triton.Config({"BLOCK_N": 4, "BLOCK_K": group}, num_warps=4, num_stages=3)]


_gemv_up_tuned = triton.autotune(
    configs=_GEMV_UP_CONFIGS,
    key=["T", "K", "INTER", "top_k", "FP8", "GROUP", "HAS_BIAS", "QUANT"],
    prune_configs_by={"early_config_prune": _k_tiles_in_a_group},
)(_gemv_up_kernel)
_gemv_down_tuned = triton.autotune(
    configs=_GEMV_DOWN_CONFIGS,
    key=["T", "N", "K", "top_k", "FP8", "GROUP", "HAS_BIAS", "QUANT"],
    prune_configs_by={"early_config_prune": _k_tiles_in_a_group},
)(_gemv_down_kernel)


Launch = dict[str, int]  # BLOCK_N, BLOCK_K, num_warps, num_stages

# FP8 experts at up to this many tokens: each GEMV quantizes its own activations (x's codes in
# GEMV 1, h's in GEMV 2, the same codes ``quantize_input`` writes), so the two quantizing
# launches between them go (0: they stay; benchmarks/latency.py's ``fp8_moe_quantize_apart``)
QUANTIZE_TOKENS = 1


def measured_launch(
    stage: str, x: torch.Tensor, w: torch.Tensor, block: int | None
) -> Launch | None:
    """This GPU's measured launch of GEMV ``stage`` ("up", "down") over expert weights ``w``
    ([E, N, K]) at one token, or None (the autotuner's then): none for more tokens, nor where
    its K tiles would straddle ``block``'s scale groups."""
    if x.shape[0] != 1:
        return None
    kind = gemv_configs.moe_kind(stage, w.dtype == FP8, block)
    launch = gemv_configs.launch(kind, x, w.shape[1], w.shape[2])
    return launch if launch is not None and k_tiles_fit(launch["BLOCK_K"], block) else None


def moe_gemv(
    x: torch.Tensor,
    w13: torch.Tensor,
    w2: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    expert_map: torch.Tensor | None,
    w13_scale: torch.Tensor | None,
    w2_scale: torch.Tensor | None,
    block: int | None,
    out: torch.Tensor,
    w13_bias: torch.Tensor | None,
    w2_bias: torch.Tensor | None,
    swiglu_limit: float | None,
    swiglu_alpha: float,
    launches: tuple[Launch | None, Launch | None] = (None, None),
) -> torch.Tensor:
    """``fused_moe.fused_moe`` (its arguments, all given) as GEMV 1 and GEMV 2. ``launches``:
    GEMV 1's and GEMV 2's (the tuner's), else ``measured_launch``'s, else the autotuner's."""
    t, hidden = x.shape
    top_k, inter = topk_ids.shape[1], w2.shape[2]
    fp8 = w13.dtype == FP8
    assert x.stride(-1) == 1 and w13.stride(-1) == 1 and w2.stride(-1) == 1, "rows contiguous"
    assert out.stride(-1) == 1, "rows contiguous"
    ids = topk_ids.contiguous()
    emap = expert_map if expert_map is not None else ids
    weights = topk_weights.reshape(-1).float().contiguous()
    # FP8 at up to QUANTIZE_TOKENS tokens: each GEMV makes its activations' codes itself
    quant = fp8 and t <= QUANTIZE_TOKENS
    aq, a_scales, a_strides = operand(quantize_input(x, block) if fp8 and not quant else x)
    h = torch.empty((t * top_k, inter), dtype=x.dtype, device=x.device)
    s13, s13_strides = weight_scales(w13, w13_scale)
    common = {"HAS_MAP": expert_map is not None, "FP8": fp8, "GROUP": block or 0,
              "DTYPE": TL_DTYPES[x.dtype], "QUANT": quant, "GPU": x.is_cuda,
              **launch_options(x)}  # fmt: skip
    up_args = (
        aq, a_scales, w13, s13, h, w13_bias if w13_bias is not None else h, ids, emap, t,
        hidden, inter, top_k, aq.stride(0), *a_strides, w13.stride(0),
        w13.stride(1), *s13_strides, h.stride(0),
        w13_bias.stride(0) if w13_bias is not None else 0, float(swiglu_alpha),
        float(swiglu_limit if swiglu_limit is not None else 0.0),
    )  # fmt: skip
    up = {**common, "HAS_BIAS": w13_bias is not None, "CLAMPED": swiglu_limit is not None}
    launch = launches[0] or measured_launch("up", x, w13, block)
    _run(_gemv_up_kernel, _gemv_up_tuned, (t * top_k, inter), up_args, up, launch, block, x)
    hc, h_scales, h_strides = operand(quantize_input(h, block) if fp8 and not quant else h)
    s2, s2_strides = weight_scales(w2, w2_scale)
    down_args = (
        hc, h_scales, w2, s2, out, w2_bias if w2_bias is not None else out, weights, ids, emap,
        t, hidden, inter, top_k, hc.stride(0), *h_strides,
        w2.stride(0), w2.stride(1), *s2_strides, out.stride(0),
        w2_bias.stride(0) if w2_bias is not None else 0,
    )  # fmt: skip
    down = {**common, "HAS_BIAS": w2_bias is not None, "SLOTS": triton.next_power_of_2(top_k)}
    launch = launches[1] or measured_launch("down", x, w2, block)
    _run(_gemv_down_kernel, _gemv_down_tuned, (t, hidden), down_args, down, launch, block, x)
    return out


def _run(
    kernel: Any,
    tuned: Any,
    grid: tuple[int, int],
    args: tuple[Any, ...],
    kw: dict[str, Any],
    launch: Launch | None,
    block: int | None,
    x: torch.Tensor,
) -> None:
    """One GEMV over (``grid[0]`` programs, ``grid[1]`` output rows in BLOCK_N): at
    ``launch`` (given or measured), else its autotuner's on a GPU, else Triton's interpreter's
    one small tile (tests on CPU; K tiles within ``block``'s groups)."""
    rows, cols = grid
    if launch is not None:
        assert k_tiles_fit(launch["BLOCK_K"], block), f"K tiles across {block}-wide blocks"
        kernel[(rows, triton.cdiv(cols, launch["BLOCK_N"]))](*args, **kw, **launch)
    elif x.is_cuda:
        tuned[lambda m: (rows, triton.cdiv(cols, m["BLOCK_N"]))](*args, **kw)
    else:
        k_tile = math.gcd(block, 32) if block else 32
        kernel[(rows, triton.cdiv(cols, 16))](*args, **kw, BLOCK_N=16, BLOCK_K=k_tile)
