"""What the mixture-of-experts kernels' two paths share (``ops/fused_moe.py``'s grouped GEMMs,
``ops/moe_gemv.py``'s few-token GEMVs): the epilogue's arithmetic, each step rounded where
Hugging Face's experts round, so that both paths give one result up to float32 summation
order; the activations' FP8 codes; and the operands as the kernels take them."""

import torch
import triton
import triton.language as tl

from services.worker.engine.ops.fp8_block import quantize_groups
from services.worker.engine.ops.fp8_linear import quantize_rows
from services.worker.engine.quantization.fp8_math import Codes

TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def activate(gate, up, alpha, limit, DTYPE: tl.constexpr, CLAMPED: tl.constexpr):
    """silu(gate) · up (``CLAMPED``: gpt-oss's SwiGLU) of float32 sums, in x's dtype, each
    step rounded as ``FusedMoE.activate``'s tensors in x's dtype (the sums first, as a GEMM in
    x's dtype writes them)."""
    g = gate.to(DTYPE).to(tl.float32)
    u = up.to(DTYPE).to(tl.float32)
    if CLAMPED:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        sig = tl.sigmoid((g * alpha).to(DTYPE).to(tl.float32)).to(DTYPE).to(tl.float32)
        glu = (g * sig).to(DTYPE).to(tl.float32)
        y = (u + 1.0).to(DTYPE).to(tl.float32) * glu
    else:
        y = (g * tl.sigmoid(g)).to(DTYPE).to(tl.float32) * u
    return y.to(DTYPE)


@triton.jit
def weighted(acc, weight, DTYPE: tl.constexpr):
    """An expert's output (float32 sums) rounded to x's dtype, times its routing weight,
    rounded again: Hugging Face's experts' ``(expert(x) * weight).to(dtype)``."""
    return (acc.to(DTYPE).to(tl.float32) * weight).to(DTYPE)


def quantize_input(x: torch.Tensor, block: int | None) -> Codes:
    """x's e4m3 codes as the FP8 experts multiply them: per token (``block`` None) or per token
    and ``block`` columns; ``fp8_math.quantize_activations``' rounding ("token",
    "token_group")."""
    if block is None:
        q, s = quantize_rows(x)
        return Codes(q, s, x.dtype)
    return quantize_groups(x, block)


def operand(a: torch.Tensor | Codes) -> tuple[torch.Tensor, torch.Tensor, tuple[int, ...]]:
    """An activation as a kernel takes it: (its values or codes, its scales (the values again
    when it has none: unread), the scales' two strides)."""
    if isinstance(a, Codes):
        return a.codes, a.scales, tuple(a.scales.stride())
    return a, a, (0, 0)


def weight_scales(
    w: torch.Tensor, scale: torch.Tensor | None
) -> tuple[torch.Tensor, tuple[int, ...]]:
    """An expert weight's scales as a kernel takes them ([E, rows, 1] or [E, row blocks,
    column blocks]; w itself where there are none: unread) and their three strides."""
    if scale is None:
        return w, (0, 0, 0)
    return scale, (*scale.stride(), 0)[:3]


__all__ = ["TL_DTYPES", "activate", "operand", "quantize_input", "weight_scales", "weighted"]
