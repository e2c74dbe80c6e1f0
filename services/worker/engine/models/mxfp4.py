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

from services.worker.engine.models.weights import Loaded, full

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


class Mxfp4Slices:
    """One expert's projection of an MXFP4 checkpoint as ``CheckpointTensor`` reads a handle
    (as ``weights.GGUFSlices`` does a GGUF tensor): the shape of its values, [rows, cols], and
    any region of them dequantized from only the codes and exponents it needs (its rows, and
    the 32-column blocks its columns fall in), on ``device``. ``every`` and ``first`` pick the
    stored rows it is made of (gpt-oss's gate: every second row from 0; its up: from 1), so a
    tensor-parallel rank's narrowing reads only its rows."""

    def __init__(self, blocks: Loaded, scales: Loaded, device: torch.device,
                 every: int = 1, first: int = 0):  # fmt: skip
        self.blocks, self.scales, self.device = blocks, scales, device
        self.every, self.first = every, first

    def get_shape(self) -> tuple[int, int]:
        rows, groups = self.blocks.shape[0], self.blocks.shape[1]
        return (rows - self.first + self.every - 1) // self.every, groups * BLOCK

    def __getitem__(self, region: tuple[slice, ...]) -> torch.Tensor:
        rows, cols = region
        start = self.first + rows.start * self.every  # the stored rows: one run, then a step
        count = (rows.stop - rows.start - 1) * self.every + 1
        lo, hi = cols.start // BLOCK, -(-cols.stop // BLOCK)
        codes, exponents = (
            full(t.narrow(0, start, count).narrow(1, lo, hi - lo))[:: self.every].to(self.device)
            for t in (self.blocks, self.scales)
        )
        values = dequantize(codes, exponents, torch.float32)
        return values[:, cols.start - lo * BLOCK : cols.stop - lo * BLOCK]
