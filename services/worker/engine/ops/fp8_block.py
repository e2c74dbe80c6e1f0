"""FP8 block checkpoints on a GPU: weights in 128×128 blocks of e4m3, each with a float32
scale; activations quantized per token and 128 columns (``quantization/fp8_math``'s
``token_group``), as the ``fp8`` method's checkpoints store them.

``fp8_block_mm`` quantizes the rows (``quantize_groups``: one Triton kernel, the scales stored
column by column, the layout cuBLASLt reads), then

- one row: ``fp8_linear.fp8_gemv`` with ``group``, each column's activation and weight block
  scales taken into its sums;
- 16 rows and more of a 16-bit model, K a multiple of 512: cuBLASLt's block scaling through
  ``torch._scaled_mm``;
- anything else: ``fp8_linear.fp8_gemm`` with ``group``, each 128-wide K tile's product scaled
  by its two scales before it is added (``block_launch`` picks the launch).

A layer keeps its scales one row per weight row ([N, K / 128], for any shard) and, where its
rows fall in whole blocks, one per block too (``block_scales``, after loading). The
plain-PyTorch path is the reference (tests/gpu/test_fp8_kernels.py; in Triton's interpreter
tests/unit/test_fp8_kernels.py).
"""

import torch
import triton
import triton.language as tl

from services.worker.engine.ops.dependent_launch import await_inputs, launch_options
from services.worker.engine.ops.fp8_linear import (
    _quantize,
    _scale_of,
    fp8_gemm,
    fp8_gemv,
)
from services.worker.engine.quantization.fp8_math import FP8, Codes


@triton.jit
def store_group_codes(x, ok, Q, S, stride_sg, g0, G, GROUPS: tl.constexpr, GROUP: tl.constexpr,
                      GPU: tl.constexpr):  # fmt: skip
    """A row's ``x`` (float32 [GROUPS, GROUP], masked lanes 0) quantized a group at a time, as
    the reference's ``token_group``: each group's scale max |x| / FP8_MAX (at least MIN_SCALE)
    to S (groups ``g0``, ``g0`` + 1, ... ``stride_sg`` apart, those from G on not stored), the
    codes to the pointers Q ([GROUPS, GROUP])."""
    xs = _scale_of(tl.max(tl.abs(x), 1))
    r = tl.math.div_rn(1.0, xs)
    groups = g0 + tl.arange(0, GROUPS)
    tl.store(S + groups * stride_sg, xs, mask=groups < G)
    tl.store(Q, _quantize(x, xs[:, None], r[:, None], GPU), mask=ok)


@triton.jit
def _quantize_groups_kernel(
    X, Q, S, K, G, stride_x, stride_q, stride_sm, stride_sg,
    GROUP: tl.constexpr, GROUPS: tl.constexpr, GPU: tl.constexpr, USE_PDL: tl.constexpr = False,
):  # fmt: skip
    """A row's GROUPS consecutive groups of GROUP columns each quantized with a scale of its own
    (``store_group_codes``): a [GROUPS, GROUP] tile a program. S: [M, G] float32 (strides
    ``stride_sm``, ``stride_sg``)."""
    await_inputs(USE_PDL)
    row = tl.program_id(0).to(tl.int64)
    g0 = tl.program_id(1) * GROUPS
    groups = g0 + tl.arange(0, GROUPS)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = (groups < G)[:, None] & (cols < K)
    x = tl.load(X + row * stride_x + cols, mask=ok, other=0.0).to(tl.float32)
    store_group_codes(x, ok, Q + row * stride_q + cols, S + row * stride_sm, stride_sg, g0, G,
                      GROUPS, GROUP, GPU)  # fmt: skip


def group_codes_out(
    rows: int, k: int, group: int, like: torch.Tensor, rows_multiple: int = 1
) -> Codes:
    """Room for ``rows`` rows of ``k`` codes and their scales a ``group`` columns (stored column
    by column), of an activation like ``like``; with ``rows_multiple`` both have rows up to
    the next multiple of it."""
    rows = triton.cdiv(rows, rows_multiple) * rows_multiple
    q = torch.empty((rows, k), dtype=FP8, device=like.device)
    s = torch.empty((triton.cdiv(k, group), rows), dtype=torch.float32, device=like.device).t()
    return Codes(q, s, like.dtype)


