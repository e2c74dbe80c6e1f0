"""Variants of the FP8 GEMV over codes: x as words or bytes; the prefetch masked per element,
by one condition, or wrapped; x prefetched with w."""

import torch
import triton
import triton.language as tl

from services.worker.engine.dependent_launch import await_inputs, launch_options
from services.worker.engine.models.layers.fp8_linear import _widen4


@triton.jit
def _k(
    X,
    XB,
    W,
    WS,
    Y,
    xs_in,
    N,
    K,
    stride_wn,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    XW: tl.constexpr,
    PRE: tl.constexpr,
    XPRE: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):
    WORDS: tl.constexpr = BLOCK_K // 4
    k4 = K // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    j = tl.arange(0, WORDS)
    w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < k4)[None, :], other=0)
    await_inputs(USE_PDL)
    xs = tl.load(xs_in)
    if XPRE:
        xw = tl.load(X + j, mask=j < k4, other=0)
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    for k0 in range(0, k4, WORDS):
        j = k0 + tl.arange(0, WORDS)
        ok = j < k4
        w0, w1, w2, w3 = _widen4(w, True)
        if XW:
            if XPRE:
                x0, x1, x2, x3 = _widen4(xw, True)
            else:
                x0, x1, x2, x3 = _widen4(tl.load(X + j, mask=ok, other=0), True)
        else:
            x0 = tl.load(XB + 4 * j, mask=ok, other=0.0).to(tl.float32)
            x1 = tl.load(XB + 4 * j + 1, mask=ok, other=0.0).to(tl.float32)
            x2 = tl.load(XB + 4 * j + 2, mask=ok, other=0.0).to(tl.float32)
            x3 = tl.load(XB + 4 * j + 3, mask=ok, other=0.0).to(tl.float32)
        acc += w0 * x0[None, :]
        acc += w1 * x1[None, :]
        acc += w2 * x2[None, :]
        acc += w3 * x3[None, :]
        j += WORDS
        if PRE == 0:
            w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < k4)[None, :], other=0)
        elif PRE == 1:
            w = tl.load(w_rows + j[None, :], mask=k0 + WORDS < k4, other=0)
        else:
            w = tl.load(w_rows + (j[None, :] - k4 * (k0 + WORDS >= k4)))
        if XPRE:
            xw = tl.load(X + j, mask=j < k4, other=0)
    y = tl.sum(acc, axis=1) * xs * tl.load(WS + rows, mask=row_ok, other=0.0)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


def gemv(c, weight, ws, cfg, XW, PRE, XPRE):
    n, k = weight.shape
    y = torch.empty((1, n), dtype=c.dtype, device=weight.device)
    _k[(triton.cdiv(n, cfg["BLOCK_N"]),)](
        c.codes.view(torch.int32),
        c.codes,
        weight.view(torch.int32),
        ws,
        y,
        c.scales,
        n,
        k,
        weight.view(torch.int32).stride(0),
        XW=XW,
        PRE=PRE,
        XPRE=XPRE,
        **cfg,
        **launch_options(y),
    )
    return y
