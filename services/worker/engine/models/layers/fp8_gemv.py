"""The one-token FP8 linear layer on the tensor cores: y = W·x for an e4m3 weight W [N, K]
with a float32 scale per row, x one activation row quantized to e4m3 per token (or with a
static scale), as a skinny matrix product whose second operand is x repeated in 16 columns.

Why the tensor cores for a matrix-vector product: a GEMV on the CUDA cores spends
instructions on every weight (widen e4m3 to float32, multiply-add), three a weight at best,
and on an H200 that held it at 60–84 % of the weight-read bound where the bf16 GEMV reaches
82–100 % (docs/results/h200-2026-12-02b/NOTES.md). Here the weight tiles go from HBM to shared
memory by asynchronous copies, several stages deep, and one warpgroup matrix instruction
consumes 64×32 weights: the CUDA cores only issue loads. The 15 extra columns are free; the
tensor cores have two orders of magnitude of headroom at one token.

    W [N, K]            x repeated          acc [BLOCK_N, 16]
    ┌──────────────┐    ┌────┐              every column the same: W·x
    │ BLOCK_N rows │ ×  │ xx │  (BLOCK_K)   (the sum of the 16 columns ÷ 16 is exact)
    └──────────────┘    └────┘
      split s of SPLIT_K takes K's chunks [s·per, (s+1)·per)

Precision: the tensor cores accumulate FP8 products in fewer bits than float32; the partial
sums are promoted into a float32 accumulator after every BLOCK_K columns
(``max_num_imprecise_acc``), as vLLM and DeepSeek do for FP8 GEMMs, so the error stays that of
one chunk (the GPU tests bound it as they bound ``fp8_mm``'s).

Split-K, deterministic: a projection with few rows (o, down: 4096) has fewer row blocks than
the GPU has SMs, so its K is split over SPLIT_K programs. Each writes its partial sums to a
workspace and counts itself in; the last of a row block to arrive adds the partials in split
order (the same order whoever arrives last), scales, adds the bias and stores, then resets the
counter for the next call. Workspace and counters live per device, made on the first call
(outside CUDA-graph capture: the engine warms up first); calls on one stream run one after
another (with PDL too: every program waits for the kernel before it before touching them).
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.dependent_launch import await_inputs, launch_options
from services.worker.engine.models.layers.fp8_linear import _quantize, _row_scale

COLUMNS = 16  # the narrowest operand the tensor cores' FP8 instruction takes in Triton
MAX_BLOCKS = 4096  # row blocks with a counter: N up to 4096 × BLOCK_N
MAX_SPLIT = 16
MAX_N = 1 << 17  # workspace rows: partial sums of N ≤ 131,072 outputs


@triton.jit
def _fp8_gemv_tc_kernel(
    X, XQ, W, WS, B, Y, xs_in, P, C, N, K, stride_wn,
    STATIC: tl.constexpr, CODES: tl.constexpr, HAS_BIAS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, AMAX_BLOCK: tl.constexpr,
    GPU: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """X: the activation row [K] (or, with CODES, XQ its e4m3 codes and xs_in its scale);
    W: [N, K] e4m3, rows ``stride_wn`` apart; P: [SPLIT_K, N] float32 partials; C: int32
    counters per row block (zero between calls). The grid is (row blocks, SPLIT_K)."""
    block = tl.program_id(0)
    split = tl.program_id(1)
    splits = tl.num_programs(1)
    rows = block * BLOCK_N + tl.arange(0, BLOCK_N)
    row_ok = rows < N
    per = tl.cdiv(tl.cdiv(K, BLOCK_K), splits) * BLOCK_K
    k_lo = split * per
    k_hi = tl.minimum(K, k_lo + per)
    w_rows = W + rows[:, None].to(tl.int64) * stride_wn
    await_inputs(USE_PDL)
    if CODES:
        xs = tl.load(xs_in)
        r = xs  # unused
    else:
        xs = _row_scale(X, K, xs_in, STATIC, AMAX_BLOCK)
        r = tl.math.div_rn(1.0, xs)
    acc = tl.zeros([BLOCK_N, 16], tl.float32)
    for k0 in range(k_lo, k_hi, BLOCK_K):
        cols = k0 + tl.arange(0, BLOCK_K)
        ok = cols < K
        w = tl.load(w_rows + cols[None, :], mask=row_ok[:, None] & ok[None, :], other=0.0)
        if CODES == 2:  # codes already repeated in 16 rows of K: straight to shared memory
            n16 = tl.arange(0, 16)
            xb = tl.load(XQ + n16[None, :] * K + cols[:, None], mask=ok[:, None], other=0.0)
        else:
            if CODES == 1:
                xq = tl.load(XQ + cols, mask=ok, other=0.0)
            else:
                x = tl.load(X + cols, mask=ok, other=0.0).to(tl.float32)
                xq = _quantize(x, xs, r, GPU)
            xb = tl.broadcast_to(xq[:, None], (BLOCK_K, 16))
        acc = tl.dot(w, xb, acc, max_num_imprecise_acc=BLOCK_K)
    part = tl.sum(acc, axis=1) * 0.0625  # 16 equal columns: exact
    if splits == 1:
        _finish(part, xs, WS, B, Y, rows, row_ok, HAS_BIAS)
    else:
        tl.store(P + split * N + rows, part, mask=row_ok)
        tl.debug_barrier()  # every thread's partial before the count (release below)
        arrived = tl.atomic_add(C + block, 1, sem="acq_rel")
        if arrived == splits - 1:  # the last of this row block: the others' partials are out
            total = tl.zeros([BLOCK_N], tl.float32)
            for s in range(0, splits):
                total += tl.load(P + s * N + rows, mask=row_ok, other=0.0, cache_modifier=".cg")
            tl.atomic_xchg(C + block, 0)
            _finish(total, xs, WS, B, Y, rows, row_ok, HAS_BIAS)


@triton.jit
def _finish(y, xs, WS, B, Y, rows, row_ok, HAS_BIAS: tl.constexpr):
    y = y * xs * tl.load(WS + rows, mask=row_ok, other=0.0)
    if HAS_BIAS:
        y += tl.load(B + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(Y + rows, y.to(Y.dtype.element_ty), mask=row_ok)


_workspaces: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _workspace(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(partials [MAX_SPLIT · MAX_N] float32, counters [MAX_BLOCKS] int32 at zero) of a device."""
    if device not in _workspaces:
        _workspaces[device] = (
            torch.empty(MAX_SPLIT * MAX_N, dtype=torch.float32, device=device),
            torch.zeros(MAX_BLOCKS, dtype=torch.int32, device=device),
        )
    return _workspaces[device]


