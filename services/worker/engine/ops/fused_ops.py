"""Fused elementwise kernels (Triton): residual add + RMSNorm, SiLU·mul, and rotary embedding.

In eager PyTorch these are chains of small kernels (RMSNorm alone is seven); at batch 1 on a
GPU their launches cost as much as reading the weights. Each kernel here is one launch and
rounds where the PyTorch/Hugging Face version rounds (casts to the model dtype at the same
points), so outputs agree to within a unit in the last place.

RMSNorm and SiLU·mul hold a whole output row in registers, so when the FP8 layer after them
takes its input quantized (``group``: per token, the row's width; a block checkpoint's, per
token and 128 columns), they write that row's e4m3 codes and scales instead of the row
(``fp8_linear.store_codes``, ``fp8_block.store_group_codes``: the rounding of the layer's own
quantization, bit for bit), and the layer skips its quantization pass. (SiLU·mul needs the
whole row in one program only for codes per token.)
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.attention.backend import LayerKVCache, write_kv
from services.worker.engine.ops.attention import cache_values
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options
from services.worker.engine.ops.fp8_block import group_codes_out, store_group_codes
from services.worker.engine.ops.fp8_linear import store_codes
from services.worker.engine.quantization.fp8_math import FP8, Codes


@triton.jit
def _store_quantized(y, ok, Q, c0, S, stride_sg, N, BLOCK: tl.constexpr, GROUP: tl.constexpr,
                     GPU: tl.constexpr):  # fmt: skip
    """A row's BLOCK values ``y`` (float32, masked lanes 0; its columns ``c0`` on, ``ok``) as
    the codes the FP8 layer after takes, to the row's codes at Q: GROUP 0 per token (``y``
    the whole row, its scale to S), else a scale every GROUP columns (to S, ``stride_sg``
    apart). The groups' pointers are built as a [groups, GROUP] tile, not reshaped, so that
    the compiler sees each group's bytes contiguous and stores them in wide words."""
    if GROUP:
        rows: tl.constexpr = BLOCK // GROUP
        cols = c0 + tl.arange(0, rows)[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        store_group_codes(
            tl.reshape(y, (rows, GROUP)), cols < N, Q + cols, S, stride_sg, c0 // GROUP,
            tl.cdiv(N, GROUP), rows, GROUP, GPU,
        )  # fmt: skip
    else:
        store_codes(y, ok, Q + c0 + tl.arange(0, BLOCK), S, GPU)


def _codes_out(rows: int, n: int, group: int, like: torch.Tensor) -> Codes:
    """Room for ``rows`` rows of ``n`` codes and their scales a ``group`` columns (per token:
    ``n``), of an activation like ``like``."""
    if group == n:
        return Codes(
            torch.empty((rows, n), dtype=FP8, device=like.device),
            torch.empty((rows, 1), dtype=torch.float32, device=like.device),
            like.dtype,
        )
    assert n % group == 0 and group & (group - 1) == 0 and group > 1, (
        f"codes in whole groups of a power of two columns: {n} columns, groups of {group}"
    )
    return group_codes_out(rows, n, group, like)


@triton.jit
def _rms_norm(
    X, R, W, Y, Q, S, stride_xt, stride_xh, stride_rt, stride_yt, stride_yh, stride_sg, N, eps,
    BLOCK: tl.constexpr, HAS_RESIDUAL: tl.constexpr, QUANT: tl.constexpr, GPU: tl.constexpr,
    GROUP: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """One row (token, head) per program: [r = x + r (stored)]; y = w * norm(r or x), stored,
    or with QUANT its codes to Q and scales to S (rows ``stride_yt`` apart; one head;
    ``_store_quantized``)."""
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
    y = (w * normed).to(Y.dtype.element_ty)
    if QUANT:
        _store_quantized(y.to(tl.float32), ok, Q + t * stride_yt, 0, S + t, stride_sg, N, BLOCK,
                         GROUP, GPU)  # fmt: skip
    else:
        tl.store(Y + t * stride_yt + h * stride_yh + offs, y, mask=ok)


def rms_norm(
    x: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 0
) -> torch.Tensor | Codes:
    """x: [T, N] or [T, H, N] (any strides, last dim contiguous); returns a new tensor, or
    with ``group`` (x: [T, N]) its codes, a scale every ``group`` columns (N: per token)."""
    if group:
        assert x.dim() == 2, "codes of whole rows"
        return _add_rms_norm(x, None, weight, eps, group)
    x3 = x if x.dim() == 3 else x.unsqueeze(1)
    y = torch.empty(x3.shape, dtype=x.dtype, device=x.device)
    n = x3.shape[-1]
    _rms_norm[(x3.shape[0], x3.shape[1])](
        x3, x3, weight, y, y, y, x3.stride(0), x3.stride(1), 0, y.stride(0), y.stride(1), 0, n,
        eps, BLOCK=triton.next_power_of_2(n), HAS_RESIDUAL=False, QUANT=False, GPU=x.is_cuda,
        **launch_options(x),
    )  # fmt: skip
    return y if x.dim() == 3 else y.squeeze(1)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float, group: int = 0
) -> tuple[torch.Tensor | Codes, torch.Tensor]:
    """``residual += x`` in place; returns (norm of it, or its codes a scale every ``group``
    columns, it). x, residual: [T, N]."""
    return _add_rms_norm(x, residual, weight, eps, group), residual


def _add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor, eps: float, group: int
) -> torch.Tensor | Codes:
    """The norm of [T, N] rows (after ``residual += x`` when a residual is given), or its
    codes. The kernel writes one of Y (the row) or Q and S (codes, scales); the other
    pointers are placeholders of the right type that it never touches."""
    rows, n = x.shape
    r = residual if residual is not None else x
    codes = _codes_out(rows, n, group, x) if group else None
    if codes is not None:
        y, q, s = x, codes.codes, codes.scales  # (Y's dtype is the rows', x's)
        stride_sg = s.stride(1)
    else:
        y = torch.empty_like(x)
        q, s, stride_sg = y, y, 0
    out_stride = q.stride(0) if codes is not None else y.stride(0)  # (both contiguous: n)
    block = triton.next_power_of_2(n)
    _rms_norm[(rows, 1)](
        x, r, weight, y, q, s, x.stride(0), 0, r.stride(0), out_stride, 0, stride_sg, n, eps,
        BLOCK=block, HAS_RESIDUAL=residual is not None, QUANT=bool(group), GPU=x.is_cuda,
        GROUP=group if group and group < n else 0, **launch_options(x),
    )  # fmt: skip
    return codes if codes is not None else y


