"""SiLU(gate) · up on a stacked [gate ‖ up] projection."""

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.models.quantization import Codes


class SiluAndMul(nn.Module):
    def __init__(self, fused: bool = False):
        super().__init__()
        self.fused = fused

    def forward(self, x: torch.Tensor, group: int = 0) -> torch.Tensor | Codes:
        """``group``: write the codes the FP8 layer after this one takes, a scale every
        ``group`` columns (as RMSNorm's)."""
        if self.fused:
            from services.worker.engine.ops.fused_ops import silu_and_mul

            return silu_and_mul(x, group)
        assert not group, "codes come from the fused kernel"
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
