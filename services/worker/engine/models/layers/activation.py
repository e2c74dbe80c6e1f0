"""SiLU(gate) · up on a stacked [gate ‖ up] projection."""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.models.quantization import Codes


class SiluAndMul(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor, quantize: bool = False) -> torch.Tensor | Codes:
        """``quantize``: write the codes the FP8 layer after this one takes (as RMSNorm's)."""
        if self.fused:
            from services.worker.engine.models.layers.fused_ops import silu_and_mul

            return silu_and_mul(x, quantize)
        assert not quantize, "codes come from the fused kernel"
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