@triton.jit
def _silu_mul(
    X, Y, S, stride_x, stride_y, stride_sg, N, BLOCK: tl.constexpr, QUANT: tl.constexpr,
    GPU: tl.constexpr, GROUP: tl.constexpr = 0, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """BLOCK columns of one token per program; with QUANT their codes go to Y (e4m3) and scales
    to S (``_store_quantized``: per token, a whole row a program)."""
    await_inputs(USE_PDL)
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < N
    gate = tl.load(X + t * stride_x + offs, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(X + t * stride_x + N + offs, mask=ok, other=0.0)
    act = (gate * tl.sigmoid(gate)).to(up.dtype).to(tl.float32)
    y = (act * up.to(tl.float32)).to(up.dtype)
    if QUANT:
        c0 = tl.program_id(1) * BLOCK  # (0 per token: one program a row)
        _store_quantized(y.to(tl.float32), ok, Y + t * stride_y, c0, S + t, stride_sg, N, BLOCK,
                         GROUP, GPU)  # fmt: skip
    else:
        tl.store(Y + t * stride_y + offs, y.to(Y.dtype.element_ty), mask=ok)


def silu_and_mul(x: torch.Tensor, group: int = 0) -> torch.Tensor | Codes:
    """x: [T, 2N] = [gate ‖ up] → silu(gate) · up: [T, N], or with ``group`` its codes, a scale
    every ``group`` columns (N: per token)."""
    rows, n = x.shape[0], x.shape[-1] // 2
    if group == n:  # one program a row: its scale needs the whole row
        codes = _codes_out(rows, n, group, x)
        block = triton.next_power_of_2(n)
        _silu_mul[(rows, 1)](
            x, codes.codes, codes.scales, x.stride(0), codes.codes.stride(0), 0, n, BLOCK=block,
            QUANT=True, GPU=x.is_cuda, **launch_options(x),
            **({"num_warps": 16 if block > 8192 else 8} if x.is_cuda else {}),
        )  # fmt: skip
        return codes
    block = min(1024, triton.next_power_of_2(n))
    if group:  # a program's columns in whole groups
        codes = _codes_out(rows, n, group, x)
        block = max(block, group)
        assert block % group == 0, f"groups of {group} columns"
        _silu_mul[(rows, triton.cdiv(n, block))](
            x, codes.codes, codes.scales, x.stride(0), codes.codes.stride(0),
            codes.scales.stride(1), n, BLOCK=block, QUANT=True, GPU=x.is_cuda, GROUP=group,
            **launch_options(x),
        )  # fmt: skip
        return codes
    y = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    _silu_mul[(rows, triton.cdiv(n, block))](
        x, y, y, x.stride(0), y.stride(0), 0, n, BLOCK=block, QUANT=False, GPU=x.is_cuda,
        **launch_options(x),
    )  # fmt: skip
    return y


ROTARY_HEAD_TOKENS = 64
ROTARY_INTERPRETER_TOKENS = 32


@triton.jit
def _per_row(x, TOKENS: tl.constexpr):
    """A program's per-token term as a column of its [TOKENS · HEADS, half] tile: as it is
    (a scalar) with one token a program."""
    if TOKENS == 1:
        return x
    else:
        return x[:, None]


@triton.jit(do_not_specialize=["tokens"])  # (a GPU's launch reads no count: one compile)
def _rotary(
    Q, K, positions, COS, SIN, QW, KW, eps, stride_qt, stride_qh, stride_kt, stride_kh, stride_c,
    V, KC, VC, slots, k_scale, v_scale, stride_vt, stride_vh, stride_cb, stride_cs, stride_ch,
    tokens,
    NUM_Q_HEADS: tl.constexpr, NUM_K_HEADS: tl.constexpr, HEADS: tl.constexpr,
    HALF: tl.constexpr, BLOCK: tl.constexpr, HAS_NORM: tl.constexpr, NORM_BLOCK: tl.constexpr,
    STORE: tl.constexpr = False, KV_BLOCK: tl.constexpr = 1, USE_PDL: tl.constexpr = False,
    TOKENS: tl.constexpr = 1, INTERLEAVED: tl.constexpr = False,
):  # fmt: skip
    """In place, HEADS heads of TOKENS tokens per program, as a [TOKENS · HEADS, half] tile:
    programs (t, 0 .. q groups - 1) take q's heads, the rest k's. Many tokens: a whole q or k
    per program (a program per (token, head) made a prefill's grid millions of programs of 64
    elements each); a few tokens: a head per program, so that many programs share the work.
    On a GPU one token a program; Triton's interpreter (CPU) runs programs one after another
    at a fixed cost each, so there a program takes up to ROTARY_INTERPRETER_TOKENS tokens.

    [x = w · norm(x)   per head (Qwen3's q/k norm), rounded as ``_rms_norm`` rounds]
    out[:half] = x1·cos − x2·sin,  out[half:] = x2·cos + x1·sin   (rotate-half style)

    With ``INTERLEAVED`` (DeepSeek's checkpoints) a head's rotary pairs are adjacent, x1 its
    even and x2 its odd elements, and the rotated head is written in halves as above, in place:
    a barrier between the program's loads and its stores, since the threads that store a
    head's elements are not all those that loaded them.

    With ``STORE`` the k programs store their rotated keys, and the same heads' values from V,
    into the KV cache (KC, VC: [blocks, KV_BLOCK, kv heads, D] views) at the token's slot, as
    the attention backend's ``write_kv`` would (``cache_values``: an FP8 cache's rounding),
    and leave K as it was: one launch and one pass over the keys where there were two.
    """
    await_inputs(USE_PDL)
    if TOKENS == 1:
        t = tl.program_id(0).to(tl.int64)
        head = tl.arange(0, HEADS)
    else:  # row r: token r // HEADS of the program's, head r % HEADS of its group
        rows = tl.arange(0, TOKENS * HEADS)
        t = tl.program_id(0).to(tl.int64) * TOKENS + rows // HEADS
        live = t < tokens
        t = tl.minimum(t, tokens - 1)  # rows past the last token read it, and store nothing
        head = rows % HEADS
    pos = tl.load(positions + t).to(tl.int64)
    offs = tl.arange(0, BLOCK)
    group = tl.program_id(1)
    q_groups = tl.cdiv(NUM_Q_HEADS, HEADS)
    if group < q_groups:
        heads = group * HEADS + head
        base = Q + _per_row(t * stride_qt, TOKENS) + heads[:, None] * stride_qh
        h_ok = heads < NUM_Q_HEADS
        W = QW
    else:
        heads = (group - q_groups) * HEADS + head
        base = K + _per_row(t * stride_kt, TOKENS) + heads[:, None] * stride_kh
        h_ok = heads < NUM_K_HEADS
        W = KW
    if TOKENS > 1:
        h_ok = h_ok & live
    ok = h_ok[:, None] & (offs < HALF)[None, :]
    if INTERLEAVED:
        x1 = tl.load(base + 2 * offs[None, :], mask=ok, other=0.0)
        x2 = tl.load(base + 2 * offs[None, :] + 1, mask=ok, other=0.0)
    else:
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
    if TOKENS == 1:
        cos = tl.load(COS + pos * stride_c + offs, mask=c_ok, other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(SIN + pos * stride_c + offs, mask=c_ok, other=0.0).to(dtype).to(tl.float32)
        cos, sin = cos[None, :], sin[None, :]
    else:  # each row its token's position
        at = (pos * stride_c)[:, None] + offs[None, :]
        cos = tl.load(COS + at, mask=c_ok[None, :], other=0.0).to(dtype).to(tl.float32)
        sin = tl.load(SIN + at, mask=c_ok[None, :], other=0.0).to(dtype).to(tl.float32)
    if INTERLEAVED:  # (every thread's loads of the head done before any thread stores it)
        tl.debug_barrier()
    a1 = (x1f * cos).to(dtype).to(tl.float32)
    b1 = (x2f * sin).to(dtype).to(tl.float32)
    a2 = (x2f * cos).to(dtype).to(tl.float32)
    b2 = (x1f * sin).to(dtype).to(tl.float32)
    y1, y2 = (a1 - b1).to(dtype), (a2 + b2).to(dtype)
    if STORE and group >= q_groups:
        slot = tl.load(slots + t)
        dst = (slot // KV_BLOCK) * stride_cb + (slot % KV_BLOCK) * stride_cs
        dst = _per_row(dst, TOKENS) + heads[:, None] * stride_ch + offs[None, :]
        tl.store(KC + dst, cache_values(y1, k_scale, KC.dtype.element_ty), mask=ok)
        tl.store(KC + dst + HALF, cache_values(y2, k_scale, KC.dtype.element_ty), mask=ok)
        values = V + _per_row(t * stride_vt, TOKENS) + heads[:, None] * stride_vh + offs[None, :]
        v1 = tl.load(values, mask=ok, other=0.0)
        v2 = tl.load(values + HALF, mask=ok, other=0.0)
        tl.store(VC + dst, cache_values(v1, v_scale, VC.dtype.element_ty), mask=ok)
        tl.store(VC + dst + HALF, cache_values(v2, v_scale, VC.dtype.element_ty), mask=ok)
    else:
        tl.store(base + offs[None, :], y1, mask=ok)
        tl.store(base + HALF + offs[None, :], y2, mask=ok)


def rotary_(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos: torch.Tensor,
    sin: torch.Tensor,
    norm_weights: tuple[torch.Tensor, torch.Tensor] | None = None,
    eps: float = 0.0,
    store: tuple[torch.Tensor, LayerKVCache, torch.Tensor] | None = None,
    interleaved: bool = False,
) -> None:
    """Rotate q [T, Hq, D] and k [T, Hk, D] in place; cos/sin: [max_positions, D] float32.
    ``norm_weights`` (q's, k's): RMS-normalise each head first, in the same kernel.
    ``interleaved``: each head's pairs are adjacent and come out in halves (DeepSeek's).

    ``store`` (v [T, Hk, D], a layer's cache, its int64 slot per token): the keys, rotated,
    and the values go into the cache instead, and k is left as it was (``_rotary``)."""
    half = q.shape[-1] // 2
    tokens, num_q, num_k = q.shape[0], q.shape[1], k.shape[1]
    if interleaved and (norm_weights is not None or store is not None):
        raise ValueError("interleaved pairs are rotated alone: no norm, no store")
    if q.stride(-1) != 1 or k.stride(-1) != 1:
        raise ValueError("the rotary kernel needs each head's elements contiguous")
    if tokens == 0:
        return
    if store is not None and store[1].is_fp8 and not q.is_cuda:
        # Triton's interpreter rounds some values to e4m3 toward zero where the GPU rounds to
        # nearest: on CPU an FP8 cache takes PyTorch's rounding (as the Triton backend's write)
        v, cache, slots = store
        k = k.clone()  # (k is left as it was, as on a GPU)
        rotary_(positions, q, k, cos, sin, norm_weights, eps)
        write_kv(k, v, cache, slots[:tokens])
        return
    # on a GPU, a head per program below ROTARY_HEAD_TOKENS tokens (batch-1 decode: 2 programs
    # would do all the work), a whole q or k per program above; Triton's interpreter (CPU) runs
    # programs one after another, each at a fixed cost: there, always the fewest programs
    spread = q.is_cuda and tokens < ROTARY_HEAD_TOKENS
    heads = 1 if spread else triton.next_power_of_2(max(num_q, num_k))
    groups = triton.cdiv(num_q, heads) + triton.cdiv(num_k, heads)
    per_program = 1 if q.is_cuda else min(triton.next_power_of_2(tokens), ROTARY_INTERPRETER_TOKENS)
    block = triton.next_power_of_2(half)
    qw, kw = norm_weights if norm_weights is not None else (cos, cos)  # unread without a norm
    if store is None:  # placeholders the kernel never touches
        v, kc, vc, slots, k_scale, v_scale, block_size = k, k, k, positions, 1.0, 1.0, 1
        cache_strides: tuple[int, ...] = (0, 0, 0)
    else:
        v, cache, slots = store
        if v.shape != k.shape or v.stride(-1) != 1 or slots.shape[0] < tokens:
            raise ValueError("the values to store need k's shape, a contiguous head dimension "
                             "and a slot per token")  # fmt: skip
        if cache.key.stride() != cache.value.stride() or cache.key.stride(-1) != 1:
            raise ValueError("the KV cache's keys and values need one layout")
        kc, vc, block_size = cache.key, cache.value, cache.block_size
        k_scale, v_scale = float(cache.k_scale), float(cache.v_scale)
        cache_strides = kc.stride()[:3]  # block, slot, head (the head dim is contiguous)
    _rotary[(triton.cdiv(tokens, per_program), groups)](
        q, k, positions, cos, sin, qw, kw, eps, q.stride(0), q.stride(1), k.stride(0),
        k.stride(1), cos.stride(0), v, kc, vc, slots, k_scale, v_scale, v.stride(0),
        v.stride(1), *cache_strides, tokens,
        NUM_Q_HEADS=q.shape[1], NUM_K_HEADS=k.shape[1],
        HEADS=heads, HALF=half, BLOCK=block, HAS_NORM=norm_weights is not None,
        NORM_BLOCK=triton.next_power_of_2(2 * half), STORE=store is not None,
        KV_BLOCK=block_size, TOKENS=per_program, INTERLEAVED=interleaved, **launch_options(q),
        **({"num_warps": 4 if heads * block <= 1024 else 8} if q.is_cuda else {}),
    )  # fmt: skip
