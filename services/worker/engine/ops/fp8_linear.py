"""FP8 linear layers on a GPU: weights in e4m3 with a float32 scale per output row (per-tensor
checkpoints give every row of a tensor the same one), activations quantized to e4m3 at the
layer's input, dynamically per token or with the checkpoint's static scale.

- One token (batch-1 decode; ``fp8_gemv``): a Triton matrix-vector product that reads the FP8
  weight once, quantizes the activation row itself (its absolute maximum, then each chunk,
  exactly as ``quantization/fp8_math.quantize_activations`` does) and multiplies in float32,
  scaling once at the end: a weight read of one byte per parameter, in one kernel, which CUDA
  graphs capture.
- More rows (prefill, batched decode; ``fp8_mm``): the rows quantized by one Triton kernel
  (``quantize_rows``: a scale per row), then the FP8 tensor cores through ``torch._scaled_mm``
  with row-wise scales (bf16/fp16 out; float32 models take the product unscaled in float32
  and scale it after, since row-wise scaling writes 16-bit outputs only). For the row counts
  of a decode batch, where the GPU's table (``gemv_configs.gemm_launch``) holds a launch that
  measured faster, our own tensor-core kernel instead (``fp8_gemm``): the product computed
  transposed, so the few rows sit on the tensor cores' narrow side, and K split over programs
  where the weight's rows alone make too few tiles to fill the GPU.
- Either takes its input already quantized (``quantization.Codes``), when the kernel before
  it wrote the codes with its output row in registers (``store_codes``, called by
  ``fused_ops``' RMSNorm and SiLU·mul): the GEMV then only widens codes and the rows skip
  ``quantize_rows``. A layer says whether it takes them (``LinearBase.input_group``: its
  quantization method answers).

- Block checkpoints (128×128 weight blocks, activations per token and 128-column group;
  ``ops/fp8_block.py``) use both: the GEMV with a scale per block (``group``) and
  ``fp8_gemm`` with a scale pair a K tile (``GROUPED``).

The plain-PyTorch path (quantization/fp8_math.py) is the reference these are tested against
(tests/gpu/test_fp8_kernels.py, and in Triton's interpreter tests/unit/test_fp8_kernels.py).
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.ops import gemv_configs
from services.worker.engine.ops.dependent_launch import await_inputs, launch_options
from services.worker.engine.quantization.fp8_math import FP8, FP8_MAX, Codes

MIN_SCALE = 1e-12  # as the reference clamps a scale of an all-zero row


@triton.jit
def _scale_of(amax):
    """A row's per-token scale from its largest magnitude: amax / FP8_MAX, correctly rounded,
    at least MIN_SCALE (the reference's ``divide(...).clamp(min=1e-12)``)."""
    return tl.maximum(tl.math.div_rn(amax, 448.0), 1e-12)


@triton.jit
def _row_scale(X, K, xs_in, STATIC: tl.constexpr, BLOCK_K: tl.constexpr):
    """The row's activation scale: the static one, or max |x| / FP8_MAX (at least MIN_SCALE)."""
    if STATIC:
        return tl.load(xs_in).to(tl.float32)
    amax = tl.zeros([BLOCK_K], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        amax = tl.maximum(amax, tl.abs(x))
    return _scale_of(tl.max(amax, 0))


@triton.jit
def _quantize(x, xs, r, GPU: tl.constexpr):
    """x / xs rounded to e4m3, saturated at ±FP8_MAX (as the reference's clamp, then cast).
    ``r`` is 1 / xs correctly rounded: on a GPU the quotient is x·r corrected by one fused
    multiply-add with its remainder, which is the correctly rounded quotient (Markstein's
    theorem; on an H200 equal to ``div_rn``'s on 16.8M values of 4096-wide rows), without the
    reciprocal, range check and slow-path call ``div_rn`` spends per element. The interpreter
    has no fused multiply-add and keeps ``div_rn``."""
    if GPU:
        q0 = x * r
        q = tl.fma(tl.fma(-q0, xs, x), r, q0)
    else:
        q = tl.math.div_rn(x, xs)
    return tl.minimum(tl.maximum(q, -448.0), 448.0).to(tl.float8e4nv)


@triton.jit
def store_codes(y, ok, Q, S, GPU: tl.constexpr):
    """A whole row ``y`` (float32, masked lanes 0) quantized per token, as ``quantize_rows``
    and the reference quantize it: its scale max |y| / FP8_MAX (at least MIN_SCALE) to S,
    the codes to the pointers Q."""
    xs = _scale_of(tl.max(tl.abs(y), 0))
    tl.store(Q, _quantize(y, xs, tl.math.div_rn(1.0, xs), GPU), mask=ok)
    tl.store(S, xs)


@triton.jit
def _quantize_rows_kernel(
    X, Q, S, xs_in, K, stride_x, stride_q,
    STATIC: tl.constexpr, BLOCK_K: tl.constexpr, GPU: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    await_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    X += row * stride_x
    xs = _row_scale(X, K, xs_in, STATIC, BLOCK_K)
    r = tl.math.div_rn(1.0, xs)
    tl.store(S + row, xs)
    for k0 in range(0, K, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(X + cols, mask=cols < K, other=0.0).to(tl.float32)
        tl.store(Q + row * stride_q + cols, _quantize(x, xs, r, GPU), mask=cols < K)


@triton.jit
def _code(words, shift: tl.constexpr):
    return ((words >> shift) & 0xFF).to(tl.uint8).to(tl.float8e4nv, bitcast=True).to(tl.float32)


@triton.jit
def _widen4(words, GPU: tl.constexpr):
    """int32 words of four e4m3 codes (little-endian) as four float32 tensors, codes 0 to 3.
    On a GPU in PTX: two e4m3x2 → f16x2 conversions and four widenings a word. Triton's own
    cast of an e4m3 tile takes each byte out of the loaded vector and packs pairs again, 5.7
    instructions a weight in the GEMV's loop against 3.0 this way, and the GEMV was bound by
    its instructions, not by HBM (docs/performance.md, "FP8": the GEMV). The interpreter
    (no PTX) takes the bytes by shifts."""
    if GPU:
        return tl.inline_asm_elementwise(
            """{
            .reg .b16 lo, hi, a0, a1, b0, b1;
            .reg .b32 a, b;
            mov.b32 {lo, hi}, $4;
            cvt.rn.f16x2.e4m3x2 a, lo;
            cvt.rn.f16x2.e4m3x2 b, hi;
            mov.b32 {a0, a1}, a;
            mov.b32 {b0, b1}, b;
            cvt.f32.f16 $0, a0;
            cvt.f32.f16 $1, a1;
            cvt.f32.f16 $2, b0;
            cvt.f32.f16 $3, b1;
            }""",
            "=r,=r,=r,=r,r", [words], dtype=(tl.float32, tl.float32, tl.float32, tl.float32),
            is_pure=True, pack=1,
        )  # fmt: skip
    return _code(words, 0), _code(words, 8), _code(words, 16), _code(words, 24)


# FAST: an activation code widened to float16 counts in units of 1/256, so that a word's four
# products and their sums stay below float16's largest value (448 · 448/256 · 4 = 3,136) and
# are exact until they are added (two codes' product has at most 8 significant bits); the
# float32 sum is scaled back once at the end
X_UNIT: tl.constexpr = tl.constexpr(256.0)


@triton.jit
def _halves(words):
    """int32 words of four activation codes as two words of float16 pairs (codes 0, 1 and
    2, 3), each code / X_UNIT (exact: a power of two)."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi;
        .reg .b32 unit;
        mov.b32 {lo, hi}, $2;
        mov.b32 unit, 0x1C001C00;
        cvt.rn.f16x2.e4m3x2 $0, lo;
        cvt.rn.f16x2.e4m3x2 $1, hi;
        mul.rn.f16x2 $0, $0, unit;
        mul.rn.f16x2 $1, $1, unit;
        }""",
        "=r,=r,r", [words], dtype=(tl.int32, tl.int32), is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _dot_word(w, x01, x23):
    """A weight word's four codes times their activations (``_halves``), in float32: the
    products of codes 0, 2 and of 1, 3 summed in float16 pairs by a multiply and a fused
    multiply-add, the pair added in float16, then widened: seven instructions for four
    weights, where widening each weight to float32 took four for one."""
    return tl.inline_asm_elementwise(
        """{
        .reg .b16 lo, hi, s0, s1, h;
        .reg .b32 a, b, p;
        mov.b32 {lo, hi}, $1;
        cvt.rn.f16x2.e4m3x2 a, lo;
        cvt.rn.f16x2.e4m3x2 b, hi;
        mul.rn.f16x2 p, a, $2;
        fma.rn.f16x2 p, b, $3, p;
        mov.b32 {s0, s1}, p;
        add.rn.f16 h, s0, s1;
        cvt.f32.f16 $0, h;
        }""",
        "=r,r,r,r", [w, x01, x23], dtype=tl.float32, is_pure=True, pack=1,
    )  # fmt: skip


@triton.jit
def _x_codes(X, first, ok, xs, r, GPU: tl.constexpr, CODES: tl.constexpr):
    """The activation's elements ``first`` (every fourth column) quantized, as float32 (with
    CODES, X holds the codes already)."""
    if CODES:
        return tl.load(X + first, mask=ok, other=0.0).to(tl.float32)
    x = tl.load(X + first, mask=ok, other=0.0).to(tl.float32)
    return _quantize(x, xs, r, GPU).to(tl.float32)


@triton.jit
def _group_scales(xs_in, ws_row, j, k4, GROUP: tl.constexpr, stride_wsg):
    """Block checkpoints: the product of the activation's and the weight block's scales of the
    groups that words ``j`` (four columns each) fall in; 1 without GROUP (the row's scales
    are applied once, after the sums)."""
    scales = 1.0
    if GROUP:
        g = (4 * j) // GROUP
        ok = j < k4
        xs = tl.load(xs_in + g, mask=ok, other=0.0)
        scales = xs * tl.load(ws_row + g * stride_wsg, mask=ok, other=0.0)
    return scales


@triton.jit
def _fp8_gemv_kernel(
    X, W, WS, B, Y, xs_in, N, K, stride_wn,
    STATIC: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr, AMAX_BLOCK: tl.constexpr, GPU: tl.constexpr, CODES: tl.constexpr,
    USE_PDL: tl.constexpr = False, FAST: tl.constexpr = False, GROUP: tl.constexpr = 0,
    stride_wsg=0, stride_wsn=0,
):  # fmt: skip
    """W: the e4m3 weight as int32 words of four codes ([N, K / 4], ``stride_wn`` in words);
    BLOCK_K counts weights (BLOCK_K / 4 words a tile). Column 4j + b of the product is word j's
    code b: each tile is four products of a widened code plane with the matching activation
    columns. With CODES, X is the activation's e4m3 codes and ``xs_in`` its scale.

    FAST (with CODES, on a GPU: fast accumulation, as ``fp8_mm``'s): a word's four products
    in float16 (``_dot_word``), added to the float32 sums a word at a time. (Without codes it
    measured slower for the o projection, the 8B shape's only such layer: each program
    quantizes the row's columns again, docs/performance.md, "FP8": its products in float16.)

    GROUP (block checkpoints, with CODES): ``xs_in`` holds the codes' scale per GROUP columns
    and WS the weight's per block, [K / GROUP, N / GROUP] (strides ``stride_wsg``,
    ``stride_wsn``). A program's BLOCK_N rows lie in one block row (BLOCK_N divides GROUP), so
    each column's two scales are one factor for all of them, taken into the column's sums as
    they are added (a word's four columns share a group)."""
    WORDS: tl.constexpr = BLOCK_K // 4
    k4 = K // 4
    rows = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    # the first weight tile before the wait (no kernel of a step writes weights: with PDL the
    # read overlaps the previous kernel's tail), then the activation's scale in AMAX_BLOCK-wide
    # loads (one or two for an 8B model's rows): measured 1.2x faster than a BLOCK_K-wide scan
    # after the wait (docs/performance.md, "FP8": one token)
    j = tl.arange(0, WORDS)
    w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < k4)[None, :], other=0)
    await_inputs(USE_PDL)
    ws_row = WS  # GROUP: the program's row of block scales
    if GROUP:
        xs = 1.0  # (the scales come a column at a time)
        r = xs  # unread
        ws_row += (tl.program_id(0) * BLOCK_N // GROUP) * stride_wsn
    elif CODES:
        xs = tl.load(xs_in)
        r = xs  # unread
    else:
        xs = _row_scale(X, K, xs_in, STATIC, AMAX_BLOCK)
        r = tl.math.div_rn(1.0, xs)
    acc = tl.zeros([BLOCK_N, WORDS], tl.float32)
    if FAST:
        XW = X.to(tl.pointer_type(tl.int32), bitcast=True)  # the codes four to a word
        for k0 in range(0, k4, WORDS):
            j = k0 + tl.arange(0, WORDS)
            x01, x23 = _halves(tl.load(XW + j, mask=j < k4, other=0))
            dot = _dot_word(w, tl.broadcast_to(x01[None, :], (BLOCK_N, WORDS)),
                            tl.broadcast_to(x23[None, :], (BLOCK_N, WORDS)))  # fmt: skip
            acc += dot * _group_scales(xs_in, ws_row, j, k4, GROUP, stride_wsg)[None, :]
            j += WORDS
            w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < k4)[None, :], other=0)
        xs = xs * X_UNIT
    else:
        for k0 in range(0, k4, WORDS):
            j = k0 + tl.arange(0, WORDS)
            ok = j < k4
            w0, w1, w2, w3 = _widen4(w, GPU)
            sc = _group_scales(xs_in, ws_row, j, k4, GROUP, stride_wsg)  # the columns' scales
            acc += w0 * (_x_codes(X, 4 * j, ok, xs, r, GPU, CODES) * sc)[None, :]
            acc += w1 * (_x_codes(X, 4 * j + 1, ok, xs, r, GPU, CODES) * sc)[None, :]
            acc += w2 * (_x_codes(X, 4 * j + 2, ok, xs, r, GPU, CODES) * sc)[None, :]
            acc += w3 * (_x_codes(X, 4 * j + 3, ok, xs, r, GPU, CODES) * sc)[None, :]
            j += WORDS
            w = tl.load(w_rows + j[None, :], mask=row_ok[:, None] & (j < k4)[None, :], other=0)
    if GROUP:
        y = tl.sum(acc, axis=1) * xs
    else:
        y = tl.sum(acc, axis=1) * xs * tl.load(WS + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


# one byte per weight: wider K chunks than the bf16 GEMV's for the same bytes per load (the
# fastest of each 8B projection in a sweep, and neighbours; with FAST too: whole 4,096-wide
# rows a tile lost to these; docs/performance.md, "FP8": one token)
_CONFIGS = [
    triton.Config({"BLOCK_N": n, "BLOCK_K": k}, num_warps=w, num_stages=s)
    for n, k, w, s in [
        (4, 2048, 4, 3), (8, 1024, 4, 3), (8, 2048, 4, 3), (16, 512, 4, 3), (16, 1024, 8, 3),
        (16, 2048, 4, 3), (32, 512, 4, 3),
    ]
]  # fmt: skip
_fp8_gemv_tuned = triton.autotune(
    configs=_CONFIGS, key=["N", "K", "HAS_BIAS", "STATIC", "CODES", "FAST", "GROUP"]
)(_fp8_gemv_kernel)


@triton.jit
def _fp8_gemm_kernel(
    X, XS, W, WS, B, Y, PARTS, TICKETS, M, N, K, SPLITS, k_per_split, stride_xm, stride_wn,
    stride_ym, stride_xsm, stride_xsg, stride_wsn, stride_wsg,
    HAS_BIAS: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr, PRECISE: tl.constexpr, GROUPED: tl.constexpr = False,
):  # fmt: skip
    """Y = (X · xs) (W · ws)ᵀ for a few rows, on the FP8 tensor cores, computed transposed: a
    program's tile is BLOCK_N weight rows × BLOCK_M activation rows, so the weight's rows fill
    the tensor cores' 64-row side and a decode batch of 16-256 rows their narrow side (where
    cuBLASLt's tiles of 128 activation rows leave most of the machine idle: an 8B model's o and
    down projections at 256 rows are 64 tiles of 128 × 128 on 132 SMs). X: [M, K] e4m3 codes,
    XS their scale per row; W: [N, K] e4m3, WS a scale per weight row.

    With SPLITS > 1 each program sums one of SPLITS slices of K (``k_per_split`` columns) into
    float32 PARTS [SPLITS, M, N]; the last of a tile's programs to finish (a ticket counter per
    tile, TICKETS, left at 0 again) adds the slices in their order, so the sum does not depend
    on which program finished first.

    The tensor cores' partial sums are promoted to float32 once a BLOCK_K tile with PRECISE,
    else never (Triton's default on Hopper): cuBLASLt's two accumulation modes.

    GROUPED (block checkpoints): a scale per BLOCK_K columns on both sides, XS [M, K / BLOCK_K]
    (the activation's per token and group) and WS [N, K / BLOCK_K] (the weight block's, one row
    per weight row), each with its two strides; each tile's product is scaled by its two and
    added to float32 sums, which is a promotion a tile whatever PRECISE says."""
    pid_n, pid_m, split = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_ok, m_ok = rn < N, rm < M
    k_lo = split * k_per_split
    k_hi = tl.minimum(k_lo + k_per_split, K)
    w_ptrs = W + rn[:, None].to(tl.int64) * stride_wn + (k_lo + rk)[None, :]
    x_ptrs = X + rm[None, :].to(tl.int64) * stride_xm + (k_lo + rk)[:, None]
    acc = tl.zeros([BLOCK_N, BLOCK_M], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        k_ok = (k0 + rk) < k_hi
        w = tl.load(w_ptrs, mask=n_ok[:, None] & k_ok[None, :], other=0.0)
        x = tl.load(x_ptrs, mask=k_ok[:, None] & m_ok[None, :], other=0.0)
        if GROUPED:
            g = k0 // BLOCK_K
            ws = tl.load(WS + rn.to(tl.int64) * stride_wsn + g * stride_wsg, mask=n_ok, other=0.0)
            xs = tl.load(XS + rm.to(tl.int64) * stride_xsm + g * stride_xsg, mask=m_ok, other=0.0)
            acc += tl.dot(w, x) * (ws[:, None] * xs[None, :])
        elif PRECISE:
            acc = tl.dot(w, x, acc, max_num_imprecise_acc=BLOCK_K)
        else:
            acc = tl.dot(w, x, acc)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    tile = rm[None, :].to(tl.int64) * N + rn[:, None]  # (m, n) of [M, N], a tile's elements
    ok = n_ok[:, None] & m_ok[None, :]
    if SPLITS == 1:
        _gemm_store(acc, rn, rm, n_ok, m_ok, XS, WS, B, Y, stride_ym, HAS_BIAS, not GROUPED)
    else:
        tl.store(PARTS + split * M * N + tile, acc, mask=ok)
        # every thread's slice stored, then one ticket: release, and acquire for the last
        tl.debug_barrier()
        counter = TICKETS + pid_m * tl.num_programs(0) + pid_n
        if tl.atomic_add(counter, 1, sem="acq_rel") == SPLITS - 1:
            tl.debug_barrier()
            acc = tl.load(PARTS + tile, mask=ok, other=0.0, cache_modifier=".cg")
            for s in range(1, SPLITS):
                acc += tl.load(PARTS + s * M * N + tile, mask=ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(counter, 0)
            _gemm_store(acc, rn, rm, n_ok, m_ok, XS, WS, B, Y, stride_ym, HAS_BIAS, not GROUPED)


@triton.jit
def _gemm_store(
    acc, rn, rm, n_ok, m_ok, XS, WS, B, Y, stride_ym, HAS_BIAS: tl.constexpr, SCALE: tl.constexpr
):  # fmt: skip
    """A [BLOCK_N, BLOCK_M] tile of float32 sums scaled (weight row, activation row) unless
    scaled already (SCALE false), biased, stored to Y [M, N]."""
    y = acc
    if SCALE:
        y = y * tl.load(WS + rn, mask=n_ok, other=0.0)[:, None]
        y = y * tl.load(XS + rm, mask=m_ok, other=0.0)[None, :]
    if HAS_BIAS:
        y += tl.load(B + rn, mask=n_ok, other=0.0).to(tl.float32)[:, None]
    out = Y + rm[None, :].to(tl.int64) * stride_ym + rn[:, None]
    tl.store(out, y.to(Y.dtype.element_ty), mask=n_ok[:, None] & m_ok[None, :])


_TICKETS: dict[torch.device, torch.Tensor] = {}
_RETIRED: list[torch.Tensor] = []  # outgrown ticket buffers, which captured graphs may hold


def _tickets(device: torch.device, count: int) -> torch.Tensor:
    """The split-K ticket counters of a device (zeros, and left zero by every launch). Made
    (or grown) outside graph captures: the engine runs each step shape eagerly before it
    captures it. An outgrown buffer is never freed, since a graph captured over it replays it."""
    buf = _TICKETS.get(device)
    if buf is None or buf.numel() < count:
        if device.type == "cuda":
            assert not torch.cuda.is_current_stream_capturing(), "fp8_gemm: tickets in a capture"
        if buf is not None:
            _RETIRED.append(buf)
        buf = _TICKETS[device] = torch.zeros(max(count, 1 << 16), dtype=torch.int32, device=device)
    return buf


def fp8_gemm(
    x: Codes,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    config: dict[str, int],
    fast_accumulation: bool = False,
    group: int = 0,
) -> torch.Tensor:
    """``fp8_mm``'s product by ``_fp8_gemm_kernel`` at one launch: ``config`` holds BLOCK_N,
    BLOCK_M, BLOCK_K, SPLITS, num_warps, num_stages (``gemv_configs.gemm_launch``). ``fp8_mm``
    takes float32 models to cuBLASLt. ``fast_accumulation``: as ``fp8_mm``'s and
    ``fp8_gemv``'s, off unless asked. ``group`` (block checkpoints, ``fp8_block.fp8_block_mm``): the
    scales are per ``group`` columns, ``x.scales`` [M, K / group] and ``weight_scale``
    [N, K / group]; BLOCK_K must be ``group``."""
    xq, xs = x.codes, x.scales
    m, k = xq.shape
    n = weight.shape[0]
    assert xq.stride(1) == 1 and weight.stride(1) == 1, "rows contiguous"
    if group:
        assert config["BLOCK_K"] == group, "a K tile is one scale group"
        assert xs.shape == (m, triton.cdiv(k, group)) and weight_scale.shape[0] == n
    y = torch.empty((m, n), dtype=x.dtype, device=xq.device)
    config = dict(config)
    splits = config.pop("SPLITS")
    block_k = config["BLOCK_K"]
    k_per_split = triton.cdiv(triton.cdiv(k, block_k), splits) * block_k
    grid = (triton.cdiv(n, config["BLOCK_N"]), triton.cdiv(m, config["BLOCK_M"]), splits)
    if splits > 1:
        parts = torch.empty((splits, m, n), dtype=torch.float32, device=xq.device)
        tickets = _tickets(xq.device, grid[0] * grid[1])
    else:
        parts = tickets = y  # unread
    _fp8_gemm_kernel[grid](
        xq, xs, weight, weight_scale, bias if bias is not None else y, y, parts, tickets,
        m, n, k, splits, k_per_split, xq.stride(0), weight.stride(0), y.stride(0),
        *xs.stride(), *weight_scale.stride(),
        HAS_BIAS=bias is not None, PRECISE=not fast_accumulation, GROUPED=group > 0, **config,
    )  # fmt: skip
    return y


def _static(input_scale: torch.Tensor | None, like: torch.Tensor) -> torch.Tensor:
    """The static activation scale as a float32 scalar tensor (a placeholder when dynamic)."""
    if input_scale is None:
        return like  # unused without STATIC
    return input_scale.reshape(1).float()


def fp8_gemv(
    x: torch.Tensor | Codes,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fast_accumulation: bool = False,
    group: int = 0,
) -> torch.Tensor:
    """x: [1, K], or its codes; weight: [N, K] e4m3 (rows contiguous); weight_scale: [N, 1]
    float32; returns [1, N] in x's dtype. ``config``: as ``gemv.gemv``'s. With
    ``fast_accumulation`` and codes, on a GPU, each word's four products are summed in
    float16 before the float32 sum (fewer instructions a weight; ``fp8_mm``'s option).
    ``group`` (block checkpoints): x is codes with a scale per ``group`` columns
    (``fp8_block.quantize_groups``) and ``weight_scale`` the weight's per block, [K / group,
    N / group] (``fp8_block.block_scales``)."""
    codes = isinstance(x, Codes)
    xin = x.codes if isinstance(x, Codes) else x.contiguous()
    assert xin.shape[0] == 1 and weight.stride(1) == 1, "one token, row-major weight"
    n, k = weight.shape
    assert k % 4 == 0 and weight.stride(0) % 4 == 0, "rows of whole 4-byte words"
    words = weight.view(torch.int32)  # the kernel reads four codes a load element
    y = torch.empty((1, n), dtype=x.dtype, device=xin.device)
    scale = x.scales if isinstance(x, Codes) else _static(input_scale, weight_scale)
    flags: dict[str, int] = {"STATIC": input_scale is not None, "HAS_BIAS": bias is not None}
    if group:  # (a scale a group: the row's, one after the other)
        assert isinstance(x, Codes) and x.scales.shape == (1, triton.cdiv(k, group))
        assert n % group == 0 and weight_scale.shape == (triton.cdiv(k, group), n // group)
        scale = x.scales.contiguous()
        flags.update(GROUP=group, stride_wsg=weight_scale.stride(0),
                     stride_wsn=weight_scale.stride(1))  # fmt: skip
    args = (xin, words, weight_scale, bias if bias is not None else y, y, scale, n, k,
            words.stride(0))  # fmt: skip
    flags["AMAX_BLOCK"] = min(8192, triton.next_power_of_2(k)) if xin.is_cuda else 128
    flags["GPU"], flags["CODES"] = y.is_cuda, codes
    flags["FAST"] = fast_accumulation and codes and y.is_cuda
    if y.is_cuda:  # (y: one token on x's device, what the launch options ask)
        kind = "fp8_gemv_codes" if codes else "fp8_gemv"
        kind += "_fast" if flags["FAST"] else ""
        config = config or gemv_configs.launch(kind, y, n, k)
        if config is not None:
            assert group % config["BLOCK_N"] == 0, "a program's rows in one block row"
            grid = (triton.cdiv(n, config["BLOCK_N"]),)
            _fp8_gemv_kernel[grid](*args, **flags, **config, **launch_options(y))
            return y
        tuned_grid = lambda meta: (triton.cdiv(n, meta["BLOCK_N"]),)  # noqa: E731
        _fp8_gemv_tuned[tuned_grid](*args, **flags, **launch_options(y))
    else:  # Triton's interpreter (tests on CPU): one fixed tile
        _fp8_gemv_kernel[(triton.cdiv(n, 8),)](*args, **flags, BLOCK_N=8, BLOCK_K=128)
    return y


def quantize_rows(
    x: torch.Tensor, input_scale: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x: [M, K] → (e4m3 [M, K], float32 scales [M, 1]), one Triton kernel."""
    x = x.contiguous()
    m, k = x.shape
    q = torch.empty((m, k), dtype=FP8, device=x.device)
    s = torch.empty((m, 1), dtype=torch.float32, device=x.device)
    _quantize_rows_kernel[(m,)](
        x, q, s, _static(input_scale, s), k, x.stride(0), q.stride(0),
        STATIC=input_scale is not None, BLOCK_K=min(4096, triton.next_power_of_2(k)),
        GPU=x.is_cuda, num_warps=8, **launch_options(x),
    )  # fmt: skip
    return q, s


def fp8_mm(
    x: torch.Tensor | Codes,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """x: [M, K], or its codes → [M, N] in x's dtype, on the FP8 tensor cores. With
    ``fast_accumulation`` the tensor cores' partial sums are not promoted to float32 as the
    product goes (cuBLASLt's fast-accumulation mode): faster, less exact over long rows
    (``benchmarks/kernels/fp8_mm.py`` measures both)."""
    if isinstance(x, Codes):
        xq, xs, dtype = x.codes, x.scales, x.dtype
    else:
        (xq, xs), dtype = quantize_rows(x, input_scale), x.dtype
    if dtype in (torch.bfloat16, torch.float16):
        config = gemv_configs.gemm_launch(xq, xq.shape[0], *weight.shape)
        if config is not None:  # measured faster than cuBLASLt for this shape and row count
            return fp8_gemm(Codes(xq, xs, dtype), weight, weight_scale, bias, config,
                            fast_accumulation)  # fmt: skip
    ws = weight_scale.reshape(1, -1)
    if dtype in (torch.bfloat16, torch.float16):
        y = torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=ws, out_dtype=dtype,
                             use_fast_accum=fast_accumulation)  # fmt: skip
    else:  # row-wise scales write 16-bit outputs only: scale the float32 product after
        one = torch.ones((), dtype=torch.float32, device=xq.device)
        y = torch._scaled_mm(xq, weight.t(), scale_a=one, scale_b=one, out_dtype=torch.float32,
                             use_fast_accum=fast_accumulation)  # fmt: skip
        y = y * xs * ws
    return y if bias is None else y + bias


def supported(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """These kernels take this input: on a GPU with FP8 tensor cores (compute capability 8.9
    and up), 16-aligned dims (the tensor cores' tiles)."""
    if not x.is_cuda or torch.cuda.get_device_capability(x.device) < (8, 9):
        return False
    n, k = weight.shape
    return n % 16 == 0 and k % 16 == 0


__all__ = [
    "FP8_MAX", "MIN_SCALE", "fp8_gemm", "fp8_gemv", "fp8_mm", "quantize_rows", "store_codes",
    "supported",
]  # fmt: skip