DEFAULT = {"BLOCK_N": 64, "BLOCK_K": 256, "SPLIT_K": 1, "num_warps": 4, "num_stages": 4}


def fp8_gemv_tc(
    x: torch.Tensor,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None = None,
    input_scale: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    codes: tuple[torch.Tensor, torch.Tensor] | None = None,
    repeated: bool = False,
) -> torch.Tensor:
    """x: [1, K]; weight: [N, K] e4m3 (rows contiguous); weight_scale: [N, 1] float32;
    returns [1, N] in x's dtype. ``codes``: x already quantized (e4m3 [1, K], float32 scale
    [1, 1]), as a fused kernel before would hand it over. ``config``: BLOCK_N, BLOCK_K,
    SPLIT_K, num_warps, num_stages."""
    assert x.shape[0] == 1 and weight.stride(1) == 1, "one token, row-major weight"
    n, k = weight.shape
    c = dict(config or DEFAULT)
    split = c.pop("SPLIT_K")
    blocks = triton.cdiv(n, c["BLOCK_N"])
    assert split <= MAX_SPLIT and n <= MAX_N and blocks <= MAX_BLOCKS
    x = x.contiguous()
    y = torch.empty((1, n), dtype=x.dtype, device=x.device)
    partials, counters = _workspace(x.device)
    xq, xs = codes if codes is not None else (x, None)
    scale = xs if xs is not None else input_scale.reshape(1).float() if input_scale is not None else weight_scale
    _fp8_gemv_tc_kernel[(blocks, split)](
        x, xq, weight, weight_scale, bias if bias is not None else y, y, scale,
        partials, counters, n, k, weight.stride(0),
        STATIC=input_scale is not None, CODES=0 if codes is None else 2 if repeated else 1, HAS_BIAS=bias is not None,
        AMAX_BLOCK=min(8192, triton.next_power_of_2(k)) if x.is_cuda else 128,
        GPU=x.is_cuda, **c, **launch_options(x),
    )  # fmt: skip
    return y
