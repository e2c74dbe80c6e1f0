"""MXFP4 (the OCP microscaling format), as openai publishes gpt-oss's experts: each weight row
in blocks of 32 values, each value a 4-bit float (e2m1: ±0, 0.5, 1, 1.5, 2, 3, 4, 6) and each
block one shared power of two (an e8m0 exponent, biased by 127).

A checkpoint stores a projection of every expert as two tensors:

    <proj>_blocks  uint8 [E, rows, cols / 32, 16]  two values a byte: the low nibble the even
                                                   column, the high nibble the odd one
    <proj>_scales  uint8 [E, rows, cols / 32]      the blocks' exponents + 127

with rows the projection's outputs ([out, in], as a linear layer multiplies). The engine
dequantizes them at load into the model's dtype (every e2m1 value times a power of two is
exact in bfloat16 and float32): the experts then run as a bf16 checkpoint's would, or, with
``--quantization fp8``, are quantized again as a float checkpoint's are.
"""

import torch

# an e2m1 code's value (sign bit 3, then two exponent bits and one mantissa bit)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK = 32  # values a scale covers
SCALE_BIAS = 127


def dequantize(blocks: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[..., rows, groups, 16] codes and [..., rows, groups] exponents → [..., rows, groups
    · 32] values in ``dtype``."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales are uint8, got {blocks.dtype} and "
                         f"{scales.dtype}")  # fmt: skip
    if blocks.shape[-1] != BLOCK // 2 or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales "
                         f"{tuple(scales.shape)} (16 bytes a block of 32)")  # fmt: skip
    table = torch.tensor(E2M1, dtype=torch.float32, device=blocks.device)
    codes = torch.stack([blocks & 0x0F, blocks >> 4], dim=-1).flatten(-2).int()  # [..., 32]
    exponents = scales.to(torch.int32) - SCALE_BIAS
    values = torch.ldexp(table[codes], exponents.unsqueeze(-1))
    return values.flatten(-2).to(dtype)


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The MXFP4 codes and exponents of [..., rows, cols] ``weight`` (cols a multiple of 32):
    each block's power of two the smallest that brings its largest value within 6, each value
    the nearest e2m1 one (of two as near, the smaller). For tiny test checkpoints
    (``baton make-tiny-model --quantize mxfp4``)."""
    *lead, cols = weight.shape
    if cols % BLOCK:
        raise ValueError(f"MXFP4 rows of {cols} values do not split into blocks of {BLOCK}")
    w = weight.float().reshape(*lead, cols // BLOCK, BLOCK)
    amax = w.abs().amax(dim=-1).clamp(min=2.0**-126)
    exponents = torch.ceil(torch.log2(amax / 6.0)).clamp(-SCALE_BIAS, SCALE_BIAS)
    scaled = w / torch.ldexp(torch.ones_like(exponents), exponents.int()).unsqueeze(-1)
    magnitudes = torch.tensor(E2M1[:8], dtype=torch.float32)
    nearest = (scaled.abs().unsqueeze(-1) - magnitudes).abs().argmin(dim=-1)
    codes = nearest | ((scaled < 0) & (nearest > 0)).long() << 3
    packed = (codes[..., 0::2] | codes[..., 1::2] << 4).to(torch.uint8)
    return packed, (exponents + SCALE_BIAS).to(torch.uint8)
