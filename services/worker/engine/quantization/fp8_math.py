"""The FP8 (e4m3) arithmetic, in plain PyTorch: how weights, activations and KV cache entries
are rounded, and ``Codes``, an activation already quantized. It runs everywhere (CI included)
and is the reference the GPU kernels (``ops/fp8_linear.py``, ``ops/fp8_block.py``) are tested
against: the FP8 methods' fallback path quantizes exactly as the kernels would, then multiplies
dequantized.
"""

from dataclasses import dataclass

import torch

FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value


@dataclass(frozen=True, slots=True)
class Codes:
    """An activation already quantized, per token or per token and ``group`` columns, as a
    fused kernel before an FP8 layer hands it over (``ops/fused_ops``: RMSNorm, SiLU·mul)
    or a layer's own quantization pass writes it: the same codes and scales
    ``quantize_activations(x, "token" or "token_group", ...)`` rounds ``x`` to."""

    codes: torch.Tensor  # float8_e4m3fn [rows, K]
    # float32 [rows, K / group]: x ≈ codes · scales (per token: [rows, 1]; in groups stored
    # column by column, strides (1, rows), the layout cuBLASLt's block scaling reads)
    scales: torch.Tensor
    dtype: torch.dtype  # the activation's dtype, which the layer's output takes

    @property
    def rows(self) -> int:
        return self.codes.shape[0]


def divide(x: torch.Tensor, by: float | torch.Tensor) -> torch.Tensor:
    """``x / by`` in float32, correctly rounded on every device, as the kernels divide
    (``div_rn``). PyTorch's CUDA division by a Python number multiplies by its reciprocal
    instead, which differs in the last bit for some values: 27 of 37 activation scales of one
    test on an H200."""
    if not isinstance(by, torch.Tensor):
        by = torch.full((), by, dtype=torch.float32, device=x.device)
    return x.float() / by.float()


def to_e4m3(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """The e4m3 codes of ``x / scale``, saturated at e4m3's largest finite value and rounded to
    nearest even: how every FP8 weight, activation and KV cache entry here is written."""
    return divide(x, scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)


def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row (output channel) e4m3 quantization: (w_fp8, scale [rows, 1])."""
    scale = divide(w.abs().amax(dim=1, keepdim=True), FP8_MAX).clamp(min=1e-12)
    return to_e4m3(w, scale), scale


def quantize_blocks(w: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """e4m3 quantization in ``block`` × ``block`` blocks (the last ones partial), as block
    checkpoints store a weight: (w_fp8, a scale per block [rows / block, cols / block])."""
    rows, cols = w.shape
    pr, pc = -(-rows // block), -(-cols // block)
    padded = torch.nn.functional.pad(w.float(), (0, pc * block - cols, 0, pr * block - rows))
    blocks = padded.view(pr, block, pc, block)
    scale = divide(blocks.abs().amax(dim=(1, 3)), FP8_MAX).clamp(min=1e-12)
    q = to_e4m3(blocks, scale[:, None, :, None]).view(pr * block, pc * block)
    return q[:rows, :cols].contiguous(), scale


def quantize_activations(
    x: torch.Tensor, scheme: str, block: int, static_scale: torch.Tensor | None
) -> torch.Tensor:
    """``x`` rounded through e4m3 as the FP8 GEMM would see it, back in ``x``'s dtype."""
    xf = x.float()
    if scheme == "static":
        assert static_scale is not None
        scale = static_scale.float()
    elif scheme == "token":
        scale = divide(xf.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp(min=1e-12)
    else:  # token_group: one scale per token and ``block`` columns
        rows, cols = xf.shape
        groups = xf.view(rows, -1, block) if cols % block == 0 else None
        if groups is None:  # a last partial group (tiny models)
            pad = torch.nn.functional.pad(xf, (0, -cols % block))
            groups = pad.view(rows, -1, block)
        s = divide(groups.abs().amax(dim=-1, keepdim=True), FP8_MAX).clamp(min=1e-12)
        q = to_e4m3(groups, s).float() * s
        return q.reshape(rows, -1)[:, :cols].to(x.dtype)
    return (to_e4m3(xf, scale).float() * scale).to(x.dtype)


def dequantize(w: torch.Tensor, scale: torch.Tensor, cols: torch.Tensor | None) -> torch.Tensor:
    """``w_fp8 · scale`` in float32; ``cols`` maps each column to its scale column (blocks)."""
    s = scale if cols is None else scale[:, cols]
    return w.float() * s
