"""Fused elementwise kernels (Triton): residual add + RMSNorm, SiLU·mul, and rotary embedding.

In eager PyTorch these are chains of small kernels (RMSNorm alone is seven); at batch 1 on a
GPU their launches cost as much as reading the weights. Each kernel here is one launch and
rounds where the PyTorch/Hugging Face version rounds (casts to the model dtype at the same
points), so outputs agree to within a unit in the last place.
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.dependent_launch import await_inputs, launch_options


@triton.jit
def _rms_norm(
    X, R, W, Y, stride_xt, stride_xh, stride_rt, stride_yt, stride_yh, N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One row (token, head) per program: [r = x + r (stored)]; y = w * norm(r or x)."""
    await_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    ok = offs < N
    x = tl.load(X + t * stride_xt + h * stride_xh + offs, mask=ok, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(R + t * stride_rt + offs, mask=ok, other=0.0)
        x = (x.to(tl.float32) + r.to(tl.float32)).to(x.dtype)
        tl.store(R + t * stride_rt + offs, x, mask=ok)
    xf = x.to(tl.float32)
    inv = tl.rsqrt(tl.sum(xf * xf, 0) / N + eps)
    normed = (xf * inv).to(x.dtype).to(tl.float32)
    w = tl.load(W + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Y + t * stride_yt + h * stride_yh + offs, (w * normed).to(Y.dtype.element_ty), mask=ok)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x: [T, N] or [T, H, N] (any strides, last dim contiguous); returns a new tensor."""
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    y = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    n = x3.shape[-1]
    _rms_norm[(x3.shape[0], x3.shape[1])](
        x3, x3, weight, y, x3.stride(0), x3.stride(1), 0, y.stride(0), y.stride(1), n, eps,
        BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False, **launch_options(x),
    )  # fmt: skip
    return y if x.dim() == 3 else y.squeeze(1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """``residual += x`` in place; returns (norm of it, it). x, residual: [T, N]."""
    y = torch.empty_like(x)
    n = x.shape[-1]
    _rms_norm[(x.shape[0], 1)](
        x, residual, weight, y, x.stride(0), 0, residual.stride(0), y.stride(0), 0, n, eps,
        BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=True, **launch_options(x),
    )  # fmt: skip
    return y, residual


@triton.jit
def _silu_mul(X, Y, stride_x, stride_y, N, BLOCK: tl.constexpr, USE_PDL: tl.constexpr = False):
    await_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    gate = tl.load(X + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + N + offs, mask=ok, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    tl.store(Y + t * stride_y + offs, (act * up.to(tl.float32)).to(Y.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x: [T, 2N] = [gate ‖ up] → silu(gate) · up: [T, N]."""
    n = x.shape[-1] // 2
    y = torch.empty((x.shape[0], n), dtype=x.dtype, device=x.device)
    block = min(1024, triton.next_power_of_2(n))
    _silu_mul[(x.shape[0], triton.cdiv(n, block))](
        x, y, x.stride(0), y.stride(0), n, BLOCK=block, **launch_options(x)
    )
    return y


ROTARY_HEAD_TOKENS = 64


@triton.jit
def _rotary(
    Q, K, positions, COS, SIN, QW, KW, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """In place, HEADS heads of one token per program, as a [HEADS, half] tile: programs
    (t, 0 .. q groups - 1) take q's heads, the rest k's. Many tokens: a whole q or k per
    program (a program per (token, head) made a prefill's grid millions of programs of 64
    elements each); a few tokens: a head per program, so that many programs share the work.

    [x = w · norm(x)   per head (Qwen3's q/k norm), rounded as ``_rms_norm`` rounds]
    out[:half] = x1·cos − x2·sin,  out[half:] = x2·cos + x1·sin   (rotate-half style)
    """
    await_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    pos = tl.load(positions + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    group = tl.program_id(1)
    q_groups = tl.cdiv(NUM_Q_HEADS, HEADS)
    if group < q_groups:
        heads = group * HEADS + tl.arange(0, HEADS)
        base = Q + t * stride_qt + heads[:, None] * stride_qh
        h_ok = heads < NUM_Q_HEADS
        W = QW
    else:
        heads = (group - q_groups) * HEADS + tl.arange(0, HEADS)
        base = K + t * stride_kt + heads[:, None] * stride_kh
        h_ok = heads < NUM_K_HEADS
        W = KW
    ok = h_ok[:, None] & (offs < HALF)[None, :]
    x1 = tl.load(base + offs[None, :], mask=ok, other=0.0)
    x2 = tl.load(base + HALF + offs[None, :], mask=ok, other=0.0)
    dtype = x1.dtype
    x1f, x2f = x1.to(tl.float32), x2.to(tl.float32)
    if HAS_NORM:
        # each whole head at once: the same reduction as _rms_norm, so the same bits
        full = tl.arange(0, NORM_BLOCK)
        full_ok = h_ok[:, None] & (full < 2 * HALF)[None, :]
        xs = tl.load(base + full[None, :], mask=full_ok, other=0.0).to(tl.float32)
        inv = tl.rsqrt(tl.sum(xs * xs, 1) / (2 * HALF) + eps)[:, None]
        w1 = tl.load(W + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        w2 = tl.load(W + HALF + offs, mask=offs < HALF, other=0.0).to(tl.float32)[None, :]
        x1f = (w1 * (x1f * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2f = (w2 * (x2f * inv).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c_ok = offs < HALF
    cos = tl.load(COS + pos * stride_c + offs, mask=c_ok, other=0.0).to(dtype).to(tl.float32)
    sin = tl.load(SIN + pos * stride_c + offs, mask=c_ok, other=0.0).to(dtype).to(tl.float32)
    cos, sin = cos[None, :], sin[None, :]
    a1 = (x1f * cos).to(dtype).to(tl.float32)
    b1 = (x2f * sin).to(dtype).to(tl.float32)
    a2 = (x2f * cos).to(dtype).to(tl.float32)
    b2 = (x1f * sin).to(dtype).to(tl.float32)
    tl.store(base + offs[None, :], (a1 - b1).to(dtype), mask=ok)
    tl.store(base + HALF + offs[None, :], (a2 + b2).to(dtype), mask=ok)


def rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place; cos/sin: [max_positions, D] float32.
    ``norm_weights`` (q's, k's): RMS-normalise each head first, in the same kernel."""
    half = q.shape[-1] // 2
    tokens, num_q, num_k = q.shape[0], q.shape[1], k.shape[1]
    # a head per program below ROTARY_HEAD_TOKENS tokens (batch-1 decode: 2 programs would do
    # all the work), a whole q or k per program above
    heads = 1 if tokens < ROTARY_HEAD_TOKENS else triton.next_power_of_2(max(num_q, num_k))
    groups = triton.cdiv(num_q, heads) + triton.cdiv(num_k, heads)
    block = triton.next_power_of_2(half)
    qw, kw = norm_weights if norm_weights is not None else (cos, cos)  # unread without a norm
    _rotary[(tokens, groups)](
        q, k, positions, cos, sin, qw, kw, eps, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos.stride(0), NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1],
        HEADS=heads, HALF=half, BLOCK=block, HAS_NORM=norm_weights is not None,
        NORM_BLOCK=triton.next_power_of_2(2 * half), **launch_options(q),
        **({"num_warps": 4 if heads * block <= 1024 else 8} if q.is_cuda else {}),
    )  # fmt: skip