def quantize_groups(x: torch.Tensor, group: int, rows_multiple: int = 1) -> Codes:
    """x: [M, K] → its codes and a scale per token and ``group`` columns ([M, K / group], the
    last group partial when ``group`` does not divide K; stored column by column, the layout
    cuBLASLt's block scaling reads): the reference's ``token_group`` rounding (block
    checkpoints), one Triton kernel. With ``rows_multiple`` both have rows up to the next
    multiple of it, those past M unwritten."""
    x = x.contiguous()
    m, k = x.shape
    out = group_codes_out(m, k, group, x, rows_multiple)
    g = out.scales.shape[1]
    groups = min(triton.next_power_of_2(g), max(1, 1024 // group))  # ~1,024 columns a program
    _quantize_groups_kernel[(m, triton.cdiv(g, groups))](
        x, out.codes, out.scales, k, g, x.stride(0), out.codes.stride(0), *out.scales.stride(),
        GROUP=group, GROUPS=groups, GPU=x.is_cuda, num_warps=4, **launch_options(x),
    )  # fmt: skip
    return out


def block_launch(m: int, n: int, k: int, group: int, sms: int) -> dict[str, int]:
    """``_fp8_gemm_kernel``'s launch for block checkpoints (K tiles of one scale group) where
    cuBLASLt's block scaling is not taken: weight rows on the tensor cores' wide side (64 a
    tile), the activation rows on the narrow one; K split until the tiles and slices make about
    three programs an SM, with at least eight K tiles a slice. (The fastest launches of
    ``benchmarks/kernels/fp8_mm.py --block`` at 1 and 16 rows on an H200 are such:
    docs/performance.md, "FP8": block checkpoints.)"""
    block_m = min(128, max(16, triton.next_power_of_2(m)))
    tiles = triton.cdiv(n, 64) * triton.cdiv(m, block_m)
    splits = max(1, min(triton.cdiv(3 * sms, tiles), triton.cdiv(k, group) // 8))
    return {"BLOCK_N": 64, "BLOCK_M": block_m, "BLOCK_K": group, "SPLITS": splits,
            "num_warps": 4, "num_stages": 4}  # fmt: skip


# cuBLASLt's block scaling (1 × 128 activations, 128 × 128 weights) from this many rows
# (it refuses one row; against our kernel: docs/performance.md, "FP8", block checkpoints)
CUBLAS_BLOCK_ROWS = 16


def fp8_block_mm(
    x: torch.Tensor | Codes,
    weight: torch.Tensor,
    weight_scale: torch.Tensor,
    bias: torch.Tensor | None,
    group: int,
    block_scales: torch.Tensor | None = None,
    config: dict[str, int] | None = None,
    fast_accumulation: bool = False,
) -> torch.Tensor:
    """A block checkpoint's product, any number of rows, in x's dtype: the rows quantized per
    token and ``group`` columns (``quantize_groups``; or ``x`` is those codes already, from the
    fused kernel before the layer), then, given ``block_scales`` (the weight's scale a block,
    [K / group, N / group]: ``block_scales()``),

    - one row: the FP8 GEMV, each column's two scales taken into its sums (``fast_accumulation``
      as ``fp8_gemv``'s);
    - CUBLAS_BLOCK_ROWS rows and more of a 16-bit model, K a multiple of four groups:
      cuBLASLt's block scaling (``torch._scaled_mm``), over rows padded to a multiple of four
      (it refuses others; the padding rows' outputs are dropped). With K of 2, 3 or 5 groups
      it ran without complaint on an H200 (torch 2.11, CUDA 13.0) and returned wrong products
      (docs/performance.md, "FP8": block checkpoints), hence the rule;

    else ``fp8_gemm`` with a scale pair a K tile, over ``weight_scale`` (a block's scale on
    each of its rows: [N, K / group]), at ``config`` (``block_launch``'s by default)."""
    if isinstance(x, Codes):
        assert x.scales.shape[1] == triton.cdiv(x.codes.shape[1], group), "codes in groups"
        codes = x
    m, k = codes.codes.shape if isinstance(x, Codes) else x.shape
    cublas = m >= CUBLAS_BLOCK_ROWS and k % (4 * group) == 0 and x.dtype != torch.float32
    if block_scales is not None and cublas:
        if not isinstance(x, Codes):
            codes = quantize_groups(x, group, rows_multiple=4)
        elif m % 4:
            codes = _rows_of_four(x, group)
        y = torch._scaled_mm(codes.codes, weight.t(), scale_a=codes.scales, scale_b=block_scales,
                             out_dtype=x.dtype)[:m]  # fmt: skip
        return y if bias is None else y + bias
    if not isinstance(x, Codes):
        codes = quantize_groups(x, group)
    if block_scales is not None and m == 1:
        return fp8_gemv(codes, weight, block_scales, bias, fast_accumulation=fast_accumulation,
                        group=group)  # fmt: skip
    if config is None:
        sms = 4
        if weight.is_cuda:
            sms = torch.cuda.get_device_properties(weight.device).multi_processor_count
        config = block_launch(m, weight.shape[0], k, group, sms)
    return fp8_gemm(codes, weight, weight_scale, bias, config, group=group)


def _rows_of_four(codes: Codes, group: int) -> Codes:
    """``codes`` with rows up to a multiple of four (cuBLASLt's block scaling takes no others),
    the padding rows unwritten: a copy."""
    m, k = codes.codes.shape
    out = group_codes_out(m, k, group, codes.codes, rows_multiple=4)
    out.codes[:m].copy_(codes.codes)
    out.scales[:m].copy_(codes.scales)
    return Codes(out.codes, out.scales, codes.dtype)


def block_scales(weight_scale: torch.Tensor, group: int) -> torch.Tensor | None:
    """The per-block weight scales cuBLASLt takes ([K / group, N / group], a transposed view)
    from a layer's per-row ones ([N, K / group]), or None where the rows do not fall in whole
    blocks of one scale each (N not a multiple of ``group``, or a shard's rows off the block
    grid)."""
    n = weight_scale.shape[0]
    if n % group:
        return None
    blocks = weight_scale[::group].contiguous()
    if not torch.equal(blocks.repeat_interleave(group, 0), weight_scale):
        return None
    return blocks.t()


__all__ = [
    "CUBLAS_BLOCK_ROWS", "block_launch", "block_scales", "fp8_block_mm", "group_codes_out",
    "quantize_groups", "store_group_codes",
]  # fmt: skip
