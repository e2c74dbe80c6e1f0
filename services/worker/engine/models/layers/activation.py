"""SiLU(gate) · up on a stacked [gate ‖ up] projection."""

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from services.worker.engine.models.layers.linear import LinearBase
from services.worker.engine.quantization.fp8_math import Codes


class SiluAndMul(nn.Module):
    def __init__(self, fused: bool = False, feeds: LinearBase | None = None):
        super().__init__()
        self.fused = fused
        # as RMSNorm's: the codes the layer after takes, when it takes codes
        self.codes_for: Callable[[torch.Tensor], int] | None = None
        if fused and feeds is not None:
            self.codes_for = feeds.input_group

    def forward(self, x: torch.Tensor) -> torch.Tensor | Codes:
        if self.fused:
            from services.worker.engine.ops.fused_ops import silu_and_mul

            return silu_and_mul(x, self.codes_for(x) if self.codes_for else 0)
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
